"""CP-SAT timeline model of one plan: when every transfer, compute and CPU update runs.

The packing model (packing.py) rates a configuration with a closed formula; this model
schedules the plan's actual events, the same ones the simulator plays
(harmony_opt.sim.simulator builds them):

* one interval per event (compute, swap-in of weights and activations, swap-out, P2P,
  CPU update), its length the event's duration;
* precedences from the task graph: an event starts after the events it needs have ended
  (and, for prefetch, after the event it overlaps has started);
* each stream runs its events in the simulator's order (the order the compiler emits),
  so the model decides *when*, i.e. how far ahead each swap and prefetch runs;
* ``Cumulative`` for the host link: at most ``link_slots`` transfers per direction at
  once (per GPU when the link is not shared);
* without copy/compute overlap (``Hardware.copy_overlap`` false, the CPU device), ``NoOverlap``
  for each rank's compute, swap and P2P events (the simulator's one engine per rank);
* ``Cumulative`` for each GPU's memory: a task's weights are held from the start of
  their swap-in, its working set from its first compute, both until its last event ends;
  a gradient kept on the GPU from its producer's end until its consumer's (``reservations``).

The simulator's own schedule is a feasible solution and is given as the hint, so the
optimum is never later than the simulated time; the difference is how much a smarter
dispatcher than the simulator's greedy one could gain, and the bound proves how much
no dispatcher can.

The order inside the transfer streams is the plan's: Harmony's rule, or the order it carries
(``Plan.transfer_order``). ``order_bound_s`` proves how much any other order could gain: the same
floor with the order of the transfer streams left free (``ORDER_FREE``). ``order="carried"`` lets
CP-SAT choose the order of the streams a plan can carry (``plan.ORDERED_STREAMS``: activation
swap-ins and swap-outs, and the release of memory; ``NoOverlap`` per stream), and its result
carries the schedule's order as the plan's (``TimelineResult.order``): the planner keeps it where
the simulator plays it faster. ``order="free"`` frees the weights' swap-ins and the P2P
transfers as well, which a plan cannot carry (benchmarks/bench_swap_order.py measures it).
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections import defaultdict
from graphlib import TopologicalSorter

from ortools.sat.python import cp_model

from harmony_opt.core.hardware import Hardware
from harmony_opt.core.plan import ORDERED_STREAMS, Plan, StreamOrder
from harmony_opt.core.profile import Profile
from harmony_opt.sim.simulator import ENGINE_STREAMS, Expansion, check_memory

from . import cpsat

SCALE = 1e6   # seconds -> integer microseconds (the timeline model keeps event times exact to 1 us)

#: The transfer streams, whose order Harmony fixes by rule, as against the compute and CPU streams,
#: whose order is the plan's task order; with the order free, each still moves one transfer at a time
TRANSFER_STREAMS = ("swap_in_w", "swap_in", "swap_out", "p2p")
#: ... and the streams whose order may change: the transfers and the bookkeeping of freed memory
ORDER_FREE = (*TRANSFER_STREAMS, "free")

#: The orders solve_timeline may leave to CP-SAT: none, those a plan carries, every transfer stream's
ORDERS = {"fixed": (), "carried": ORDERED_STREAMS, "free": ORDER_FREE}

#: TimelineResult.status where CP-SAT found no schedule in its time: the result is the simulator's
#: schedule (the hint, feasible for the model) against the model's floor (``_floor_ticks``)
HINT = "SIMULATOR_SCHEDULE"


@dataclasses.dataclass
class TimelineResult:
    status: str
    makespan_s: float | None
    bound_s: float
    simulated_s: float
    events: int
    wall_time: float
    starts: list                 # start time (s) of every event, in the simulator's event order
    order_bound_s: float = float("nan")   # no schedule in any order of the ORDER_FREE streams ends sooner
    # where CP-SAT chose an order (order "carried" or "free"): the order of the streams a plan carries in
    # this schedule, where it is not Harmony's rule (None: the rule's everywhere), as Plan.transfer_order;
    # and how many transfers run in another place of their stream than the rule's
    order: tuple[StreamOrder, ...] | None = None
    moved: int = 0

    @property
    def gap(self) -> float | None:
        return self._gap(self.bound_s)

    @property
    def order_gap(self) -> float | None:
        """What another order of the transfers could gain at most, as a share of the makespan."""
        return self._gap(self.order_bound_s)

    def _gap(self, bound: float) -> float | None:
        if self.makespan_s is None or self.makespan_s <= 0:
            return None
        return max(0.0, (self.makespan_s - bound) / self.makespan_s)


def reservations(ev) -> list[tuple[int, bool, int, int]]:
    """The simulator's memory reservations as (event that makes it, whether from its start (else
    from its end), event whose end releases it, bytes): a task's reservations last until its free
    event; what that event keeps (a gradient kept on the GPU, Plan.gpu_handoff) is held from its
    end until the rank's next free event that releases more than its task reserved."""
    out, pending, kept = [], defaultdict(list), defaultdict(list)
    for k, e in enumerate(ev):
        if e.alloc:
            pending[(e.rank, e.task)].append(k)
        if e.free_after is None:
            continue
        made = pending.pop((e.rank, e.task), [])
        out += [(a, True, k, ev[a].alloc) for a in made]
        extra = sum(e.free_after) - sum(ev[a].alloc for a in made)     # > 0: releases what others kept
        while extra > 0 and kept[e.rank]:
            p, n = kept[e.rank].pop(0)
            out.append((p, False, k, n))
            extra -= n
        if extra < 0:                                                   # keeps some of its own (or
            kept[e.rank].append((k, -extra))                            # releases less than it took)
    return out


