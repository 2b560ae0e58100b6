"""Save and load one rank's training state with ``torch.distributed.checkpoint`` (DCP), in
global names and global shapes, so that any layout reads what any other wrote.

What a checkpoint holds (``G`` = a parameter's global name, e.g. ``layers.3.mlp.up_proj.weight``):

    model.G          the parameter in the compute dtype           (every layout writes it)
    master.G         its fp32 master (bf16/fp16 runs with --master-weights fp32)
    comp.G           Kahan's bf16 compensation c (--master-weights kahan)
    optim.S.G        each optimizer state S, in G's global shape (element-wise: AdamW m, v;
                     RowNorm m; Muon m, and v for its AdamW parameters) or as G's global row
                     and column statistics (Adafactor R, C): ``fived.checkpoint.optimizer``
    buffer.B         a model buffer by its global name: each MoE layer's loss-free balancing
                     bias ``layers.L.block_sparse_moe.route_bias`` (balance = bias; E fp32,
                     the same on every rank holding layer L)
    rng.torch.rankR  rank R's torch RNG state (restored when rank R exists on resume), and
    rng.sr.rankR     its stochastic-rounding generator (--master-weights sr)
    manifest.json    step (= steps done = the learning-rate position and, since a batch is a
                     pure function of (seed, step), the data position), the data state
                     (``Trainer.data_state``), the optimizer's type and step count t, the
                     master-weights mode, the fp16 loss-scaler state, the configs, the
                     tensors, the files' checksums

Each rank contributes exactly the elements it owns: for every bucket of the data-parallel
engine, the part of each parameter's tensor-/expert-parallel piece (``Placement``) that lies in
the rank's ZeRO shard ``[lo, hi)`` — described as boxes of the global tensor
(``fived.checkpoint.pieces``), views of the engine's own flat tensors. Nothing is gathered to
save, nothing is gathered to load: DCP intersects what each rank asks for with what is on disk.

Loading writes masters (or fp32 parameters) and optimizer states straight into the engine's
owned shards, then ``engine.publish_params()`` rebuilds the compute-dtype parameters exactly as
after an optimizer step (the all-gather of ZeRO-1/2). The fp32 value of a parameter is
``master.G`` when the checkpoint has it, else ``model.G`` (+ ``comp.G`` from a Kahan run). A run
with an fp32 master (or fp32 parameters) takes that value; a run without a master
(--master-weights none|sr|kahan) rounds it to bf16 — exact when it is a saved bf16 ``model.G``
— and a Kahan run takes ``comp.G`` as saved, or what the rounding dropped (0 from a bf16 run).
A checkpoint without optimizer states (``fived import``), or of another optimizer, starts the
optimizer fresh; one of the same optimizer that lacks a state this run needs is refused.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from ..config import AUTO, ConfigError
from . import storage
from .optimizer import optim_entries, owned, scalars
from .pieces import Pieces


class SavePlanner(DefaultSavePlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: Any) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else (
            super().lookup_object(index))


class LoadPlanner(DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: Any, metadata: Any = None,
                       is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner's _init_state_dict would replace objects it does not know (Pieces)
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise ValueError(f"{read_item.dest_index.fqn}: a pickled object in the checkpoint; fived "
                         "never loads those (it would run code)")

    def lookup_tensor(self, index: Any) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else (
            super().lookup_tensor(index))


# ------------------------------------------------------------------ the rank's pieces
def _add(out: dict[str, Pieces], key: str, gshape, local: torch.Tensor, shape, shift, a: int,
         c: int) -> None:
    """Elements [a, c) of a piece of ``shape`` at ``shift``; ``local[0]`` is element a."""
    pc = out.setdefault(key, Pieces(gshape, local.dtype))
    pc.add_range(local, shape, shift, a, c)


def rank_state(engine: Any, placements: dict[str, Any]) -> dict[str, Pieces]:
    """Every tensor this rank contributes to a checkpoint (views, nothing copied)."""
    separate = engine.policy.separate_master
    out: dict[str, Pieces] = {}
    for i, _, g, gshape, shape, shift, (a, c), (s0, s1) in owned(engine, placements):
        b = engine.buckets[i]
        _add(out, f"model.{g}", gshape, b.param_shard[s0:s1], shape, shift, a, c)
        if separate:
            _add(out, f"master.{g}", gshape, b.master[s0:s1], shape, shift, a, c)
        if b.comp is not None:
            _add(out, f"comp.{g}", gshape, b.comp[s0:s1], shape, shift, a, c)
    for key, gshape, local, shape, shift, a, c in optim_entries(engine, placements):
        _add(out, key, gshape, local, shape, shift, a, c)
    return out


def rng_state(engine: Any = None) -> dict[str, torch.Tensor]:
    """The RNG states a resume restores per rank: torch's (CPU, CUDA) and, with
    ``--master-weights sr``, the stochastic-rounding generator's."""
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    if engine is not None and engine.policy.in_place and engine.policy.master == "sr":
        out["sr"] = engine.sr_gen.get_state()
    return out


