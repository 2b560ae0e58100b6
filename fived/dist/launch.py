"""Starting ranks: under ``torchrun`` (its environment) or as local processes fived spawns.

``run_local(fn, nprocs, args)`` starts ``nprocs`` spawned processes on a free port, each calling
``fn(rank, world, *args)`` inside an initialised process group, and returns every rank's result.
If any rank fails, the others are killed at once and ``RankFailure`` carries the failing rank's
traceback; a rank that hangs past ``timeout`` is killed too — no process is left behind.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    def __init__(self, rank: int, detail: str):
        self.rank, self.detail = rank, detail
        super().__init__(f"rank {rank} failed:\n{detail}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_and_backend() -> tuple[torch.device, str]:
    """The one place device specifics live: cuda+nccl when a GPU is visible, else cpu+gloo."""
    if torch.cuda.is_available() and os.environ.get("FIVED_DEVICE", "") != "cpu":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device()), "nccl"
    return torch.device("cpu"), "gloo"


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def init_process_group(rank: int, world: int, port: int | None, timeout_s: float) -> None:
    _, backend = device_and_backend()
    kw: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if port is None:  # torchrun's env://
        dist.init_process_group(backend, **kw)
    else:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **kw
        )


def _exit_with_parent(parent: int) -> None:
    """A spawned rank must not outlive the process that spawned it (even one killed -9)."""
    import threading

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def _child(rank: int, world: int, port: int, fn: Callable, args: tuple, results: Any,
           threads: int, timeout_s: float, parent: int) -> None:
    _exit_with_parent(parent)
    torch.set_num_threads(threads)
    os.environ.setdefault("LOCAL_RANK", str(rank))
    try:
        init_process_group(rank, world, port, timeout_s)
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


def threads_per_rank(nprocs: int) -> int:
    return max(1, (os.cpu_count() or 1) // nprocs)


def run_local(fn: Callable, nprocs: int, args: tuple = (), timeout: float = 600.0,
              collective_timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``nprocs`` local ranks; return results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, nprocs, port, fn, args, results, threads_per_rank(nprocs),
                  collective_timeout, os.getpid()),
            daemon=True,
        )
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
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
    return [out[r] for r in range(nprocs)]
