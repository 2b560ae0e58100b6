#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md): unattended, at most ~10 minutes on one GPU, one JSON
# summary on stdout (progress on stderr). NOT YET RUN ON GPU HARDWARE.
#
#   benchmarks/gpu_check.sh [OUT_DIR]        # default OUT_DIR: a fresh temporary directory
#
# 1. fp32 parity, one GPU against the CPU reference, model `tiny`, 5 steps: losses within 1e-5.
# 2. bf16 training of a ~1.5B Llama-3-shaped model (h 2048, 16 layers, seq 2048) on one GPU:
#    tokens/s and MFU against the device's dense bf16 peak (fived.ledger.hardware), and the
#    measured torch.cuda.max_memory_allocated (and the traced live tensors, --memory-trace) next
#    to the ledger's step peak (fived.ledger.peak).
#    And ring context parallelism's block kernel (memory-efficient attention) against the math.
# 3. with >= 2 GPUs: tp2 and dp2 (fp32, tiny) over NCCL against the one-GPU run: losses 1e-5.
# 4. fp8: the model of 2 with --fp8 tensorwise, rowwise, blockwise (bf16 around them): tokens/s
#    and max_memory_allocated beside the bf16 run of 2; each recipe's last loss within 5 % of
#    bf16's (a recipe whose run fails is reported with its error, and fails the check).
# Exit status: 0 when every check that ran passed, 1 otherwise, 2 when no GPU is visible.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-$here/.venv/bin/python}"
out="${1:-$(mktemp -d -t fived-gpu-check.XXXXXX)}"
mkdir -p "$out"
log() { printf '[gpu_check %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

gpus="$("$py" -c 'import torch; print(torch.cuda.device_count())')"
if [ "$gpus" -lt 1 ]; then
  printf '{"gpus": 0, "ok": false, "error": "no GPU visible to torch"}\n'
  exit 2
fi
log "$gpus GPU(s); results in $out"

fived() { timeout "${STEP_TIMEOUT:-240}" "$py" -m fived "$@"; }

# 1. tiny, fp32: one GPU vs the CPU (FIVED_DEVICE=cpu forces cpu+gloo)
common=(--model tiny --steps 5 --global-batch 8 --precision fp32)
log "1/4 tiny fp32 on the CPU (reference)"
FIVED_DEVICE=cpu fived train "${common[@]}" --nprocs 1 --metrics-out "$out/cpu.jsonl" >&2
log "1/4 tiny fp32 on one GPU"
fived train "${common[@]}" --nprocs 1 --metrics-out "$out/gpu1.jsonl" >&2

# 1b. ring context parallelism's block kernel on the GPU (memory-efficient attention with its
# log-sum-exp) against the explicit math: outputs, lse and gradients within 1e-4
log "1/3 ring attention's GPU block kernel vs the math"
timeout 120 "$py" "$here/benchmarks/ring_kernels.py" --device cuda > "$out/ring_kernels.txt" \
  || log "ring kernel check FAILED (see $out/ring_kernels.txt)"

# 2. a ~1.5B model in bf16 on one GPU
cat > "$out/1b.toml" <<'TOML'
[model]
name = "llama3-8b"  # its vocab and rope; the shape below is ~1.5B
hidden = 2048
layers = 16
heads = 32
kv_heads = 8
ffn = 8192
seq_len = 2048
[parallel]
precision = "bf16"
[train]
steps = 12
global_batch = 4
warmup = 2
TOML
log "2/4 ~1.5B bf16 on one GPU"
fived train --config "$out/1b.toml" --nprocs 1 --memory-trace --metrics-out "$out/1b.jsonl" >&2

# 3. tp2 and dp2 over NCCL
if [ "$gpus" -ge 2 ]; then
  log "3/4 tiny fp32, tp2 over NCCL"
  fived train "${common[@]}" --tp 2 --nprocs 2 --metrics-out "$out/tp2.jsonl" >&2
  log "3/4 tiny fp32, dp2 over NCCL"
  fived train "${common[@]}" --dp 2 --nprocs 2 --metrics-out "$out/dp2.jsonl" >&2
else
  log "3/4 skipped: one GPU"
fi

# 4. fp8 recipes on the model of 2 (bf16 around the fp8 products)
for recipe in tensorwise rowwise blockwise; do
  log "4/4 ~1.5B bf16 + --fp8 $recipe on one GPU"
  fived train --config "$out/1b.toml" --nprocs 1 --fp8 "$recipe" \
    --metrics-out "$out/fp8-$recipe.jsonl" >&2 2> "$out/fp8-$recipe.err" \
    || log "4/4 --fp8 $recipe failed (see $out/fp8-$recipe.err)"
done

# the summary
"$py" - "$out" "$gpus" <<'PY'
import json
import statistics
import sys

import torch

from fived.ledger.compute import model_flops_per_token
from fived.ledger.hardware import PRESETS as HARDWARE
from fived.ledger.memory import rank_memory
from fived.ledger.params import total_params
from fived.ledger.traffic import micro_batch_size
from fived.ledger.verify import predict_peak, run_of_file

out, gpus = sys.argv[1], int(sys.argv[2])


def records(name):
    with open(f"{out}/{name}.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(name):
    return [r["loss"] for r in records(name)]


def rel(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


name = torch.cuda.get_device_name(0)
key = next((k for k in HARDWARE if k.split("-")[0] in name.lower()), None)
peak = HARDWARE[key].peak_flops if key else None
summary = {"gpus": gpus, "device": name, "hardware_preset": key, "checks": {}}
ref = losses("cpu")
d = rel(losses("gpu1"), ref)
summary["checks"]["fp32_tiny_gpu_vs_cpu"] = {"max_rel_diff": d, "ok": d <= 1e-5}

try:
    with open(f"{out}/ring_kernels.txt") as f:
        ring = f.read().splitlines()
    gap = float(ring[-1].split()[2])
    summary["checks"]["ring_block_kernel"] = {"largest_gap": gap, "ok": gap <= 1e-4}
except (OSError, IndexError, ValueError):
    summary["checks"]["ring_block_kernel"] = {"ok": False, "error": "no result"}

recs = records("1b")
m, par, gb = run_of_file(f"{out}/1b.jsonl")
tps = statistics.median(r["tokens_per_s"] for r in recs[2:])
mfu = model_flops_per_token(m) * tps / peak if peak else None
ledger = rank_memory(m, par, micro_batch_size(par, gb))
measured = max(r.get("cuda_max_allocated", 0) for r in recs)
traced = max(r.get("memory_trace_per_rank", [0])[0] for r in recs)
step_peak = predict_peak(m, par, gb, 0)
summary["checks"]["bf16_1b"] = {
    "params": total_params(m), "tokens_per_s": tps, "mfu": mfu, "peak_flops": peak,
    "losses_first_last": [recs[0]["loss"], recs[-1]["loss"]],
    "cuda_max_allocated": measured,
    "ledger_states": ledger.states_total, "ledger_activations": ledger.activations_total,
    "ledger_buffers": ledger.buffers_total, "ledger_step_peak": step_peak,
    "traced_peak": traced, "traced_over_ledger_peak": traced / step_peak,
    "measured_over_ledger_peak": measured / step_peak,
    "ok": recs[-1]["loss"] < recs[0]["loss"]}
for recipe in ("tensorwise", "rowwise", "blockwise"):
    try:
        fr = records(f"fp8-{recipe}")
    except FileNotFoundError:
        fr = []
    if len(fr) < 3:
        with open(f"{out}/fp8-{recipe}.err") as f:
            summary["checks"][f"fp8_{recipe}_1b"] = {"ok": False, "error": f.read()[-2000:]}
        continue
    ftps = statistics.median(r["tokens_per_s"] for r in fr[2:])
    fmem = max(r.get("cuda_max_allocated", 0) for r in fr)
    summary["checks"][f"fp8_{recipe}_1b"] = {
        "tokens_per_s": ftps, "speedup_vs_bf16": ftps / tps,
        "cuda_max_allocated": fmem, "memory_vs_bf16": fmem / measured if measured else None,
        "losses_first_last": [fr[0]["loss"], fr[-1]["loss"]],
        "ok": abs(fr[-1]["loss"] - recs[-1]["loss"]) <= 0.05 * recs[-1]["loss"]}
if gpus >= 2:
    for lay in ("tp2", "dp2"):
        d = rel(losses(lay), losses("gpu1"))
        summary["checks"][f"fp32_tiny_{lay}_nccl"] = {"max_rel_diff": d, "ok": d <= 1e-5}
summary["ok"] = all(c["ok"] for c in summary["checks"].values())
print(json.dumps(summary, indent=1))
sys.exit(0 if summary["ok"] else 1)
PY