def solve_timeline(plan: Plan, profile: Profile, hw: Hardware, *, time_limit: float = 5.0, seed: int = 0,
                   workers: int = 1, report=None, wall_limit: float | None = None,
                   rel_gap: float = 1e-3, order: str = "fixed", hint: list[float] | None = None) -> TimelineResult:
    """Schedule ``plan``'s events optimally (up to ``time_limit`` deterministic seconds and, if given,
    ``wall_limit`` wall-clock seconds; stopping within ``rel_gap`` of the bound). ``order``: whose order
    CP-SAT may change besides the times (``ORDERS``): none (``"fixed"``), the streams a plan carries
    (``"carried"``), every transfer stream (``"free"``). ``hint``: start times of a schedule of the
    model (another result's ``starts``) to start from instead of the simulator's."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, not {order!r}")
    t0 = time.perf_counter()
    plan.check_against(profile, hw)
    cap = int(plan.memory_cap or hw.gpu_memory_bytes)
    check_memory(plan, profile, cap)
    sim = Expansion(plan, profile, hw, cap, plan.prefetch)
    sim.build()
    queues = {k: list(v) for k, v in sim.streams.items()}     # run() consumes nothing it needs
    sim.run(with_timeline=False)                              # the hint: the simulator's schedule
    ev = sim.events
    simulated = max(e.end for e in ev)
    # floors keep the simulator's schedule feasible in integer time: floor(a + b) >= floor(a) + floor(b)
    ticks = lambda s: int(math.floor(s * SCALE))  # noqa: E731
    horizon = ticks(simulated) + 1
    at = [ticks(e.start) for e in ev] if hint is None else [round(h * SCALE) for h in hint]   # the hint
    m = cp_model.CpModel()
    start, end, iv = [], [], []
    for k, e in enumerate(ev):
        d = ticks(e.duration)
        s = m.new_int_var(0, horizon, f"s{k}")
        start.append(s)
        end.append(s + d)
        iv.append(m.new_fixed_size_interval_var(s, d, f"i{k}"))
        m.add_hint(s, at[k])
    for k, e in enumerate(ev):
        for d in e.deps:
            m.add(start[k] >= end[d])
        for d in e.start_deps:
            m.add(start[k] >= start[d])
    by_plan = {k: q for k, q in queues.items() if k[1] not in ORDER_FREE}     # compute and CPU: the task order
    ordered = {k: q for k, q in queues.items() if k[1] not in ORDERS[order]}
    for q in ordered.values():                 # FIFO per stream
        for a, b in zip(q, q[1:]):
            m.add(start[b] >= end[a])
    for key, q in queues.items():              # else one transfer at a time, in any order
        if key not in ordered and key[1] in TRANSFER_STREAMS and len(q) > 1:
            m.add_no_overlap([iv[k] for k in q])
    links = link_resources(ev, hw)
    slots = hw.link_slots if hw.shared_host_link else 1
    for ks in links.values():
        if len(ks) > slots:
            m.add_cumulative([iv[k] for k in ks], [1] * len(ks), slots)
    engines = engine_resources(ev, hw)
    for ks in engines.values():
        if len(ks) > 1:
            m.add_no_overlap([iv[k] for k in ks])
    # memory: each reservation from the start of the event that makes it to the end of the one that frees it
    held = defaultdict(list)
    for a, a_starts, k, nbytes in reservations(ev):
        first = start[a] if a_starts else end[a]
        size = m.new_int_var(0, horizon, f"hold{a}_{k}")
        m.add(size == end[k] - first)
        m.add_hint(size, at[k] + ticks(ev[k].duration) - (at[a] + (0 if a_starts else ticks(ev[a].duration))))
        held[ev[k].rank].append((m.new_interval_var(first, size, end[k], f"h{a}_{k}"), nbytes))
    for rank, items in held.items():
        if sum(b for _, b in items) > cap:
            m.add_cumulative([i for i, _ in items], [int(b) for _, b in items], cap)
    # no schedule of these events ends before floor (precedences, streams, the link as one machine):
    # stated, it lets CP-SAT stop as soon as the hint is within its gap of it
    floor = _floor_ticks(ev, queues, ticks, links.values(), slots, ordered, engines.values())
    # the same with the transfers in any order: no order of them beats it
    order_floor = floor if order == "free" else _floor_ticks(ev, queues, ticks, links.values(), slots, by_plan,
                                                            engines.values())
    order_bound = order_floor / SCALE
    T = m.new_int_var(min(floor, horizon), horizon, "makespan")
    m.add_max_equality(T, end)
    hinted = max(h + ticks(e.duration) for h, e in zip(at, ev))
    m.add_hint(T, hinted)
    m.minimize(T)
    # precedences and cumulative propagation give the bound, the LP only costs time; closing the
    # last 0.1 % can take seconds of wall time
    solver = cpsat.solver(time_limit=time_limit, seed=seed, workers=workers, rel_gap=rel_gap, wall_limit=wall_limit,
                          linearization_level=0)
    status = solver.solve(m)
    name = solver.status_name(status)
    wall = time.perf_counter() - t0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE, cp_model.UNKNOWN):      # a bug, not the time
        return TimelineResult(name, None, float("nan"), simulated, len(ev), wall, [], order_bound)
    if status == cp_model.UNKNOWN:
        # out of time before CP-SAT took up its hint (a wall limit, thousands of events): the hint is a
        # schedule of the model all the same, and the floor a bound on every one
        if report:
            report(f"timeline: {len(ev)} events, CP-SAT {name.lower()} in its time: the simulator's schedule "
                   f"{hinted / SCALE:.4f} s (bound {floor / SCALE:.4f} s)")
        starts = [h / SCALE for h in at]
        return TimelineResult(HINT, hinted / SCALE, floor / SCALE, simulated, len(ev), wall, starts, order_bound,
                              *_schedule_order(sim, starts, ORDERS[order]))
    # a search stopped by its budget before propagating may report a bound of 0; the floor holds for
    # every schedule of these events all the same
    bound = max(solver.best_objective_bound, floor)
    if report:
        report(f"timeline: {len(ev)} events, CP-SAT {name.lower()} {solver.objective_value / SCALE:.4f} s "
               f"(bound {bound / SCALE:.4f} s), simulator {simulated:.4f} s")
    if order == "free":             # CP-SAT's bound holds for every order
        order_bound = bound / SCALE
    starts = [solver.value(s) / SCALE for s in start]
    return TimelineResult(name, solver.objective_value / SCALE, bound / SCALE, simulated, len(ev), wall, starts,
                          order_bound, *_schedule_order(sim, starts, ORDERS[order]))


def _schedule_order(sim: Expansion, starts: list[float], free: tuple[str, ...]) -> tuple[tuple | None, int]:
    """(the order of a schedule in the streams a plan carries, as Plan.transfer_order, for those whose
    order is free and not Harmony's rule, or None; the transfers of the free ones in another place
    than the rule's). The rule runs a stream's events in the order the simulator made them, ``sim``'s
    with the plan's own order aside, so ties go to the event made first: the simulator makes an event
    after those it waits on (all-reduces and CPU updates aside, which wait on other replicas), so
    zero-length ties keep their dependencies; an order the simulator still cannot play is refused
    there (PlanError), and the planner keeps the rule's."""
    out, moved = [], 0
    for (rank, stream), q in sorted(sim.streams.items()):
        if stream not in free:
            continue
        rule, new = sorted(q), sorted(q, key=lambda k: (starts[k], k))
        if stream in TRANSFER_STREAMS:
            moved += sum(a != b for a, b in zip(rule, new))
        if new != rule and stream in ORDERED_STREAMS:
            out.append((rank, stream, tuple(sim.key(k) for k in new)))
    return tuple(out) or None, moved


def link_resources(ev, hw: Hardware) -> dict:
    """Transfer events by the link they share: per direction and server (per GPU and direction when
    each GPU has its own link), each carrying at most ``link_slots`` (1) transfers at once."""
    links = defaultdict(list)
    for k, e in enumerate(ev):
        if e.link is not None:
            if not hw.shared_host_link:
                links[(e.link, e.rank)].append(k)
            else:
                links[e.link if hw.servers == 1 else (e.link, hw.server_of(e.rank))].append(k)
    return links


def engine_resources(ev, hw: Hardware) -> dict:
    """Events by the rank whose one engine runs them one at a time (the simulator's
    ``ENGINE_STREAMS``); none where the hardware overlaps copies with compute."""
    engines = defaultdict(list)
    if not hw.copy_overlap:
        for k, e in enumerate(ev):
            if e.stream in ENGINE_STREAMS:
                engines[e.rank].append(k)
    return engines


def _floor_ticks(ev, queues, ticks, links=(), slots: int = 1, ordered=None, engines=()) -> int:
    """The makespan no schedule of ``ev`` beats: the longest path through the model's precedences
    (dependencies, prefetch start links, the order of the ``ordered`` streams, by default all), the
    busiest stream's (or engine's) total, and each link's one-machine bound (``one_machine_bound``:
    its transfers, which the path lets run side by side on different streams and GPUs, queue on it)."""
    ordered = queues if ordered is None else ordered
    fifo = {b: a for q in ordered.values() for a, b in zip(q, q[1:])}    # b starts after a ends
    dur = [ticks(e.duration) for e in ev]
    after_end = [[*e.deps, *([fifo[k]] if k in fifo else [])] for k, e in enumerate(ev)]
    graph = {k: {*after_end[k], *e.start_deps} for k, e in enumerate(ev)}
    order = list(TopologicalSorter(graph).static_order())
    head = [0] * len(ev)            # earliest start
    for k in order:
        head[k] = max([0, *(head[d] + dur[d] for d in after_end[k]), *(head[d] for d in ev[k].start_deps)])
    rest = list(dur)                # from the event's start to the end of the iteration, at least
    for k in reversed(order):
        for d in after_end[k]:
            rest[d] = max(rest[d], dur[d] + rest[k])
        for d in ev[k].start_deps:
            rest[d] = max(rest[d], rest[k])
    path = max((h + r for h, r in zip(head, rest)), default=0)
    busiest = max((sum(dur[k] for k in q) for q in [*queues.values(), *engines]), default=0)
    # c slots of a link do at most what one machine c times as fast does, preemption allowed
    machine = max((one_machine_bound([slots * head[k] for k in ks], [dur[k] for k in ks],
                                     [slots * (rest[k] - dur[k]) for k in ks]) // slots for ks in links), default=0)
    return max(path, busiest, machine)


def one_machine_bound(release, length, tail) -> int:
    """The least makespan of jobs on one machine, each after its release and followed by its tail, with
    preemption allowed (Jackson's rule: the released job with the longest tail runs first). Carlier
    (1982): it equals the largest ``min release + sum of lengths + min tail`` over any subset of the
    jobs, so it bounds every non-preemptive schedule; O(n log n)."""
    jobs = sorted(range(len(release)), key=release.__getitem__)
    ready, left, t, i, best = [], list(length), 0, 0, 0
    while i < len(jobs) or ready:
        if not ready:
            t = max(t, release[jobs[i]])
        while i < len(jobs) and release[jobs[i]] <= t:
            heapq.heappush(ready, (-tail[jobs[i]], jobs[i]))
            i += 1
        neg_tail, k = ready[0]
        until = release[jobs[i]] if i < len(jobs) else math.inf
        run = min(left[k], until - t)       # until done or the next release, which may preempt it
        t += run
        left[k] -= run
        if left[k] <= 0:
            heapq.heappop(ready)
            best = max(best, t - neg_tail)
    return best
