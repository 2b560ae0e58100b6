"""Pipeline schedules as data: for each pp rank, an ordered list of actions.

An action is ``(kind, micro-batch, stage)`` with kind one of

=========  ===============================================================================
``F``      forward of (virtual) stage ``stage`` on micro-batch ``mb``
``B``      backward: the whole backward, or (zero-bubble) only the input gradient
``W``      the weight gradient of a split backward (zero-bubble only)
``SEND_F`` send the output activation of ``stage`` to the rank of ``stage + 1``
``RECV_F`` receive the input activation of ``stage`` from the rank of ``stage - 1``
``SEND_B`` send the input gradient of ``stage`` to the rank of ``stage - 1``
``RECV_B`` receive the output gradient of ``stage`` from the rank of ``stage + 1``
=========  ===============================================================================

Stage ``s`` of ``S = pp·v`` lives on rank ``s mod pp`` (chunk ``s // pp``: the interleaved
layout of Narayanan et al. 2021). Sends are asynchronous (posted, never waited on by the
sender before its next action); a receive blocks until the matching send has been posted. The
same lists drive the executor (``runtime.py``), the Gantt figure (``fived figures schedule``)
and the bubble arithmetic (``simulate``).

Bubble with p stages, m micro-batches, unit forward and 2-unit backward (t_b = 2 t_f)::

    GPipe, 1F1B:          (p−1)/(m+p−1)          of the makespan  (= (p−1)/m of the work)
    interleaved, v chunks: (p−1)/(v·m)           relative to the work
    ZB-H1 (F = B = W = 1): (p−1)/(3m+p−1)        bubble (p−1)(t_f + t_b − t_w) instead of
                                                 (p−1)(t_f + t_b + t_w)   (Qi et al. 2023)

``check(schedule)`` validates any schedule before it runs: every action of every (micro-batch,
stage) present once, every dependency earlier in its rank's list, every send matched by one
receive, and no deadlock (a simulation of blocking receives); it raises ``ScheduleError``
naming the first violated dependency.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .config import V_SCHEDULES

COMPUTE = ("F", "B", "W")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE + COMM
NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v")
V_SHAPED = V_SCHEDULES  # two stages per rank, laid out in a V (``layout="v"``)


class ScheduleError(ValueError):
    """A schedule that cannot run: the message names the first violated dependency."""


@dataclass(frozen=True)
class Action:
    kind: str
    mb: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}(mb={self.mb}, stage={self.stage})"


@dataclass
class Schedule:
    name: str
    pp: int
    micro_batches: int
    virtual: int = 1
    split_backward: bool = False
    ranks: list[list[Action]] = field(default_factory=list)
    layout: str = "loop"  # "loop": stage s on rank s mod pp; "v": s and 2·pp−1−s on rank s
    forward_only: bool = False  # F, SEND_F and RECV_F only (``forward_only``: evaluation)

    @property
    def stages(self) -> int:
        return self.pp * self.virtual

    def rank_of(self, stage: int) -> int:
        return stage_rank(stage, self.pp, self.layout)

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.ranks[rank] if a.kind in COMPUTE]


# ---------------------------------------------------------------- message identity

def message(a: Action) -> tuple[str, int, int]:
    """(kind, mb, producing stage) of the message a send/receive action carries."""
    if a.kind == "SEND_F":
        return ("act", a.mb, a.stage)
    if a.kind == "RECV_F":
        return ("act", a.mb, a.stage - 1)
    if a.kind == "SEND_B":
        return ("grad", a.mb, a.stage)
    if a.kind == "RECV_B":
        return ("grad", a.mb, a.stage + 1)
    raise ValueError(a)


def stage_rank(stage: int, pp: int, layout: str = "loop") -> int:
    """The pp rank holding (virtual) stage ``stage``: ``s mod pp`` in the looped (interleaved)
    layout; in the V layout stages 0..pp−1 go down the ranks and pp..2pp−1 come back up, so
    rank r holds stages r and 2pp−1−r (the first and the last stage are both on rank 0, and
    stages pp−1 and pp are both on rank pp−1: that hand-off is local, no message)."""
    if layout == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def peer(a: Action, sched: Schedule) -> int:
    """The pp rank on the other side of a send/receive (the rank itself: a local hand-off)."""
    if a.kind in ("SEND_F", "RECV_B"):
        return sched.rank_of(a.stage + 1)
    return sched.rank_of(a.stage - 1)


def is_local(a: Action, sched: Schedule) -> bool:
    """A send/receive between two stages of the same rank (V layout: stage pp−1 → pp)."""
    return peer(a, sched) == sched.rank_of(a.stage)


# ---------------------------------------------------------------- building

def with_comm(name: str, pp: int, m: int, v: int, split: bool,
              orders: list[list[tuple[str, int, int]]], layout: str = "loop") -> Schedule:
    """Insert the receive before each consumer and the send after each producer. An order item
    ``("BW", mb, s)`` is a full backward: B, then its W, then the send of the input gradient
    (the executor runs the pair as one backward pass)."""
    S = pp * v
    ranks = []
    for order in orders:
        acts: list[Action] = []
        for kind, mb, s in order:
            if kind == "F":
                if s > 0:
                    acts.append(Action("RECV_F", mb, s))
                acts.append(Action("F", mb, s))
                if s < S - 1:
                    acts.append(Action("SEND_F", mb, s))
            elif kind in ("B", "BW"):  # BW: a full backward, B and its W back to back
                if s < S - 1:
                    acts.append(Action("RECV_B", mb, s))
                acts.append(Action("B", mb, s))
                if kind == "BW":
                    acts.append(Action("W", mb, s))
                if s > 0:
                    acts.append(Action("SEND_B", mb, s))
            else:
                acts.append(Action(kind, mb, s))
        ranks.append(acts)
    return Schedule(name, pp, m, v, split, ranks, layout)


def gpipe_orders(pp: int, m: int) -> list[list[tuple[str, int, int]]]:
    return [[("F", i, r) for i in range(m)] + [("B", i, r) for i in range(m)] for r in range(pp)]


def one_f_one_b_orders(pp: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Warm-up p−r−1 forwards, then alternate one forward and one backward, then cool down."""
    out = []
    for r in range(pp):
        warm = min(pp - r - 1, m)
        order = [("F", i, r) for i in range(warm)]
        for i in range(m - warm):
            order += [("F", warm + i, r), ("B", i, r)]
        order += [("B", i, r) for i in range(m - warm, m)]
        out.append(order)
    return out


