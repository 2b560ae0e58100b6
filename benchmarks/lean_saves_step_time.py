"""bf16 tp1 fwd+bwd of the whole `small` model (micro-batch 8), today's ops (plain autograd:
silu·up kept, fp32 norm math, K/V repeated) vs the lean ones, swapped in and out of the same
model and alternated, 11 rounds x 5 steps; ratio of medians."""
import math
import statistics
import time

import torch
import torch.nn.functional as F

from fived.config import preset
from fived.model import build_model, layers

m = preset("small")
model = build_model(m, 1, dtype=torch.bfloat16)
x = torch.randint(0, m.vocab, (8, m.seq_len))
pos = torch.arange(m.seq_len)
new_fwd = (layers.RMSNorm.forward, layers.MLP.forward, layers.CausalAttention.forward)

def old_norm(self, x):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
    return (y * self.weight.float()).to(x.dtype)

def old_mlp(self, x):
    return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

def old_attn(self, q, k, v):
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, scale=1.0 / math.sqrt(q.shape[-1]))
    return o.transpose(1, 2)

def use(new):
    layers.RMSNorm.forward, layers.MLP.forward, layers.CausalAttention.forward = (
        new_fwd if new else (old_norm, old_mlp, old_attn))

def run(n):
    for _ in range(n):
        model(x, pos, x).backward()

t = {0: [], 1: []}
for new in (0, 1):
    use(new)
    run(2)
for r in range(11):
    for new in ((0, 1) if r % 2 == 0 else (1, 0)):
        use(new)
        t0 = time.perf_counter()
        run(5)
        t[new].append((time.perf_counter() - t0) / 5)
mo, mn = statistics.median(t[0]), statistics.median(t[1])
print(f"step fwd+bwd bf16 tp1: today {mo*1e3:.1f} ms, lean {mn*1e3:.1f} ms, ratio {mn/mo:.3f}")
