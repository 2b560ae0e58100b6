"""Where cp2 ring attention's fp8 gradient gap to one rank comes from, isolated.

    python benchmarks/fp8_ring_gap.py            # tiny, 2 layers, seq_len 512, fp32 around fp8

On the first step (fp32 around the fp8 products, the same seed and batch), per recipe:

1. One rank twice, the second time with its attention outputs (o_proj's inputs) multiplied by
   (1 ± 2⁻²³) at random per element — one fp32 ulp of noise, no cp at all —: the gradients'
   largest relative gap between the two.
2. cp2 ring and cp2 Ulysses against one rank: the gradients' gap (as the parity tests measure
   it); the attention output's largest relative fp32 difference; then, for every fp8 linear,
   its input (forward) and its output gradient (backward) captured on each rank, put back in
   sequence order (every cp rank holds its zigzag chunks), cast as the recipe casts them
   (``fived.model.fp8.cast``: x for the forward and the wgrad, dy for the dgrad and the
   wgrad) and compared with one rank's casts: every fp8 operand with elements of another
   value (a code rounded to the other fp8 neighbour, or another scale), in the order forward
   and then backward reach them.

docs/numerics.md §5 reads the result: ring attention's fp32-level differences (its
log-sum-exp merge of the K/V blocks) flip a few e4m3/e5m2 roundings of the gradients in the
first block backward reaches; each flip is a whole fp8 step, which the dgrad spreads into
every earlier block.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import torch

from fived.config import ParallelConfig, TrainConfig, preset
from fived.testing import assemble_grads, grad_rel_diff, run_ranks, train_recording

TINY = replace(preset("tiny"), layers=2, seq_len=512)
TRAIN = TrainConfig(steps=1, global_batch=2, lr=3e-3, warmup=1, seed=7)


LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class Capture:
    """A run hook: on step 0, every fp8 linear's input (forward) and output gradient (backward,
    in the order backward reaches them); ``noise`` multiplies o_proj's input by (1 ± 2⁻²³) per
    element (a fixed generator)."""

    def __init__(self, noise: bool = False):
        self.noise, self.out = noise, {}

    def on_step_start(self, trainer: Any, step: int) -> None:
        if step:
            return
        gen = torch.Generator().manual_seed(11)
        for name, mod in trainer.stage.named_modules():
            if name.endswith(LINEARS):
                mod.register_forward_pre_hook(self._fwd(name, gen))
                mod.register_full_backward_hook(self._bwd(name))

    def _fwd(self, name: str, gen: torch.Generator):
        def hook(mod: Any, args: Any) -> Any:
            x = args[0]
            if not torch.is_grad_enabled() or name + ".x" in self.out:
                return None
            if self.noise and name.endswith("o_proj"):
                u = torch.randint(0, 2, x.shape, generator=gen).to(x.dtype) * 2 - 1
                x = x * (1 + u * 2.0 ** -23)
            self.out[name + ".x"] = x.detach().clone()
            return (x,) + tuple(args[1:])
        return hook

    def _bwd(self, name: str):
        def hook(mod: Any, gin: Any, gout: Any) -> None:
            if name + ".dy" not in self.out:
                self.out[name + ".dy"] = gout[0].detach().clone()
        return hook


def _run(rank: int, world: int, par: ParallelConfig, noise: bool = False) -> dict[str, Any]:
    from fived.parallel.context import shard_positions

    pos = shard_positions(TINY.seq_len, par.cp, rank) if par.cp > 1 else None
    cap = Capture(noise)
    out = train_recording(rank, world, TINY, par, TRAIN, hooks=(cap,))
    # numpy: pickled by value across processes (a tensor would travel as a shared fd)
    return {"grads": out["grads"], "pos": None if pos is None else pos.numpy(),
            "captured": {k: v.numpy() for k, v in cap.out.items()}}


def _assemble(ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Each captured tensor whole, in sequence order (every cp rank holds its zigzag chunks;
    Ulysses' all-to-all is inside attention)."""
    out = {}
    for key in ranks[0]["captured"]:
        parts = [torch.as_tensor(r["captured"][key]) for r in ranks]
        b, _, h = parts[0].shape
        full = torch.empty(b, TINY.seq_len, h, dtype=parts[0].dtype)
        for r, t in zip(ranks, parts):
            full[:, torch.as_tensor(r["pos"])] = t
        out[key] = full
    return out


def casts(t: torch.Tensor, recipe: str, grad: bool) -> dict[str, Any]:
    """The fp8 operands the linear casts from ``t`` (an input x, or an output gradient dy),
    dequantised (a differing value: a flipped code or a differing scale)."""
    from fived.model import fp8 as fp8_mod

    t2 = t.reshape(-1, t.shape[-1])
    if grad:
        return {"dgrad dy": fp8_mod.dequantize(fp8_mod.cast(t2, recipe, "g_dgrad")),
                "wgrad dy": fp8_mod.dequantize(fp8_mod.cast(t2.t(), recipe, "g_wgrad"))}
    qx = fp8_mod.cast(t2, recipe, "x_fwd")
    if recipe == "tensorwise":
        xw = qx
    elif recipe == "rowwise":
        xw = fp8_mod.cast(t2, recipe, "x_wgrad")
    else:
        xw = fp8_mod.cast(fp8_mod.dequantize(qx), recipe, "x_wgrad")
    return {"fwd x": fp8_mod.dequantize(qx), "wgrad x": fp8_mod.dequantize(xw)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def main(argv: list[str]) -> int:
    recipes = ("tensorwise", "rowwise", "blockwise")
    print(f"tiny, {TINY.layers} layers, seq_len {TINY.seq_len}, global batch "
          f"{TRAIN.global_batch}, fp32 around fp8; first step")
    refs = {}
    for recipe in recipes:
        par = ParallelConfig(precision="fp32", fp8=recipe)
        one = _run(0, 1, par)
        noisy = _run(0, 1, par, noise=True)
        refs[recipe] = one
        g1 = assemble_grads([one["grads"]])
        gn = assemble_grads([noisy["grads"]])
        print(f"one rank, o_proj input +-1 ulp, {recipe:<10}: gradients "
              f"{grad_rel_diff(gn, g1):.1e} from the clean run")
    for mode in ("ring", "ulysses"):
        for recipe in recipes:
            par = ParallelConfig(cp=2, cp_mode=mode, precision="fp32", fp8=recipe)
            ranks = run_ranks(_run, 2, par)
            got = _assemble(ranks)
            ref_cap = {k: torch.as_tensor(v) for k, v in refs[recipe]["captured"].items()}
            gap = grad_rel_diff(assemble_grads([r["grads"] for r in ranks]),
                                assemble_grads([refs[recipe]["grads"]]))
            att = max(rel(got[k], ref_cap[k]) for k in got if k.endswith("o_proj.x"))
            print(f"cp2 {mode} {recipe}: gradients {gap:.1e} from one rank; attention "
                  f"output (o_proj's input) {att:.1e}; fp8 operands with differing values:")
            total = 0
            for key in ranks[0]["captured"]:  # forward inputs, then backward's dy in order
                a_ops = casts(got[key], recipe, key.endswith(".dy"))
                b_ops = casts(ref_cap[key], recipe, key.endswith(".dy"))
                for op, v in a_ops.items():
                    n = int((v != b_ops[op]).sum())
                    total += n
                    if n:
                        print(f"    {key.rsplit('.', 1)[0]:<28} {op:<9} {n:>3} of {v.numel()}"
                              f" (fp32 input {rel(got[key], ref_cap[key]):.1e} apart)")
            print(f"    {total} in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
