"""fp8 linear layers with current (dynamic) scaling: tensorwise, rowwise and blockwise recipes.

A matrix X is held as q = sat(X / s) in an fp8 format and a decode scale s, X ≈ q · s, with

    s = 2^⌈log₂(amax / fmax)⌉   (e4m3: fmax = 448, e5m2: fmax = 57344; amax = 0 gives s = 1)
    sat(v) = clamp(v, −fmax, fmax), then rounded to the nearest fp8 value

and amax taken, at the moment of the cast, over the values one scale covers (its *tile*):

    tensorwise  one s per matrix                          torchao float8 "tensorwise"
    rowwise     one s per row of the left operand and per column of the right one (over the
                contraction dimension)                                 torchao "rowwise"
    blockwise   one s per 1×128 tile along the contraction (activations, gradients) and per
                128×128 block (weights)                                DeepSeek-V3 §3.3

Every scale is a power of 2 (torchao's ``round_scales_to_power_of_2``, on by default in its
rowwise recipe; MXFP8's E8M0 scales are nothing else): x / s then only moves the exponent, the
one rounding is fp8's, at the price of at most one bit of range (the largest value lands in
(fmax/2, fmax]). It also makes a cast robust to an amax that differs in its last bit — a sum
taken in another order under another layout: with s = amax / fmax the tp2 tensorwise model's
first-step gradients were 1e-2 from one rank's (single elements re-rounded across an e5m2
step), with power-of-2 scales 1e-7 (``tests/test_fp8.py``).

A product A·B (A: M×K, B: K×N) runs as fp8 × fp8 → fp32, one ``torch._scaled_mm`` per tile of
the contraction, its partial sum scaled and accumulated in fp32 (DeepSeek-V3's promotion to
CUDA cores every 128 elements of K):

    A·B ≈ Σ_t (q_A[:, t] q_B[t, :]) · s_A[:, t] s_B[t, :]     (t: the K tiles; one for
                                                                tensorwise and rowwise)

The three matmuls of y = x Wᵀ and the format of each operand (M tokens, K in, N out features):

    forward  y  = x · Wᵀ     K    x, W e4m3
    dgrad    dx = dy · W     N    dy: tensorwise e5m2 (torchao's default, Transformer Engine's
                                  HYBRID format: gradients need range), rowwise and blockwise
                                  e4m3 (torchao rowwise; DeepSeek-V3: fine tiles let e4m3
                                  carry gradients); W as in forward
    wgrad    dW = dyᵀ · x    M    dy as in dgrad; x as in forward (blockwise: 128×1 tiles
                                  along the tokens)

Saved for backward (the linears that read one tensor — q/k/v, gate/up — share one cast of
it, computed once): tensorwise keeps x as fp8 with its one scale (one byte per element: the
same q serves the wgrad); blockwise keeps x as fp8 1×128 tiles with one fp32 scale per tile
(DeepSeek-V3 caches the linear inputs in fp8) and re-tiles it along the tokens for the wgrad
(dequantised and cast again: a second rounding); rowwise keeps x in its own dtype (its
per-row scales do not serve the wgrad's per-column ones; torchao keeps the high-precision
input too). W is never saved: the backward casts the parameter again (torchao's
``force_recompute_fp8_weight_in_bwd``), with the same tiles and amax, so the same q.

A weight that arrives already cast — ZeRO-3's fp8 all-gather (``fived.parallel.data.fp8``)
gathers the e4m3 weight of each recipe, its tiles' amax reduced over every rank holding a
piece, so q and s are exactly what ``cast`` would give — is ``provide``d for the parameter while
it is gathered, per operand: tensorwise and blockwise one cast serves both (w_fwd = Wᵀ's 128×128
blocks are W's, transposed), rowwise the forward's per-row cast (w_fwd) and the dgrad's
per-column cast (w_dgrad) are two; the products use the provided q instead of casting W (whose
storage is then never materialised in the compute dtype).

A cast holds no fp32 copy: with power-of-2 scales x / s is exact in x's dtype (bf16 has fp32's
exponents), and the tile scales are broadcast over their tiles, never expanded to a matrix (the
blockwise wgrad's re-tiling dequantises in the compute dtype: an e4m3 value times 2^k is exact
in bf16); the one rounding is the fp8 cast's.

A dimension that is not a multiple of 128 ends in a short tile (zero padding, which changes
neither an amax nor a product). When a layout cuts a dimension a scale spans (tensor
parallelism cuts features; ``cuts``), the amax is max-reduced over the group that holds the
rest (``Cut.reduce``), so every rank casts with the scale one rank would use. Outputs are in
the input's dtype; the products accumulate in fp32.

Which layers: the linear layers of attention, the MLP and the experts. The embedding (a
lookup, no matmul), the head and the loss (the logits' softmax is where precision is
spent; torchao, torchtitan and DeepSeek-V3 all keep it), the router (its scores pick experts:
a rounding flips a top-k choice; DeepSeek-V3 keeps the gating in higher precision) and the
norms stay in the compute dtype.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
TILE = 128
RECIPES = ("tensorwise", "rowwise", "blockwise")
ALL = None  # a tile side spanning the whole dimension


@dataclass
class Fp8:
    """A matrix cast to fp8: ``data`` (R, C), ``scale`` one fp32 per tile, ``tile`` its (rows,
    cols) (``ALL``: the whole dimension); X ≈ data · scale, broadcast over each tile."""

    data: torch.Tensor
    scale: torch.Tensor
    tile: tuple[int | None, int | None]

    def t(self) -> Fp8:
        return Fp8(self.data.t(), self.scale.t(), (self.tile[1], self.tile[0]))

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4


def _side(n: int, tile: int | None) -> int:
    return n if tile is ALL else tile


def tile_amax(x: torch.Tensor, tile: tuple[int | None, int | None]) -> torch.Tensor:
    """The amax of each tile of the 2-D ``x``: shape (⌈R/tr⌉, ⌈C/tc⌉), fp32."""
    r, c = x.shape
    tr, tc = _side(r, tile[0]), _side(c, tile[1])
    nr, nc = -(-r // max(tr, 1)), -(-c // max(tc, 1))
    if r == 0 or c == 0:
        return torch.zeros(max(nr, 1), max(nc, 1), dtype=torch.float32, device=x.device)
    if tile == (ALL, ALL):
        return x.detach().abs().amax().float().view(1, 1)
    a = x.detach().abs()  # in x's dtype: a maximum is exact in any of them
    if nr * tr != r or nc * tc != c:
        a = F.pad(a, (0, nc * tc - c, 0, nr * tr - r))
    return a.view(nr, tr, nc, tc).amax(dim=(1, 3)).float()


def expand(scale: torch.Tensor, tile: tuple[int | None, int | None],
           shape: tuple[int, int]) -> torch.Tensor:
    """The per-tile ``scale`` broadcast to every element of a (R, C) matrix."""
    r, c = shape
    tr, tc = _side(r, tile[0]), _side(c, tile[1])
    return scale.repeat_interleave(tr, 0)[:r].repeat_interleave(tc, 1)[:, :c]


def _per_tile(x: torch.Tensor, scale: torch.Tensor, tile: tuple[int | None, int | None],
              op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``op(x, scale)`` with each tile's scale broadcast over its tile (no (R, C) scale
    matrix; a short last tile padded, then cut off), in the dtype ``op`` gives."""
    if all(t is ALL or t == 1 for t in tile):
        return op(x, scale)
    r, c = x.shape
    tr, tc = _side(r, tile[0]), _side(c, tile[1])
    nr, nc = scale.shape
    if nr * tr != r or nc * tc != c:
        x = F.pad(x, (0, nc * tc - c, 0, nr * tr - r))
    out = op(x.view(nr, tr, nc, tc), scale.view(nr, 1, nc, 1))
    return out.view(nr * tr, nc * tc)[:r, :c]


