#!/bin/bash
# Masked vs unmasked step time (issue 41): `small` at seq 2048, one rank, global batch 1, three
# steps (the first is warm-up), on corpora whose documents are exactly L tokens with their EOS
# (L = S, S/4, S/16: Σ Lᵢ² = S·L, so masked attention should cost L/S of unmasked).
#   cd /some/empty/dir && bash /path/to/fived/benchmarks/doc_mask_step.sh
# Prints each run's step seconds. Needs a quiet machine: under load the same step varies 3-6×.
F=${FIVED:-fived}
for L in 2048 512 128; do
  [ -f d$L.jsonl ] || python3 -c "
import json, random
r = random.Random(0)
with open('d$L.jsonl','w') as f:
    for i in range(2048 * 40 // $L):
        f.write(json.dumps({'text': ''.join(r.choice('abcdefgh ') for _ in range($L - 1))}) + '\n')
"
  [ -d data$L ] || $F data prepare d$L.jsonl --out data$L --val-fraction 0.01 --workers 1 > /dev/null
  for m in unmasked --doc-mask; do
    flag=$m; [ $m = unmasked ] && flag=
    rm -f r$L$m.jsonl
    $F train --data data$L --model small --seq-len 2048 --global-batch 1 --steps 3 --nprocs 1 $flag --metrics-out r$L$m.jsonl > /dev/null 2>&1
    python3 - <<PY
import json
rs = []
for l in open('r$L$m.jsonl'):
    try: rs.append(json.loads(l))
    except ValueError: pass
s = [r['seconds'] for r in rs if 'seconds' in r and r.get('step', 0) >= 1]
print('doc len $L', '$m', 'step seconds (steps 1-2)', [round(x, 2) for x in s], 'min', round(min(s), 2), flush=True)
PY
  done
done
