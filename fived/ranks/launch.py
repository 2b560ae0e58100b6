"""Starting ranks: under ``torchrun`` (its environment) or as local processes fived spawns.

This module is the only place in fived that reads the process environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``FIVED_DEVICE``, ``FIVED_MALLOC``); everything
else asks it:

* ``torchrun_env()`` — ``(rank, world, local_rank)`` when an env:// launcher (torchrun, or one
  ``torchrun`` per node under SLURM) started this process, else ``None``;
* ``device_and_backend(prefer_cpu)`` — cuda+nccl when a GPU is visible, else cpu+gloo
  (``cuda_expected()`` says which beforehand, for ``--precision auto``);
  ``rank_device()`` — the device of an initialised rank (cuda under nccl, else cpu);
* ``run_torchrun(fn, args, collective_timeout)`` — this process is one torchrun rank: initialise
  the process group, call ``fn(rank, world, *args)``, wait for every rank (a barrier) and tear the
  group down so that no gloo worker thread outlives it (see ``teardown``);
* ``return_freed_memory()`` — with ``FIVED_MALLOC=trim`` every rank process starts with
  glibc's mmap threshold fixed at 64 KiB, so a freed tensor's pages go back to the system at
  once (slower for small tensors; off by default);
* ``run_local(fn, nprocs, args)`` — start ``nprocs`` spawned processes on a free port, each
  calling ``fn(rank, world, *args)`` inside an initialised process group, and return every rank's
  result. If any rank fails, the others are killed at once and ``RankFailure`` carries the
  failing rank's traceback; a rank that hangs past ``timeout`` is killed too — no process is left
  behind.
"""

from __future__ import annotations

import datetime
import gc
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that need it: torchrun_env() and free_port() are
# called before a command prints its first line, and importing torch takes seconds.


class RankFailure(RuntimeError):
    def __init__(self, rank: int, detail: str):
        self.rank, self.detail = rank, detail
        super().__init__(f"rank {rank} failed:\n{detail}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env() -> tuple[int, int, int] | None:
    """``(rank, world, local_rank)`` when an env:// launcher started this process, else None."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return None
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))


def cuda_expected(prefer_cpu: bool = False) -> bool:
    """Whether ``device_and_backend`` will put this process's ranks on cuda (what ``--precision
    auto`` asks: bf16 there, fp32 on the cpu). Plainly no (``prefer_cpu``, ``FIVED_DEVICE=cpu``,
    ``CUDA_VISIBLE_DEVICES`` empty, no GPU driver) is answered without importing torch."""
    env = os.environ
    if prefer_cpu or env.get("FIVED_DEVICE", "") == "cpu" or env.get("CUDA_VISIBLE_DEVICES") in (
            "", "-1"):
        return False
    drivers = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")
    if "torch" not in sys.modules and not any(os.path.exists(p) for p in drivers):
        return False
    import torch

    return torch.cuda.is_available()


def device_and_backend(prefer_cpu: bool = False, local_rank: int | None = None
                       ) -> tuple[torch.device, str]:
    """The one place device specifics live: cuda+nccl when a GPU is visible, else cpu+gloo.

    ``prefer_cpu`` (or ``FIVED_DEVICE=cpu`` in the environment) forces cpu+gloo on a GPU
    machine. The GPU is ``local_rank`` (default: torchrun's ``LOCAL_RANK``, else 0) modulo the
    visible devices."""
    import torch

    if prefer_cpu or os.environ.get("FIVED_DEVICE", "") == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu"), "gloo"
    if local_rank is None:  # torchrun's, or the one run_local gave its child
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device()), "nccl"


def rank_device() -> torch.device:
    """The device this rank computes on, from the initialised world: the current cuda device
    when the backend is nccl, else the cpu (gloo, the ``fake`` dry-run backend, or no group).
    Every tensor a rank makes (model, batches, engine buffers, comm buffers) lives here."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group(rank: int, world: int, port: int | None, timeout_s: float,
                       prefer_cpu: bool = False, local_rank: int | None = None) -> None:
    """``port`` None: torchrun's env:// rendezvous; else tcp://127.0.0.1:port (local ranks)."""
    import torch.distributed as dist

    _, backend = device_and_backend(prefer_cpu, local_rank)
    kw: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if port is None:  # torchrun's env://, its keys apart for each restart (see below)
        from torch.distributed.rendezvous import rendezvous

        # torchrun --max-restarts keeps its store across restarts, and with it the previous
        # attempt's keys: a restarted rank 1 would read the dead rank 0's gloo address
        # ("Connection refused"). A prefix per attempt (TORCHELASTIC_RESTART_COUNT) keeps
        # every attempt's rendezvous its own.
        store, rank, world = next(rendezvous("env://", timeout=kw["timeout"]))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"fived/attempt-{attempt}/", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kw)
    else:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **kw
        )