def scale_of(amax: torch.Tensor, fmt: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """The decode scale amax / fmax (1 where amax = 0), rounded up to a power of 2 if asked."""
    s = torch.where(amax > 0, amax / FMAX[fmt], torch.ones_like(amax))
    return torch.exp2(torch.ceil(torch.log2(s))) if pow2 else s


def quantize(x: torch.Tensor, fmt: torch.dtype, tile: tuple[int | None, int | None],
             pow2: bool = False, reduce: Callable[[torch.Tensor], None] | None = None) -> Fp8:
    """Cast the 2-D ``x`` to ``fmt`` with one scale per ``tile``; ``reduce`` (in place) makes
    the tiles' amax that of the whole layout (a max all-reduce over a cut)."""
    amax = tile_amax(x, tile)
    if reduce is not None:
        reduce(amax)
    s = scale_of(amax, fmt, pow2)
    if pow2:  # x / 2^k is exact in x's dtype (bf16 has fp32's exponents): no fp32 copy of x
        v = _per_tile(x.detach(), s.to(x.dtype), tile, torch.div)
    else:
        v = _per_tile(x.detach().float(), s, tile, torch.div)
    return Fp8(v.clamp_(-FMAX[fmt], FMAX[fmt]).to(fmt), s, tile)


def dequantize(q: Fp8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q · s in ``dtype`` (fp32; bf16 is exact too where s is a power of 2: an e4m3 value has
    4 significant bits)."""
    return _per_tile(q.data.to(dtype), q.scale.to(dtype), q.tile, torch.mul)


def _k_tiles(q: Fp8, k_dim: int) -> int:
    k = q.data.shape[k_dim]
    return 1 if q.tile[k_dim] is ALL else -(-k // q.tile[k_dim])


def scaled_matmul(a: Fp8, b: Fp8) -> torch.Tensor:
    """a · b in fp32 (a: M×K, b: K×N), fp8 × fp8 by ``torch._scaled_mm`` per K tile, each tile's
    product scaled per row of a and column of b and summed in fp32."""
    (m, k), n = a.data.shape, b.data.shape[1]
    tiles = _k_tiles(a, 1)
    if tiles != _k_tiles(b, 0) or (tiles > 1 and a.tile[1] != b.tile[0]):
        raise ValueError(f"K tiles differ: {a.tile} · {b.tile}")
    step = k if tiles == 1 else a.tile[1]
    sa = a.scale.repeat_interleave(_side(m, a.tile[0]), 0)[:m]  # (M, tiles) or (1, 1)
    sb = b.scale.repeat_interleave(_side(n, b.tile[1]), 1)[:, :n]  # (tiles, N) or (1, 1)
    out = None
    for t in range(tiles):
        qa = a.data[:, t * step:(t + 1) * step].contiguous()
        qb = b.data[t * step:(t + 1) * step].t().contiguous().t()  # column-major, as cuBLAS wants
        if sa.numel() == 1 and sb.numel() == 1:
            s1, s2 = sa.reshape(()), sb.reshape(())
        else:
            s1 = sa[:, t:t + 1].expand(m, 1).contiguous()
            s2 = sb[t:t + 1, :].expand(1, n).contiguous()
        p = torch._scaled_mm(qa, qb, scale_a=s1, scale_b=s2, out_dtype=torch.float32)
        out = p if out is None else out.add_(p)
    if out is None:
        out = torch.zeros(m, n, dtype=torch.float32, device=a.data.device)
    return out


# ------------------------------------------------------------------------------ recipes
# role -> (format, tile) of the operand as it enters its product; the roles:
#   x_fwd (M,K)  w_fwd = Wᵀ (K,N)  g_dgrad = dy (M,N)  w_dgrad = W (N,K)
#   g_wgrad = dyᵀ (N,M)  x_wgrad = x (M,K)
_ROLES = {
    "tensorwise": {"x_fwd": (E4M3, (ALL, ALL)), "w_fwd": (E4M3, (ALL, ALL)),
                   "g_dgrad": (E5M2, (ALL, ALL)), "w_dgrad": (E4M3, (ALL, ALL)),
                   "g_wgrad": (E5M2, (ALL, ALL)), "x_wgrad": (E4M3, (ALL, ALL))},
    "rowwise": {"x_fwd": (E4M3, (1, ALL)), "w_fwd": (E4M3, (ALL, 1)),
                "g_dgrad": (E4M3, (1, ALL)), "w_dgrad": (E4M3, (ALL, 1)),
                "g_wgrad": (E4M3, (1, ALL)), "x_wgrad": (E4M3, (ALL, 1))},
    "blockwise": {"x_fwd": (E4M3, (1, TILE)), "w_fwd": (E4M3, (TILE, TILE)),
                  "g_dgrad": (E4M3, (1, TILE)), "w_dgrad": (E4M3, (TILE, TILE)),
                  "g_wgrad": (E4M3, (1, TILE)), "x_wgrad": (E4M3, (TILE, 1))},
}
# the dimensions (of M, K, N) each role's rows and columns run along
_DIMS = {"x_fwd": "MK", "w_fwd": "KN", "g_dgrad": "MN", "w_dgrad": "NK", "g_wgrad": "NM",
         "x_wgrad": "MK"}


def role(recipe: str, name: str) -> tuple[torch.dtype, tuple[int | None, int | None]]:
    """(format, tile) of operand ``name`` under ``recipe``."""
    return _ROLES[recipe][name]


@dataclass(frozen=True)
class Cut:
    """A dimension of the linear ("M" tokens, "K" in, "N" out features) that a layout cuts
    across a group: ``reduce(amax)`` max-reduces an amax in place over that group."""

    dim: str
    reduce: Callable[[torch.Tensor], None]


def _reducer(name: str, cuts: tuple[Cut, ...], recipe: str):
    """The amax reduction operand ``name`` needs: over each cut dimension a tile spans whole
    (blockwise tiles of 128 stop at a cut: ``fived.config``'s validation asks the cut to fall
    on a tile edge)."""
    _, tile = role(recipe, name)
    dims = _DIMS[name]
    fns = [c.reduce for c in cuts for i in (0, 1) if dims[i] == c.dim and tile[i] is ALL]
    if not fns:
        return None

    def reduce(amax: torch.Tensor) -> None:
        for f in fns:
            f(amax)
    return reduce


def cast(x: torch.Tensor, recipe: str, name: str, cuts: tuple[Cut, ...] = ()) -> Fp8:
    """``x`` cast as operand ``name`` of ``recipe`` (amax reduced over the cuts it spans)."""
    fmt, tile = role(recipe, name)
    return quantize(x, fmt, tile, pow2=True, reduce=_reducer(name, cuts, recipe))


_LAST: list[Any] = [None]  # the last input cast: (x, its version, recipe, cuts, data, scale, tile)


def _cast_input(x: torch.Tensor, x2: torch.Tensor, recipe: str, cuts: tuple[Cut, ...]) -> Fp8:
    """``cast(x2, recipe, "x_fwd", cuts)``, shared by the linears that read the same tensor
    (q/k/v; gate/up): the same cast, so one fp8 copy is computed and saved, not one per
    consumer. Held by weak references only: nothing is kept alive by the cache."""
    last = _LAST[0]
    if last is not None and last[0]() is x and last[1] == x._version and last[2:4] == (
            recipe, cuts):
        data, scale = last[4](), last[5]()
        if data is not None and scale is not None:
            return Fp8(data, scale, last[6])
    q = cast(x2, recipe, "x_fwd", cuts)
    _LAST[0] = (weakref.ref(x), x._version, recipe, cuts, weakref.ref(q.data),
                weakref.ref(q.scale), q.tile)
    return q


_PROVIDED: dict[int, dict[str, Fp8]] = {}  # id(parameter) -> operand -> its gathered cast


def provide(w: torch.Tensor, casts: dict[str, Fp8] | None) -> None:
    """``casts`` (operand name, ``w_fwd`` (K, N) or ``w_dgrad`` (N, K) -> that operand's cast of
    the whole W, as ``cast`` gives it) serve W's products until ``provide(w, None)``: the gather
    that produced them frees them then."""
    if casts is None:
        _PROVIDED.pop(id(w), None)
    else:
        _PROVIDED[id(w)] = casts


def _weight(w: torch.Tensor, recipe: str, name: str, cuts: tuple[Cut, ...], key: int) -> Fp8:
    """W cast as operand ``name`` (``w_fwd``: Wᵀ; ``w_dgrad``: W), or the cast provided for
    the parameter ``key`` (its id at the forward: a saved tensor may unpack as another object)."""
    casts = _PROVIDED.get(key)
    if casts is not None:
        q = casts.get(name)
        if q is None:  # W's storage is not gathered: casting it would read freed bytes
            raise RuntimeError(f"the gathered fp8 weight has no {name} cast ({recipe}): "
                               f"gathered for {sorted(casts)}")
        return q
    return cast(w.t() if name == "w_fwd" else w, recipe, name, cuts)


class _Fp8Linear(torch.autograd.Function):
    """y = x Wᵀ with the three products in fp8 as ``recipe`` says (the module docstring)."""

    @staticmethod
    def forward(ctx, x, w, recipe, cuts):
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        qx = _cast_input(x, x2, recipe, cuts)
        y = scaled_matmul(qx, _weight(w, recipe, "w_fwd", cuts, id(w)))
        ctx.recipe, ctx.cuts, ctx.shape, ctx.xdtype = recipe, cuts, x.shape, x.dtype
        ctx.wkey, ctx.wdtype = id(w), w.dtype
        # a provided W is provided again for the backward (ZeRO-3 gathers it again): not saved,
        # only referred to (a saved parameter is unpacked as a detached alias of its storage)
        ctx.wref = weakref.ref(w) if ctx.wkey in _PROVIDED else None
        keep_w = () if ctx.wref else (w,)
        if recipe == "rowwise":  # x as given: its (N, K) reshape may be a copy, x is not
            ctx.save_for_backward(x, *keep_w)
        else:  # the fp8 data and its scales; W is the parameter (recast in backward)
            ctx.save_for_backward(qx.data, qx.scale, *keep_w)
            ctx.qtile = qx.tile
        return y.to(x.dtype).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        recipe, cuts = ctx.recipe, ctx.cuts
        if recipe == "rowwise":
            x, *rest = ctx.saved_tensors
            w = rest[0] if rest else ctx.wref()
            qxw = cast(x.reshape(-1, x.shape[-1]), recipe, "x_wgrad", cuts)
        else:
            data, scale, *rest = ctx.saved_tensors
            w = rest[0] if rest else ctx.wref()
            qx = Fp8(data, scale, ctx.qtile)
            qxw = qx if recipe == "tensorwise" else cast(dequantize(qx, ctx.xdtype), recipe,
                                                          "x_wgrad", cuts)
        g = dy.reshape(-1, dy.shape[-1])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = scaled_matmul(cast(g, recipe, "g_dgrad", cuts),
                               _weight(w, recipe, "w_dgrad", cuts, ctx.wkey))
            dx = dx.to(ctx.xdtype).view(ctx.shape)
        if ctx.needs_input_grad[1]:
            qg = cast(g.t(), recipe, "g_wgrad", cuts)
            dw = scaled_matmul(qg, qxw).to(ctx.wdtype)
        return dx, dw, None, None


def fp8_linear(x: torch.Tensor, w: torch.Tensor, recipe: str,
               cuts: tuple[Cut, ...] = ()) -> torch.Tensor:
    """x Wᵀ (x: (..., K), W: (N, K)) with its forward and backward products in fp8."""
    return _Fp8Linear.apply(x, w, recipe, cuts)


def saved_bytes_per_element(recipe: str, dtype_bytes: int, k: int) -> float:
    """Bytes an fp8 linear saves per element of its input (x: (M, K)): fp8 data and the fp32
    scales (tensorwise: one per matrix, not counted per element; blockwise: one per 1×128
    tile), or x in its own dtype (rowwise)."""
    if recipe == "rowwise":
        return float(dtype_bytes)
    if recipe == "blockwise":
        return 1.0 + 4.0 * math.ceil(k / TILE) / k
    return 1.0


class Fp8Linear(nn.Module):
    """``nn.Linear`` with its products in fp8 (``fp8_linear``, amax reduced over ``cuts``): the
    same ``weight`` and ``bias`` parameters (names, shapes, dtypes: checkpoints do not change);
    the bias is added in the compute dtype."""

    def __init__(self, linear: nn.Linear, recipe: str, cuts: tuple[Cut, ...] = ()):
        super().__init__()
        if recipe not in RECIPES:
            raise ValueError(f"fp8 recipe {recipe!r}: one of {', '.join(RECIPES)}")
        self.recipe, self.cuts = recipe, cuts
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_linear(x, self.weight, self.recipe, self.cuts)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, recipe={self.recipe}"


def fp8_matmul_available(device: torch.device | str) -> bool:
    """Whether ``torch._scaled_mm`` runs on ``device``: the CPU build does; CUDA from compute
    capability 8.9 (Ada, Hopper)."""
    dev = torch.device(device)
    if not hasattr(torch, "_scaled_mm"):
        return False
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(dev) >= (8, 9)
    return dev.type == "cpu"
