"""The files of a checkpoint and the rules that make it safe.

Layout of ``DIR`` (``--save-dir``)::

    DIR/step-000040/            one complete checkpoint (renamed into place when complete)
        __0_0.distcp ...        DCP's data files (tensors, written by every rank)
        .metadata               DCP's index: every global tensor, its shape and boxes
        manifest.json           fived's: step, layout, configs, tensors, files + sha256
    DIR/.tmp-step-000050/       a save in progress (never read; removed by the next save)

* **Atomic.** Every rank writes into ``.tmp-step-N``; when DCP's coordinator has finished (all
  ranks' data and ``.metadata`` are on disk) rank 0 hashes every file, writes
  ``manifest.json``, fsyncs and renames the directory to ``step-N``. A ``kill -9`` before the
  rename leaves only a hidden ``.tmp-*`` directory: ``latest`` never sees it, so the previous
  checkpoint stays the one that ``--resume DIR`` loads.
* **Verified.** ``verify`` checks that each file the manifest lists exists with its size and
  sha256 before anything is loaded; a partial or corrupted checkpoint is a ``ConfigError`` that
  names the file (exit 2).
* **No code is unpickled.** Tensors are read by DCP with ``torch.load(weights_only=True)``;
  DCP's ``.metadata`` is a pickle, so ``SafeReader`` reads it with an unpickler that only
  constructs DCP's own metadata classes, ``torch.Size``, dtypes and plain containers
  (``ALLOWED``); anything else is refused. Nothing fived saves is a pickled object (the
  manifest is JSON).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

from ..config import ConfigError

MANIFEST = "manifest.json"
FORMAT = "fived-dcp/1"
STEP_RE = re.compile(r"^step-(\d+)$")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def tmp_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f".tmp-step-{step:06d}"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finalize(root: str | Path, step: int, manifest: dict[str, Any], keep: int = 0) -> Path:
    """Rank 0, after every rank's data is written: hash the files, write the manifest, rename
    ``.tmp-step-N`` to ``step-N``; then drop all but the newest ``keep`` checkpoints (0: keep
    all)."""
    tmp, final = tmp_dir(root, step), step_dir(root, step)
    files = {}
    for p in sorted(tmp.iterdir()):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            files[p.name] = {"bytes": p.stat().st_size, "sha256": sha256(p)}
    manifest = {**manifest, "format": FORMAT, "files": files}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again (e.g. a resumed run): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(Path(root))
    if keep > 0:
        for old in complete(root)[:-keep]:
            shutil.rmtree(old[1], ignore_errors=True)
    return final


def clean_tmp(root: str | Path) -> None:
    """Remove what an interrupted save left behind (rank 0, before a new save)."""
    for p in Path(root).glob(".tmp-step-*"):
        shutil.rmtree(p, ignore_errors=True)


def complete(root: str | Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``root`` (``step-N`` with a manifest), oldest first."""
    out = []
    for p in Path(root).iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and (p / MANIFEST).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def resolve(path: str | Path, flag: str = "--resume") -> Path:
    """``DIR`` (its newest complete checkpoint) or ``DIR/step-N`` -> the checkpoint directory;
    a ``ConfigError`` for a missing, empty or foreign directory."""
    p = Path(path)
    if not p.exists():
        raise ConfigError([f"{flag} {path}: no such directory"])
    if not p.is_dir():
        raise ConfigError([f"{flag} {path}: not a directory"])
    if (p / MANIFEST).is_file():
        return p
    if STEP_RE.match(p.name) or p.name.startswith(".tmp-step-"):
        raise ConfigError([f"{flag} {path}: incomplete checkpoint ({p / MANIFEST} is missing; "
                           "the save was interrupted)"])
    found = complete(p)
    if not found:
        extra = ""
        if (p / "config.json").is_file():
            extra = " (it looks like a Hugging Face model: use --init-from or `fived import`)"
        raise ConfigError([f"{flag} {path}: no complete checkpoint in this directory "
                           f"(no step-N/{MANIFEST}){extra}"])
    return found[-1][1]


def newest_valid(root: str | Path, flag: str = "--resume auto"
                 ) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
    """``--resume auto``: the newest complete checkpoint under ``root`` that verifies (sizes,
    sha256), its manifest, and a line for each newer one that did not (skipped); ``(None, None,
    [])`` when ``root`` does not exist or holds no complete checkpoint (a fresh start)."""
    root = Path(root)
    if not root.is_dir():
        return None, None, []
    skipped = []
    for _, ckpt in reversed(complete(root)):
        try:
            return ckpt, verify(ckpt, flag), skipped
        except ConfigError as e:
            skipped.append(f"{ckpt.name} skipped: {'; '.join(e.problems)}")
    return None, None, skipped


