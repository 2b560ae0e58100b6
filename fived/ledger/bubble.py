"""The pipeline bubble: idle time of a pipeline of p stages running m micro-batches.

With t the time of one micro-batch's forward + backward on one stage (Huang et al. 2019,
GPipe; Narayanan et al. 2021, 1F1B and interleaving; Qi et al. 2023, zero-bubble ZB-H1):

    schedule      bubble time (in units of t)      bubble fraction of the step
    gpipe, 1f1b   (p − 1)                          (p − 1) / (m + p − 1)
    interleaved   (p − 1) / v                      (p − 1) / (v·m + p − 1)
    zb-h1         (p − 1) / 3                      (p − 1) / (3m + p − 1)
    zb-v,         max(p − 1, 4p − 2 − 2m) / 6      (p − 1) / (6m + p − 1)   (m ≥ 2p − 1;
    dualpipe-v                                                             dualpipe-v: m ≥ 2p)

ZB-H1 splits the backward into input-grad B and weight-grad W and fills the bubble with W; with
T_F = T_B = T_W the remaining bubble is a third of 1F1B's. The *ratio* bubble/ideal is
(p−1)/m for 1F1B: the reason to use many micro-batches.

ZB-V and DualPipe-V hold two chunks per rank in a V (rank r: stages r and 2p − 1 − r), each
chunk's F, B and W one sixth of t; a rank works 6m sixths and the makespan is
max(6m + p − 1, 4m + 4p − 2) sixths: the ramp of a V (p − 1 sixths) once the micro-batches
fill it, the depth of the V (two forward and two backward sweeps) below that. DualPipe-V runs
its overlapped F&B pairs one after the other here (as torch's runtime does on CPU), so its
bubble is ZB-V's; with real overlap it shrinks further (DeepSeek-V3, 2024).
"""

from __future__ import annotations

from ..config import V_SCHEDULES, ParallelConfig


def bubble_ticks(par: ParallelConfig) -> float:
    """Bubble time in units of one micro-batch's forward+backward on one stage."""
    p = par.pp
    if p <= 1:
        return 0.0
    if par.schedule == "interleaved" and par.virtual_stages > 1:
        return (p - 1) / par.virtual_stages
    if par.schedule == "zb-h1":
        return (p - 1) / 3
    if par.schedule in V_SCHEDULES:
        return max(p - 1, 4 * p - 2 - 2 * par.micro_batches) / 6
    return float(p - 1)


def bubble_fraction(par: ParallelConfig) -> float:
    """Fraction of the step the pipeline is idle: ticks / (m + ticks)."""
    t = bubble_ticks(par)
    return t / (par.micro_batches + t) if t else 0.0


def bubble_ratio(par: ParallelConfig) -> float:
    """Bubble time over ideal time: ticks / m ((p−1)/m for 1F1B)."""
    return bubble_ticks(par) / par.micro_batches