# ------------------------------------------------------------------ save
class SaveError(RuntimeError):
    """A save that failed on some rank (a full disk: OSError ENOSPC, a quota, an I/O error):
    its ``.tmp-step-N`` is removed and the previous checkpoint is untouched (never renamed
    over, never pruned), so ``--resume auto`` loads it; every rank raises it together."""


class Saver:
    """Periodic saves of one rank (``--save-dir --save-every --keep --async-save``)."""

    def __init__(self, trainer: Any, root: str, every: int, keep: int = 0,
                 use_async: bool = False, verbose: bool = False):
        self.trainer, self.root, self.every, self.keep = trainer, Path(root), every, keep
        self.verbose = verbose
        self.use_async = use_async
        self.pending: Any = None
        self.group = None
        if use_async and dist.is_initialized() and dist.get_world_size() > 1:
            # the background save talks on its own group: never interleaved with training's
            self.group = dist.new_group(backend="gloo")
        if trainer.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            storage.clean_tmp(self.root)

    def due(self, done: int, total: int) -> bool:
        return done == total or (self.every > 0 and done % self.every == 0)

    def save(self, done: int, mems: list[dict[str, int]] | None = None) -> None:
        """Write the state after ``done`` steps to ``root/step-N`` (atomic)."""
        self.wait()
        t = self.trainer
        state: dict[str, Any] = dict(rank_state(t.engine, t.parallel.placements))
        state.update({k: v.detach().clone() for k, v in t.balancer.state_dict().items()})
        for k, v in rng_state(t.engine).items():
            state[f"rng.{k}.rank{t.rank}"] = v.clone()
        man = manifest(t, done, mems)
        tmp = storage.tmp_dir(self.root, done)
        writer = dcp.FileSystemWriter(str(tmp))
        if self.use_async:
            staged = {k: (v.staged() if isinstance(v, Pieces) else v) for k, v in state.items()}
            fut = dcp.async_save(staged, storage_writer=writer, planner=SavePlanner(),
                                 process_group=self.group, async_stager=_NoStage())
            self.pending = (fut, done, man, tmp)
        else:
            error = None
            try:
                dcp.save(state, storage_writer=writer, planner=SavePlanner())
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - see _agree
                error = e
            self._agree(done, tmp, error)  # rank 0 finalizes only once every rank wrote
            self.pending = (None, done, man, tmp)
            self.wait()

    def _agree(self, done: int, tmp: Path, error: BaseException | None) -> None:
        """Every rank: did the save of ``done`` fail on any rank? (one all-reduce; it is the
        barrier that lets a finished save be seen). On failure rank 0 removes ``tmp`` and
        every rank raises ``SaveError``."""
        bad = 1.0 if error is not None else 0.0
        if dist.is_initialized() and dist.get_world_size() > 1:
            dev = self.trainer.device if self.group is None else torch.device("cpu")
            flag = torch.tensor([bad], device=dev)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            bad = float(flag.item())
        if not bad:
            return
        if self.trainer.rank == 0:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        prev = storage.complete(self.root)
        if isinstance(error, CheckpointException):  # DCP's: every failing rank's exception
            causes = {r: (e[0] if isinstance(e, tuple) else e)  # (exception, frames)
                      for r, e in error.failures.items()}
            what = "; ".join(f"rank {r}: {type(e).__name__}: {e}"
                             for r, e in sorted(causes.items()))
        elif error is not None:
            what = f"{type(error).__name__}: {error}"
        else:
            what = "it failed on another rank"
        raise SaveError(
            f"checkpoint step {done} could not be written to {self.root} ({what}); its "
            f"partial files were removed and the previous checkpoint "
            + (f"{prev[-1][1].name} is intact (--resume auto loads it)" if prev else
               "— there is none — is unchanged") + ". Free space (or fix the disk) and rerun "
            "the same command line.")

    def wait(self) -> None:
        """Block until the pending save is on disk; rank 0 then writes the manifest and renames
        the directory; every rank leaves once it is visible (a barrier)."""
        if self.pending is None:
            return
        fut, done, man, tmp = self.pending
        self.pending = None
        error: BaseException | None = None
        if fut is not None:
            try:
                fut.result()
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - see _agree
                error = e
            self._agree(done, tmp, error)  # rank 0 finalizes only once every rank wrote
        final = None
        if self.trainer.rank == 0:
            try:
                man["tensors"] = tensor_table(tmp)
                final = storage.finalize(self.root, done, man, self.keep)
            except OSError as e:  # the manifest or an fsync on a full disk
                error = e
        self._agree(done, tmp, error)  # the barrier: every rank leaves once it is visible
        if final is not None and self.verbose:
            nbytes = sum(f.stat().st_size for f in final.iterdir())
            print(f"checkpoint: {final} ({nbytes / 2**20:.1f} MiB"
                  f"{', written in the background' if fut is not None else ''})", flush=True)