def interleaved_orders(pp: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """Megatron's interleaved 1F1B: micro-batches go through the v chunks in groups of p;
    warm-up 2(p−r−1) + (v−1)p forwards; needs m divisible by p."""
    if m % pp:
        raise ScheduleError(f"interleaved needs micro-batches ({m}) divisible by pp ({pp})")
    total = m * v

    def fwd(k: int) -> tuple[int, int]:  # (mb, chunk) of this rank's k-th forward
        return (k // (pp * v)) * pp + k % pp, (k // pp) % v

    def bwd(k: int) -> tuple[int, int]:
        return (k // (pp * v)) * pp + k % pp, v - 1 - (k // pp) % v

    out = []
    for r in range(pp):
        warm = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        order = []
        for k in range(warm):
            mb, c = fwd(k)
            order.append(("F", mb, c * pp + r))
        for k in range(total - warm):
            mb, c = fwd(warm + k)
            order.append(("F", mb, c * pp + r))
            mb, c = bwd(k)
            order.append(("B", mb, c * pp + r))
        for k in range(total - warm, total):
            mb, c = bwd(k)
            order.append(("B", mb, c * pp + r))
        out.append(order)
    return out


def zb_h1_orders(pp: int, m: int) -> list[list[tuple[str, int, int]]]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's forward/backward
    order with the backward split into B (input gradient, on the critical path) and W (weight
    gradient, off it). Rank r runs p−r−1 warm-up forwards like 1F1B; each steady-state B is
    followed by its W only once r more B's have gone by, so the first r W's are deferred into
    the cool-down bubble of 1F1B; at most p−r micro-batches hold activations, as in 1F1B."""
    out = []
    for r in range(pp):
        warm = min(pp - r - 1, m)
        order: list[tuple[str, int, int]] = [("F", i, r) for i in range(warm)]
        pending_w: list[int] = []
        lag = r  # W's kept back: the stage's position in the pipeline
        backwards = [(warm + i, i) for i in range(m - warm)] + [(None, i)
                                                               for i in range(m - warm, m)]
        for f, b in backwards:
            if f is not None:
                order.append(("F", f, r))
            order.append(("B", b, r))
            pending_w.append(b)
            if len(pending_w) > lag:
                order.append(("W", pending_w.pop(0), r))
        order += [("W", i, r) for i in pending_w]
        out.append(order)
    return out


def zb_v_orders(pp: int, m: int) -> list[list[tuple[str, int, int]]]:
    """ZB-V (Qi et al. 2023, section 6): two stages per rank in a V (rank r holds stages
    c0 = r and c1 = 2p−1−r), backward split into B and W. Rank r: 2(p−r)−1 forwards of c0;
    r pairs (F c1, F c0); p−r triples (F c1, B c1, W c1); then the steady state
    (F c0, B c0, W c0, F c1, B c1, W c1) until every forward is done; the cool-down runs r
    pairs (B c0, B c1), then p−r pairs (B c0, W c0), then the W's left (c1 first). Built for
    max(m, 2p−1) micro-batches and cut to m (the order torch's ``ScheduleZBVZeroBubble``
    runs). With F = B = W the steady state has no bubble: (p−1)·(F + B − 2W)/… → only the
    warm-up/cool-down ramps of the shorter chunk pipeline remain."""
    n = max(2 * pp - 1, m)
    out = []
    for r in range(pp):
        c0, c1 = r, 2 * pp - 1 - r
        order: list[tuple[str, int, int]] = []
        f0 = f1 = b0 = b1 = 0
        for _ in range(2 * (pp - r) - 1):
            order.append(("F", f0, c0))
            f0 += 1
        for _ in range(r):
            order += [("F", f1, c1), ("F", f0, c0)]
            f1 += 1
            f0 += 1
        for _ in range(pp - r):
            order += [("F", f1, c1), ("B", b1, c1), ("W", b1, c1)]
            f1 += 1
            b1 += 1
        while f1 < f0 or f0 < n:
            if f0 < n:
                order.append(("F", f0, c0))
                f0 += 1
            order += [("B", b0, c0), ("W", b0, c0), ("F", f1, c1), ("B", b1, c1),
                      ("W", b1, c1)]
            f1 += 1
            b0 += 1
            b1 += 1
        w0, w1 = b0, b1
        for _ in range(r):
            order += [("B", b0, c0), ("B", b1, c1)]
            b0 += 1
            b1 += 1
        for _ in range(pp - r):
            order += [("B", b0, c0), ("W", w0, c0)]
            b0 += 1
            w0 += 1
        order += [("W", i, c1) for i in range(w1, b1)] + [("W", i, c0) for i in range(w0, b0)]
        out.append([a for a in order if a[1] < m])
    return out


def dualpipe_v_orders(pp: int, m: int) -> list[list[tuple[str, int, int]]]:
    """DualPipe-V (DeepSeek-V3's DualPipe cut in half; ``ScheduleDualPipeV`` in torch): the V
    layout, m ≥ 2p. Rank r (c0 = r, c1 = 2p−1−r), in eight phases:

        1  F c0 × 2(p−r−1)             5  (B c1 full, then F c1 + B c0 full) × (p−r−1)
        2  (F c0, F c1) × (r+1)        6  (B c1, B c0) × (r+1), input-only from the middle
        3  (B c1, a W, F c1) × (p−r−1) 7  (a W, B c0) × (p−r−1)
        4  (F c0 + B c1, F c1 + B c0) × (m − 2p + r + 1)    8  the W's left × (r+1)

    "F x + B y" is DualPipe's overlapped pair (one forward's compute hides the other's
    communication); fived runs it as F then B. A full backward is B immediately followed by its
    own W; an input-only B queues its W, and "a W" pops the oldest queued one."""
    if m < 2 * pp:
        raise ScheduleError(f"dualpipe-v needs micro-batches ({m}) >= 2·pp ({2 * pp})")
    return [_dualpipe_v_rank(pp, m, r) for r in range(pp)]


def _dualpipe_v_rank(pp: int, m: int, r: int) -> list[tuple[str, int, int]]:
    c0, c1 = r, 2 * pp - 1 - r
    order: list[tuple[str, int, int]] = []
    nf = {c0: 0, c1: 0}
    nb = {c0: 0, c1: 0}
    queue: list[tuple[int, int]] = []

    def fwd(s: int) -> None:
        order.append(("F", nf[s], s))
        nf[s] += 1

    def bwd(s: int, full: bool = True) -> None:
        if full:
            order.append(("BW", nb[s], s))
        else:
            order.append(("B", nb[s], s))
            queue.append((nb[s], s))
        nb[s] += 1

    def pop_w() -> None:
        if queue:
            mb, s = queue.pop(0)
            order.append(("W", mb, s))

    for _ in range(2 * (pp - r - 1)):
        fwd(c0)
    for _ in range(r + 1):
        fwd(c0)
        fwd(c1)
    for _ in range(pp - r - 1):
        bwd(c1, full=False)
        pop_w()
        fwd(c1)
    for _ in range(m - 2 * pp + r + 1):
        fwd(c0)
        bwd(c1)
        fwd(c1)
        bwd(c0)
    for _ in range(pp - r - 1):
        bwd(c1)
        fwd(c1)
        bwd(c0)
    zb = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            zb = True
        bwd(c1, full=not zb)
        if i == (r + 1) // 2 and r % 2 == 0:
            zb = True
        bwd(c0, full=not zb)
    for _ in range(pp - r - 1):
        pop_w()
        bwd(c0, full=not zb)
    for _ in range(r + 1):
        pop_w()
    return order


def build(name: str, pp: int, micro_batches: int, virtual: int = 1) -> Schedule:
    """The named schedule's action lists for every rank."""
    m = micro_batches
    if name == "gpipe":
        sched = with_comm(name, pp, m, 1, False, gpipe_orders(pp, m))
    elif name == "1f1b":
        sched = with_comm(name, pp, m, 1, False, one_f_one_b_orders(pp, m))
    elif name == "interleaved":
        sched = with_comm(name, pp, m, virtual, False, interleaved_orders(pp, m, virtual))
    elif name == "zb-h1":
        sched = with_comm(name, pp, m, 1, True, zb_h1_orders(pp, m))
    elif name == "zb-v":
        sched = with_comm(name, pp, m, 2, True, zb_v_orders(pp, m), layout="v")
    elif name == "dualpipe-v":
        sched = with_comm(name, pp, m, 2, True, dualpipe_v_orders(pp, m), layout="v")
    else:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(NAMES)}")
    return sched


def forward_only(sched: Schedule) -> Schedule:
    """The forward half of ``sched`` (evaluation, under ``torch.no_grad``): every rank keeps
    its F, SEND_F and RECV_F actions in their order and drops every backward action and its
    messages. Deadlock-free whenever ``sched`` is (each rank's list is a subsequence of its
    own, and no kept receive waits on a dropped send); ``check`` verifies it all the same."""
    keep = ("F", "SEND_F", "RECV_F")
    return Schedule(sched.name, sched.pp, sched.micro_batches, sched.virtual, False,
                    [[a for a in acts if a.kind in keep] for acts in sched.ranks],
                    sched.layout, forward_only=True)


# ---------------------------------------------------------------- checking

def _needs(a: Action, S: int, split: bool) -> list[tuple[Action, str]]:
    """Actions that must come earlier in the same rank's list, each with why."""
    if a.kind == "F":
        return [(Action("RECV_F", a.mb, a.stage), f"input activation of stage {a.stage}")] \
            if a.stage > 0 else []
    if a.kind == "SEND_F":
        return [(Action("F", a.mb, a.stage), "the activation it sends")]
    if a.kind == "B":
        need = [(Action("F", a.mb, a.stage), "its forward")]
        if a.stage < S - 1:
            need.append((Action("RECV_B", a.mb, a.stage), f"output gradient of stage {a.stage}"))
        return need
    if a.kind == "SEND_B":
        return [(Action("B", a.mb, a.stage), "the input gradient it sends")]
    if a.kind == "W":
        return [(Action("B", a.mb, a.stage), "the output gradients of its linears")]
    return []


def check(sched: Schedule) -> None:
    """Raise ``ScheduleError`` naming the first violated dependency (or the deadlock)."""
    pp, m, S = sched.pp, sched.micro_batches, sched.stages
    if len(sched.ranks) != pp:
        raise ScheduleError(f"{len(sched.ranks)} action lists for pp = {pp} ranks")
    kinds = ("F",) if sched.forward_only else ("F", "B", "W") if sched.split_backward \
        else ("F", "B")
    sends: dict[tuple, tuple[int, int]] = {}
    recvs: dict[tuple, tuple[int, int]] = {}
    for r, acts in enumerate(sched.ranks):
        seen: set[Action] = set()
        for i, a in enumerate(acts):
            where = f"rank {r} action {i} {a}"
            if a.kind not in KINDS:
                raise ScheduleError(f"{where}: unknown action kind {a.kind!r}")
            if a.kind == "W" and not sched.split_backward:
                raise ScheduleError(f"{where}: W in a schedule without a split backward")
            if sched.forward_only and a.kind not in ("F", "SEND_F", "RECV_F"):
                raise ScheduleError(f"{where}: {a.kind} in a forward-only schedule")
            if not (0 <= a.mb < m and 0 <= a.stage < S):
                raise ScheduleError(f"{where}: micro-batch or stage out of range (m={m}, S={S})")
            if sched.rank_of(a.stage) != r:
                raise ScheduleError(f"{where}: stage {a.stage} lives on rank "
                                    f"{sched.rank_of(a.stage)}")
            if (a.kind in ("SEND_F", "RECV_B") and a.stage == S - 1) or (
                    a.kind in ("RECV_F", "SEND_B") and a.stage == 0):
                raise ScheduleError(f"{where}: no stage on the other side")
            if a in seen:
                raise ScheduleError(f"{where}: duplicate action")
            for need, why in _needs(a, S, sched.split_backward):
                if need not in seen:
                    raise ScheduleError(f"{where} needs {need} ({why}) earlier on rank {r}")
            seen.add(a)
            if a.kind in ("SEND_F", "SEND_B"):
                sends[message(a)] = (r, i)
            elif a.kind in ("RECV_F", "RECV_B"):
                recvs[message(a)] = (r, i)
        for s in [s for s in range(S) if sched.rank_of(s) == r]:
            for mb in range(m):
                for k in kinds:
                    if Action(k, mb, s) not in seen:
                        raise ScheduleError(f"rank {r} never runs {Action(k, mb, s)}")
    for msg, (r, i) in recvs.items():
        if msg not in sends:
            raise ScheduleError(f"rank {r} action {i} {sched.ranks[r][i]} has no matching send "
                                f"of {msg[0]}(mb={msg[1]}, stage={msg[2]})")
    for msg, (r, i) in sends.items():
        if msg not in recvs:
            raise ScheduleError(f"rank {r} action {i} {sched.ranks[r][i]} is never received")
    simulate(sched)  # raises on deadlock


# ---------------------------------------------------------------- simulation

def unit_costs(sched: Schedule) -> dict[str, float]:
    """Unit forward and 2-unit backward (B = W = 1 when the backward is split)."""
    return {"F": 1.0, "B": 1.0, "W": 1.0} if sched.split_backward else {"F": 1.0, "B": 2.0}


@dataclass
class Timeline:
    """Start/end of every action on every rank, and what follows from it."""

    sched: Schedule
    spans: list[list[tuple[Action, float, float]]]
    makespan: float
    busy: list[float]

    @property
    def idle(self) -> list[float]:
        return [self.makespan - b for b in self.busy]

    def bubble_fraction(self) -> float:
        """Idle slots / (p · makespan)."""
        return sum(self.idle) / (self.sched.pp * self.makespan)

    def bubble_relative(self) -> float:
        """Idle slots / busy slots (the (p−1)/(v·m) form)."""
        return sum(self.idle) / sum(self.busy)


def simulate(sched: Schedule, costs: dict[str, float] | None = None,
             comm: float = 0.0) -> Timeline:
    """Run the lists with per-kind costs: each rank executes its actions in order; a receive
    waits for its send (plus ``comm`` latency); sends never wait. Raises ``ScheduleError`` on
    deadlock, naming each blocked rank's action and what it waits for."""
    costs = costs or unit_costs(sched)
    pp = sched.pp
    pos = [0] * pp
    clock = [0.0] * pp
    sent: dict[tuple, float] = {}
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    busy = [0.0] * pp
    total = sum(len(a) for a in sched.ranks)
    done = 0
    while done < total:
        progressed = False
        for r in range(pp):
            acts = sched.ranks[r]
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.kind in ("RECV_F", "RECV_B"):
                    msg = message(a)
                    if msg not in sent:
                        break
                    start = max(clock[r], sent[msg] + comm)
                    end = start
                elif a.kind in ("SEND_F", "SEND_B"):
                    start = end = clock[r]
                    sent[message(a)] = end
                else:
                    start = clock[r]
                    end = start + costs.get(a.kind, 0.0)
                    busy[r] += end - start
                spans[r].append((a, start, end))
                clock[r] = end
                pos[r] += 1
                done += 1
                progressed = True
        if not progressed:
            blocked = []
            for r in range(pp):
                if pos[r] < len(sched.ranks[r]):
                    a = sched.ranks[r][pos[r]]
                    k, mb, s = message(a)
                    blocked.append(f"rank {r} action {pos[r]} {a} waits for the "
                                   f"{'activation' if k == 'act' else 'gradient'} of stage {s} "
                                   f"mb {mb} from rank {sched.rank_of(s)}")
            raise ScheduleError("deadlock: " + "; ".join(blocked))
    return Timeline(sched, spans, max(clock), busy)


# ---------------------------------------------------------------- formulas and memory

def bubble_formula(name: str, pp: int, m: int, v: int = 1) -> float:
    """Bubble as a fraction of the makespan (unit F, 2-unit backward; F = B = W for ZB-H1 and
    for each chunk of ZB-V / DualPipe-V, whose makespan is max(6m + p − 1, 4m + 4p − 2)
    units: the p − 1 ramp of a V once m ≥ 2p − 1 (always for DualPipe-V, m ≥ 2p), the
    pipeline's depth 4p − 2 + 4m (two forward and two backward passes of the V) below it)."""
    p = pp
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    if name in V_SHAPED:  # 2 chunks, F = B = W = 1 each: 6m units of work per rank
        return 1 - 6 * m / max(6 * m + p - 1, 4 * m + 4 * p - 2)
    raise ScheduleError(f"unknown schedule {name!r}")


def bubble_relative_formula(name: str, pp: int, m: int, v: int = 1) -> float:
    """Bubble relative to the work: (p−1)/m, (p−1)/(v·m), (p−1)/(3m); (p−1)/(6m) for the V's
    (m ≥ 2p − 1)."""
    f = bubble_formula(name, pp, m, v)
    return f / (1 - f)


def peak_live(sched: Schedule) -> list[dict[int, int]]:
    """Per rank, per stage: the peak number of micro-batches whose activations are alive
    (forward done, backward — W when split — not yet)."""
    out = []
    last = "W" if sched.split_backward else "B"
    for acts in sched.ranks:
        live: dict[int, int] = defaultdict(int)
        peak: dict[int, int] = defaultdict(int)
        for a in acts:
            if a.kind == "F":
                live[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
            elif a.kind == last:
                live[a.stage] -= 1
        out.append(dict(peak))
    return out


def peak_live_rank(sched: Schedule) -> list[int]:
    """Per rank (all its chunks together): the peak number of live micro-batch activations."""
    out = []
    last = "W" if sched.split_backward else "B"
    for acts in sched.ranks:
        live = peak = 0
        for a in acts:
            if a.kind == "F":
                live += 1
                peak = max(peak, live)
            elif a.kind == last:
                live -= 1
        out.append(peak)
    return out