def read_manifest(ckpt: Path, flag: str = "--resume") -> dict[str, Any]:
    try:
        with open(ckpt / MANIFEST) as f:
            man = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError([f"{flag}: {ckpt / MANIFEST} is unreadable ({e})"]) from None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise ConfigError([f"{flag}: {ckpt / MANIFEST} is not a fived checkpoint manifest "
                           f"(format {man.get('format') if isinstance(man, dict) else None!r}, "
                           f"expected {FORMAT!r})"])
    return man


def verify(ckpt: Path, flag: str = "--resume", checksums: bool = True) -> dict[str, Any]:
    """The manifest, after checking every listed file's presence, size and sha256."""
    man = read_manifest(ckpt, flag)
    for name, want in man["files"].items():
        p = ckpt / name
        if not p.is_file():
            raise ConfigError([f"{flag}: {p} is missing (partial checkpoint)"])
        size = p.stat().st_size
        if size != want["bytes"]:
            raise ConfigError([f"{flag}: {p} has {size} bytes, the manifest says {want['bytes']} "
                               "(truncated or corrupted)"])
        if checksums and sha256(p) != want["sha256"]:
            raise ConfigError([f"{flag}: {p} fails its sha256 check (corrupted)"])
    check_metadata(ckpt, flag)
    return man


# ------------------------------------------------------------------ safe metadata reading
ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint._extension", "ExtensionRegistry"),
    ("torch.serialization", "_get_layout"),  # a layout by its name (torch.strided)
    ("torch", "Size"), ("torch", "float32"), ("torch", "float16"), ("torch", "bfloat16"),
    ("torch", "float64"), ("torch", "int64"), ("torch", "int32"), ("torch", "uint8"),
    ("torch", "bool"), ("torch", "strided"), ("torch", "contiguous_format"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
}


_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING",
               "BINSTRING", "SHORT_BINSTRING"}


def unsafe_globals(data: bytes) -> list[str]:
    """The globals a pickle would import that the restricted unpickler refuses, read from its
    opcodes without running any of them (and without importing torch): [] when every one is
    allowed. A pickle that does not parse, or names a global in a way this reading cannot
    follow, raises ``ValueError`` with the reason."""
    import pickletools

    pushed: list[Any] = []  # what each opcode pushed (a str, or None for anything else)
    memo: dict[int, Any] = {}
    bad = []
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in _STRING_OPS:
            pushed.append(arg)
        elif name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = pushed[-1] if pushed else None
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            pushed.append(memo.get(arg))
        elif name in ("GLOBAL", "STACK_GLOBAL", "INST"):
            if name == "STACK_GLOBAL":
                mod, attr = (pushed[-2], pushed[-1]) if len(pushed) >= 2 else (None, None)
            else:
                mod, _, attr = str(arg).partition(" ")
            if not isinstance(mod, str) or not isinstance(attr, str):
                raise ValueError("it names an object this reader cannot follow")
            if (mod, attr) not in ALLOWED:
                bad.append(f"{mod}.{attr}")
            pushed.append(None)
        elif name in ("EXT1", "EXT2", "EXT4", "OBJ"):
            raise ValueError(f"it uses the {name} opcode, never in checkpoint metadata")
        else:
            pushed.append(None)
    return bad


def check_metadata(ckpt: Path, flag: str = "--resume") -> None:
    """DCP's ``.metadata`` of checkpoint ``ckpt`` would load with the restricted unpickler (every
    global it names is allowed) and parses; else one ConfigError naming the file and the reason,
    before any rank starts (the ranks would refuse it too, each with a traceback)."""
    path = Path(ckpt) / ".metadata"
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError([f"{flag}: {path} is unreadable ({e.strerror or e})"]) from None
    try:
        bad = unsafe_globals(data)
    except ValueError as e:
        raise ConfigError([f"{flag}: {path} does not parse as checkpoint metadata ({e}); the "
                           "checkpoint is refused, nothing was loaded"]) from None
    if bad:
        raise ConfigError([f"{flag}: {path} would run or import {', '.join(sorted(set(bad)))} "
                           "when loaded (not checkpoint metadata: tampered?); refused, nothing "
                           "was loaded or run"])


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


def safe_unpickle(data: bytes) -> Any:
    return _Restricted(io.BytesIO(data)).load()


def safe_reader(path: str | Path):
    """DCP's ``FileSystemReader`` whose ``.metadata`` is read by the restricted unpickler."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            md_path = Path(self.path) / ".metadata"
            md = safe_unpickle(md_path.read_bytes())
            from torch.distributed.checkpoint.metadata import TensorStorageMetadata

            odd = [k for k, v in md.state_dict_metadata.items()
                   if not isinstance(v, TensorStorageMetadata)]
            if odd:  # DCP would torch.load(weights_only=False) such entries: never
                raise pickle.UnpicklingError(f"{md_path}: non-tensor entries {odd[:5]} "
                                             "(fived checkpoints hold tensors only)")
            if getattr(md, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeReader(str(path))