class _NoStage:
    """``--async-save`` stages itself (``Pieces.staged``): DCP's stager is a no-op."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def manifest(t: Any, done: int, mems: list[dict[str, int]] | None) -> dict[str, Any]:
    eng = t.engine
    sc = getattr(eng, "scaler", None)
    par = asdict(t.par)
    if par["precision"] == AUTO:  # what ran, not "auto" (the Python API; commands resolve it)
        par["precision"] = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
            eng.policy.compute, "fp32")
    return {
        "family": "fived", "step": done, "world": t.world,
        "config": {"model": asdict(t.cfg), "parallel": par, "train": asdict(t.tcfg)},
        "optimizer": {"type": type(eng.opt).__name__, "scalars": scalars(eng.opt)},
        "master_weights": eng.policy.master if eng.policy.compute != torch.float32 else "fp32",
        "loss_scaler": None if sc is None else {"scale": sc.scale, "good_steps": sc.good_steps,
                                                "skipped": sc.skipped},
        "data": t.data_state(),
        "memory_per_rank": mems or [],
        "rss_per_rank": getattr(t, "rss", []),  # measured peak resident bytes (build, so far)
    }


def tensor_table(ckpt: Path) -> dict[str, dict[str, Any]]:
    """Every tensor in a DCP directory: global shape, dtype, bytes (from its safe metadata)."""
    md = storage.safe_reader(ckpt).read_metadata()
    out = {}
    for fqn, m in sorted(md.state_dict_metadata.items()):
        if not hasattr(m, "size"):
            continue
        dt = m.properties.dtype
        n = 1
        for s in m.size:
            n *= s
        out[fqn] = {"shape": list(m.size), "dtype": str(dt).replace("torch.", ""),
                    "bytes": n * torch.empty((), dtype=dt).element_size()}
    return out


# ------------------------------------------------------------------ load
def check_compatible(man: dict[str, Any], expected: dict[str, tuple[int, ...]],
                     is_moe: bool, flag: str = "--resume", whole: bool = True,
                     model: Any = None) -> None:
    """Same model family and every expected parameter saved with the same global shape; else
    one ConfigError listing each mismatched tensor (name, saved shape, expected shape).
    ``whole``: ``expected`` is the whole model (not one rank's part): extra tensors count too.
    ``model`` (this run's ModelConfig): named with its shape before the mismatches (at most 5
    listed, then "and N more")."""
    saved_moe = bool(man["config"]["model"].get("experts", 0))
    if saved_moe != is_moe:
        kind = {True: "a Mixtral-style MoE", False: "a Llama-style dense"}
        this = f" {shape_words(model)}" if model is not None else ""
        raise ConfigError([f"{flag}: the checkpoint holds {kind[saved_moe]} model, "
                           f"{shape_words(man['config']['model'])}; this run builds "
                           f"{kind[is_moe]} model{this}; give the checkpoint's --model "
                           f"{man['config']['model'].get('name')} or no model flags"])
    tensors = man["tensors"]
    bad: list[str] = []
    for name, shape in sorted(expected.items()):
        got = tensors.get(f"model.{name}")
        if got is None:
            bad.append(f"{name}: not in the checkpoint, expected {tuple(shape)}")
        elif tuple(got["shape"]) != tuple(shape):
            bad.append(f"{name}: saved {tuple(got['shape'])}, expected {tuple(shape)}")
    extra = sorted(k[6:] for k in tensors if whole and k.startswith("model.")
                   and k[6:] not in expected)
    bad += [f"{name}: in the checkpoint, not in this model" for name in extra]
    if bad:
        saved = man["config"]["model"]
        head = (f"{flag}: the checkpoint holds {shape_words(saved)}; this run builds "
                f"{shape_words(model)}" if model is not None else
                f"{flag}: the checkpoint holds {shape_words(saved)}, another model than this run's")
        shown = bad[:5] + ([f"and {len(bad) - 5} more"] if len(bad) > 5 else [])
        raise ConfigError([f"{head} ({len(bad)} tensor(s) differ; give the checkpoint's "
                           f"--model {saved.get('name')} or no model flags)"] + shown)


def shape_words(m: Any) -> str:
    """"tiny (hidden 64, 2 layers, 4 heads, ffn 176, vocab 256)" of a ModelConfig or its dict."""
    get = m.get if isinstance(m, dict) else (lambda k, d=None: getattr(m, k, d))
    experts = get("experts", 0)
    return (f"{get('name')} (hidden {get('hidden')}, {get('layers')} layers, {get('heads')} heads, "
            f"ffn {get('ffn')}, vocab {get('vocab')}" + (f", {experts} experts" if experts else "")
            + ")")


def _zeros(b: Any) -> torch.Tensor:
    """An fp32 buffer of bucket ``b``'s owned elements, on its device."""
    return torch.zeros(b.hi - b.lo, device=b.param_shard.device)


def load(trainer: Any, ckpt: str | Path, weights_only: bool = False) -> int:
    """Load checkpoint ``ckpt`` (a ``step-N`` directory) into this rank; the steps done.
    ``weights_only`` (``fived eval``): the parameters only; no optimizer state, random state,
    loss scale or data position (the evaluation may read other data with the same
    tokenizer)."""
    t, eng = trainer, trainer.engine
    ckpt = Path(ckpt)
    man = storage.read_manifest(ckpt)
    expected = {pl.name: tuple(pl.shape) for pl in t.parallel.placements.values()}
    check_compatible(man, expected, t.cfg.is_moe, whole=False, model=t.cfg)
    tensors = man["tensors"]
    opt_man = man.get("optimizer") or {}
    same_opt = opt_man.get("type") == type(eng.opt).__name__  # else: a fresh optimizer state
    with_opt = same_opt and any(k.startswith("optim.") for k in tensors) and not weights_only
    has_master = any(k.startswith("master.") for k in tensors)
    has_comp = any(k.startswith("comp.") for k in tensors) and not has_master
    src = "master" if has_master else "model"
    pol = eng.policy
    kahan_comp = has_comp and pol.in_place and pol.master == "kahan"  # c read as saved
    dest: dict[str, Any] = {}
    # the fp32 value of the owned parameters: the master itself, or (no master: in place) a
    # temporary that becomes the compute-dtype parameters below
    value = [b.master if not pol.in_place else _zeros(b) for b in eng.buckets]
    comp = [None if not has_comp or kahan_comp else _zeros(b) for b in eng.buckets]
    for i, _, g, gshape, shape, shift, (a, c), (s0, s1) in owned(eng, t.parallel.placements):
        _add(dest, f"{src}.{g}", gshape, value[i][s0:s1], shape, shift, a, c)
        if kahan_comp:
            _add(dest, f"comp.{g}", gshape, eng.buckets[i].comp[s0:s1], shape, shift, a, c)
        elif has_comp:
            _add(dest, f"comp.{g}", gshape, comp[i][s0:s1], shape, shift, a, c)
    if with_opt:
        entries = optim_entries(eng, t.parallel.placements)
        missing = sorted({e[0] for e in entries if e[0] not in tensors})
        if missing:
            raise ConfigError([f"--resume: the checkpoint's {opt_man.get('type')} state lacks "
                               f"{len(missing)} tensor(s) this run needs (written by an older "
                               "fived?): " + ", ".join(missing[:8])])
        for key, gshape, local, shape, shift, a, c in entries:
            _add(dest, key, gshape, local, shape, shift, a, c)
    # the selection bias routes the forward: loaded with the weights (a checkpoint without it,
    # e.g. an aux_loss run or an import, leaves the bias at zero)
    dest.update({k: v for k, v in t.balancer.state_dict().items() if k in tensors})
    rng = {}
    for k, v in ({} if weights_only else rng_state(eng)).items():
        if f"rng.{k}.rank{t.rank}" in tensors:
            rng[k] = dest[f"rng.{k}.rank{t.rank}"] = torch.empty_like(v)
    dcp.load(dest, storage_reader=storage.safe_reader(ckpt), planner=LoadPlanner())
    with torch.no_grad():
        for b, v, cv in zip(eng.buckets, value, comp):
            if cv is not None:  # a Kahan checkpoint into a run without c: θ + c
                v.add_(cv)
            if pol.in_place:
                b.param_shard.copy_(v)  # exact when v is a saved compute-dtype parameter
                if b.comp is not None and not kahan_comp:  # c: what rounding v dropped
                    b.comp.copy_(v - b.param_shard.float())
        eng.publish_params()
    if with_opt:
        for k, v in (opt_man.get("scalars") or {}).items():
            if k == "t":
                eng.opt.t = int(v)
    if weights_only:
        return int(man["step"])
    sc = getattr(eng, "scaler", None)
    if sc is not None and man.get("loss_scaler"):
        sc.scale = float(man["loss_scaler"]["scale"])
        sc.good_steps = int(man["loss_scaler"]["good_steps"])
        sc.skipped = int(man["loss_scaler"]["skipped"])
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])
    if "sr" in rng:
        eng.sr_gen.set_state(rng["sr"])
    t.load_data_state(man.get("data") or {})
    return int(man["step"])