def teardown() -> None:
    """Destroy every process group so that its worker threads are joined *now*.

    A gloo group runs each collective on a worker thread, which drops its reference to the
    finished work (and so to the work's tensors) a moment after ``wait()`` returns. If that last
    reference is the one keeping a tensor's Python object alive, the worker must take the GIL to
    release it; when this happens while the interpreter is finalising (the main thread has
    returned), ``take_gil`` ends the worker thread with ``pthread_exit``, whose unwinding meets
    a ``noexcept`` frame: ``terminate called without an active exception`` (SIGABRT), and torchrun
    fails the job. The cure is to join those threads before Python exits: collect the garbage
    that still holds groups (a trainer's grid, its hooks), then destroy the groups — the last
    reference to a gloo group runs its destructor (without the GIL), which drains the queue and
    joins the workers (tests/test_torchrun.py checks no worker thread is left).

    Only a group nothing else references is destroyed: one reachable from a cycle that goes
    through C++ outlives it (a ``Trainer`` does: its parameters' post-accumulate-grad hooks are
    bound methods of its engine, a cycle gc cannot collect, and clearing them is not yet enough:
    something of its build still holds the world group), and its workers then live to the exit, kept
    clear of the race only by ``run_torchrun``'s barrier and the time teardown takes."""
    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


MMAP_THRESHOLD = 64 << 10  # bytes: larger allocations get their own pages, unmapped on free
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def return_freed_memory() -> bool:
    """``FIVED_MALLOC=trim``: fix glibc's mmap threshold at ``MMAP_THRESHOLD`` in this process
    (True when set); otherwise, or off glibc, nothing changes.

    PyTorch's CPU tensors come from malloc. By default glibc raises its mmap threshold each
    time a large block is freed (up to 32 MiB), so later activations and gradients of a step
    land in the heap, whose freed pages stay resident: the process's peak RSS grows past the
    step's live tensors (336M at tp2·pp4: 1,481 MiB against a traced peak of 889 MiB). With
    the threshold fixed, each tensor above 64 KiB is its own mapping, returned on free, and the
    peak RSS follows the live bytes (1,260 MiB there; docs/ledger.md, "The step's peak") — but
    every such allocation then faults its pages in afresh: `small` on one rank steps in 0.43 s
    instead of 0.22 s. Hence opt-in, for measuring memory on the CPU. GPU memory is not
    touched either way."""
    if os.environ.get("FIVED_MALLOC", "") != "trim" or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def run_torchrun(fn: Callable, args: tuple = (), collective_timeout: float = 120.0,
                 prefer_cpu: bool = False) -> Any:
    """This process is one rank of a torchrun job: run ``fn(rank, world, *args)`` and return its
    result, with the process group initialised before and torn down after.

    After ``fn`` returns, every rank waits for the others (a barrier: no rank tears down while a
    peer may still talk to it) and then ``teardown()`` joins the backend's threads. When ``fn``
    raises, the rank prints the traceback and leaves at once (``os._exit(1)``): its peers are
    blocked in collectives it will never join, torchrun sees the failure and stops them, and
    nothing waits for a collective timeout on the way out."""
    import torch.distributed as dist

    env = torchrun_env()
    if env is None:
        raise RuntimeError("run_torchrun: RANK, WORLD_SIZE and MASTER_ADDR are not set "
                           "(start this under torchrun, or use run_local)")
    rank, world, local_rank = env
    return_freed_memory()
    try:
        init_process_group(rank, world, None, collective_timeout, prefer_cpu, local_rank)
        out = fn(rank, world, *args)
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported here; the process ends
        sys.stdout.flush()
        print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)
    teardown()
    return out


