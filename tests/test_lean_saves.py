"""The block's lean autograd functions: the same values and gradients as the plain ops, and
exactly the saved tensors they promise (counted with saved-tensor hooks)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from fived.model import layers as L  # noqa: E402
from fived.train.activations import SavedTensors  # noqa: E402


def _leaf(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()


def _grads(fn, *xs):
    out = fn(*xs)
    (gx,) = (torch.autograd.grad(out, xs, torch.ones_like(out) * 0.37),)
    return out.detach(), [g.detach() for g in gx]


def test_swiglu_equals_plain_and_saves_gate_and_up():
    g, u = _leaf(3, 5, 8, seed=1), _leaf(3, 5, 8, seed=2)
    want, wgrads = _grads(lambda a, b: F.silu(a) * b, g, u)
    got, grads = _grads(L.swiglu, g, u)
    assert torch.equal(got, want)
    for a, b in zip(grads, wgrads):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(L.swiglu, (g, u))
    with SavedTensors() as s:
        L.swiglu(g * 1, u * 1)  # non-leaf inputs, as in the MLP
    assert (s.count, s.bytes) == (2, 2 * g.numel() * 8)
    with SavedTensors() as plain:
        F.silu(g * 1) * (u * 1)
    assert plain.bytes == 3 * g.numel() * 8  # gate, silu(gate), up: the term it saves


def _plain_norm(x, w, eps):
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.to(xf.dtype)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rmsnorm_equals_plain_and_saves_input_and_rsqrt(dtype):
    norm = L.RMSNorm(16, 1e-5, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 16, dtype=dtype))
    x = _leaf(2, 7, 16, seed=3, dtype=dtype)
    want, (wx, ww) = _grads(lambda a, w: _plain_norm(a, w, 1e-5), x, norm.weight)
    got, (gx, gw) = _grads(lambda a, w: norm(a), x, norm.weight)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(got, want, rtol=tol, atol=tol)
    assert torch.allclose(gx, wx, rtol=tol, atol=tol)
    assert torch.allclose(gw, ww, rtol=tol, atol=tol)
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(lambda a, w: L._RMSNorm.apply(a, w, 1e-5),
                                        (x, norm.weight))
    with SavedTensors(exclude=[norm.weight]) as s:
        norm(x * 1)
    # x (as given) and one 1/rms per token (fp32; float64 for a float64 input), nothing more
    assert s.bytes == x.numel() * x.element_size() + 2 * 7 * max(4, x.element_size())


def test_gqa_attention_equals_repeated_and_saves_kv_heads():
    b, s, hq, hkv, d = 2, 32, 4, 2, 8
    q = _leaf(b, s, hq, d, seed=4, dtype=torch.float32)
    k = _leaf(b, s, hkv, d, seed=5, dtype=torch.float32)
    v = _leaf(b, s, hkv, d, seed=6, dtype=torch.float32)

    def repeated(q, k, v):
        return L.flash_attention(q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2))

    want, wg = _grads(repeated, q, k, v)
    got, gg = _grads(L.flash_attention, q, k, v)
    assert torch.allclose(got, want, atol=1e-6)
    for a, c in zip(gg, wg):
        assert torch.allclose(a, c, atol=1e-5)
    with SavedTensors() as saved:
        L.flash_attention(q * 1, k * 1, v * 1)
    # q, k, v (kv heads), the output and the fp32 log-sum-exp: what the flash kernel keeps
    assert saved.bytes == 4 * (2 * b * s * hq * d + 2 * b * s * hkv * d + b * hq * s)
    sizes = []  # the dry run's device: the same bytes, nothing materialised

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        L.flash_attention(*(t.detach().to("meta").requires_grad_() * 1 for t in (q, k, v)))
    assert 0 <= sum(sizes) - saved.bytes <= 32  # + the CUDA op's rng seed and offset