def _exit_with_parent(parent: int) -> None:
    """A started rank must not outlive the process that started it (even one killed -9). A
    spawned rank's parent is that process; a rank forked by the forkserver (``use_forkserver``)
    has the server for parent, so it watches the starting process's pid instead."""
    import threading

    direct = os.getppid() == parent

    def gone() -> bool:
        if direct:
            return os.getppid() != parent
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if gone():
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def _child(rank: int, world: int, port: int, fn: Callable, args: tuple, results: Any,
           threads: int, timeout_s: float, parent: int, prefer_cpu: bool,
           environ: dict[str, str]) -> None:
    import torch
    import torch.distributed as dist

    _exit_with_parent(parent)
    if os.environ != environ:  # a forked rank has the forkserver's environment, not the caller's
        os.environ.clear()
        os.environ.update(environ)
    torch.set_num_threads(threads)
    return_freed_memory()
    os.environ["LOCAL_RANK"] = str(rank)  # this process's own environment: device_and_backend
    try:
        init_process_group(rank, world, port, timeout_s, prefer_cpu, local_rank=rank)
        out = fn(rank, world, *args)
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


_START = "spawn"  # how run_local starts its ranks: "spawn", or "forkserver" after use_forkserver


def use_forkserver(preload: list[str] | tuple[str, ...]) -> None:
    """Start every later ``run_local`` rank by forking one server process that imported
    ``preload`` (e.g. torch and fived's trainer) once, instead of spawning a fresh interpreter
    that imports them again: a rank then starts in milliseconds, not seconds. The server lives
    as long as this process (the test suite's one pool of ranks; ``run_local(fresh=True)``
    still spawns). A forked rank takes the caller's environment as it is at ``run_local``."""
    global _START
    import torch.multiprocessing as mp

    mp.get_context("forkserver").set_forkserver_preload(list(preload))
    _START = "forkserver"


def threads_per_rank(nprocs: int) -> int:
    return max(1, (os.cpu_count() or 1) // nprocs)


def run_local(fn: Callable, nprocs: int, args: tuple = (), timeout: float = 600.0,
              collective_timeout: float = 120.0, prefer_cpu: bool = False,
              forward_signals: list[str] | tuple[str, ...] = (), fresh: bool = False
              ) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``nprocs`` local ranks; return results by rank.

    Ranks are spawned, or forked from the preloaded server after ``use_forkserver``;
    ``fresh=True`` spawns them regardless (a caller that needs new interpreters).

    ``forward_signals`` (names, e.g. ["TERM", "USR1"]): while the ranks run, this process
    passes each such signal it receives on to every live rank (``fived train``'s preemption:
    the ranks save and return; see fived.train.resilience)."""
    import signal

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn" if fresh else _START)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, nprocs, port, fn, args, results, threads_per_rank(nprocs),
                  collective_timeout, os.getpid(), prefer_cpu, dict(os.environ)),
            daemon=True,
        )
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()

    def forward(signum: int, frame: Any) -> None:
        for p in procs:
            if p.is_alive() and p.pid:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    old_handlers = {}
    for name in forward_signals:
        sig = getattr(signal, f"SIG{name}")
        try:
            old_handlers[sig] = signal.signal(sig, forward)
        except ValueError:  # not the main thread
            break
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < nprocs:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(nprocs)) - set(out))
                raise RankFailure(missing[0], f"timed out after {timeout:.0f}s (ranks {missing})")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in out]
                if dead:
                    time.sleep(0.5)  # let a traceback that is in flight arrive
                    try:
                        rank, ok, payload = results.get(timeout=0.5)
                    except queue.Empty:
                        raise RankFailure(dead[0], f"exited with code {procs[dead[0]].exitcode}"
                                          ) from None
                else:
                    continue
            if not ok:
                raise RankFailure(rank, payload)
            out[rank] = payload
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=5 if len(out) == nprocs else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
    return [out[r] for r in range(nprocs)]
