"""Event-driven simulator of a Plan under the project's default cost model.

It is the common judge: every planner's plan (CP-SAT and the baselines) is scored by
it. ``simulate(plan, profile, hardware)`` expands the plan into events (see
docs/cost_model.md for the exact rules) and plays them:

* per rank the streams ``compute``, ``swap_in_w`` (weights), ``swap_in`` (activations),
  ``swap_out`` and ``p2p``; one ``cpu`` stream per rank for optimizer steps;
* each stream runs its events in order (FIFO), an event starts when its
  dependencies are done;
* host->GPU and GPU->host transfers of all GPUs behind a shared switch share the link:
  at most ``hardware.link_slots`` transfers per direction run at once;
* GPU memory per rank is a resource: a task reserves its weights when their swap-in
  starts and its working set when its first compute starts, and frees both when its
  last event ends; an event that does not fit waits. So prefetch (just-in-time) only
  happens when there is room, and simulated memory never exceeds the cap.

Fidelity limits: kernel times are the profile's per-layer times summed over a pack
(no fusion across layers); a transfer runs at full per-direction bandwidth or waits
(no fractional sharing); the input double-buffer of the next microbatch is not
counted in memory (the per-layer peaks already include one input and one output).
"""
from __future__ import annotations

import dataclasses
import heapq
from collections import defaultdict

import numpy as np

from .errors import PlanError
from .hardware import Hardware
from .plan import Plan, data_shares, split_microbatches
from .profile import Profile
from .timeline import Timeline, memory_steps
from .units import fmt_bytes

STREAMS = ("compute", "swap_in_w", "swap_in", "swap_out", "p2p", "cpu")
_H2D, _D2H = "h2d", "d2h"


@dataclasses.dataclass
class _Event:
    rank: int
    stream: str
    kind: str
    task: int
    pack: str
    microbatch: int
    duration: float
    nbytes: int
    deps: list            # ids of events that must have ended
    start_deps: list      # ids of events that must have started
    link: str | None = None
    alloc: int = 0        # bytes reserved on the rank's GPU when the event starts
    free_after: list | None = None   # (bytes) released when this event ends
    start: float = -1.0
    end: float = -1.0


@dataclasses.dataclass(frozen=True)
class Task:
    """One unit of work: a pack's forward (F), backward (B) or CPU update (U) on a rank."""

    kind: str
    index: int          # position in the global (vPP) or per-rank (vDP) order
    pack: tuple[int, int]
    rank: int
    bwd_index: int = -1  # index of the pack in plan.packs_bwd (B and U tasks)

    def __str__(self):
        return f"{self.kind}[{self.pack[0]}-{self.pack[1]}]@{self.rank}"


def tasks_of(plan: Plan) -> list[Task]:
    """Harmony's task order and placement (HARMONY_REFERENCE.md 5.1-5.2), for one copy.

    FWD packs ascending, then BWD packs from last to first, each followed by its UPD.
    vPP: the k-th FWD on GPU k mod N, the k-th BWD on (nF + k) mod N; vDP: rank 0's copy
    (every rank runs the same list on its data share).
    """
    n = plan.gpus if plan.mode == "vPP" else 1
    out = []
    nf = len(plan.packs_fwd)
    for k, p in enumerate(plan.packs_fwd):
        out.append(Task("F", len(out), p, k % n))
    for k, bi in enumerate(reversed(range(len(plan.packs_bwd)))):
        rank = (nf + k) % n
        out.append(Task("B", len(out), plan.packs_bwd[bi], rank, bi))
        out.append(Task("U", len(out), plan.packs_bwd[bi], rank, bi))
    return out


def simulate(plan: Plan, profile: Profile, hardware: Hardware, *, memory_cap: int | None = None,
             prefetch: bool | None = None, with_timeline: bool = True) -> Timeline:
    """Play ``plan`` on ``hardware`` with ``profile``'s costs; return its Timeline.

    Raises PlanError for a plan that does not match the profile or hardware, or whose
    packs do not fit in memory (the simulator never plays an invalid plan).
    """
    plan.check_against(profile, hardware)
    cap = int(memory_cap or plan.memory_cap or hardware.gpu_memory_bytes)
    check_memory(plan, profile, cap)
    sim = _Expansion(plan, profile, hardware, cap, plan.prefetch if prefetch is None else prefetch)
    sim.build()
    return sim.run(with_timeline)


def check_memory(plan: Plan, profile: Profile, cap: int) -> None:
    """Every task alone must fit: its pack's working set at its microbatch size."""
    for t in tasks_of(plan):
        if t.kind == "U":
            continue
        need = _Expansion.task_memory(plan, profile, t)
        if need > cap:
            raise PlanError(
                f"plan {'forward' if t.kind == 'F' else 'backward'} pack [{t.pack[0]}, {t.pack[1]}] needs "
                f"{fmt_bytes(need)} ({need} bytes) at microbatch "
                f"{plan.microbatch_fwd if t.kind == 'F' else plan.microbatch_bwd}, more than the cap of "
                f"{fmt_bytes(cap)} ({cap} bytes); split the pack or use a smaller microbatch")


class _Expansion:
    """Builds the events of one iteration and runs them (one object per simulation)."""

    def __init__(self, plan: Plan, profile: Profile, hw: Hardware, cap: int, prefetch: bool):
        self.plan, self.prof, self.hw, self.cap, self.prefetch = plan, profile, hw, cap, prefetch
        self.events: list[_Event] = []
        self.streams: dict[tuple[int, str], list[int]] = defaultdict(list)
        self.R = profile.num_layers
        self.collectives: dict[tuple, list[int]] = {}   # (sweep, BWD task) -> its all-reduce on every replica
        self.host_sums: dict[tuple, list] = {}   # (sweep, UPD task) -> (update, gradient swap-out) per replica
        self.sweep = 0

    # -- memory rules ------------------------------------------------------------------------
    @staticmethod
    def task_memory(plan: Plan, prof: Profile, t: Task) -> int:
        """Bytes a task holds on its GPU: Harmony's pack compute memory (weights, buffers, one
        microbatch's activations, gradients and workspace) plus what the options add."""
        a, b = t.pack
        if t.kind == "F":
            u = plan.microbatch_fwd
            c = prof.costs("FWD", u)
            mem = int(c.pack_memory(a, b))
            # stash packs: activations of one microbatch wait on the GPU for their swap-out
            for bi, (qa, qb) in enumerate(plan.packs_bwd[:-1]):
                if not plan.options[bi].recompute and qa <= b and qb >= a:
                    mem += int(c.pack_saved(max(a, qa), min(b, qb)))
            return mem
        u = plan.microbatch_bwd
        c = prof.costs("BWD", u)
        mem = int(c.pack_memory(a, b))
        if plan.options[t.bwd_index].optimizer == "gpu":
            mem += int(prof.optimizer_bytes(a, b))
        return mem

    def weight_bytes(self, a, b) -> int:
        return int(self.prof.param_bytes(a, b) + self.prof.buffer_bytes(a, b))

    # -- event helpers ---------------------------------------------------------------------------
    def add(self, rank, stream, kind, task, mb, duration, nbytes=0, deps=(), start_deps=(), link=None,
            alloc=0, free_after=None) -> int:
        e = _Event(rank, stream, kind, task.index, f"{task.pack[0]}-{task.pack[1]}", mb, float(duration),
                   int(nbytes), [d for d in deps if d is not None], [d for d in start_deps if d is not None],
                   link, int(alloc), free_after)
        self.events.append(e)
        eid = len(self.events) - 1
        self.streams[(rank, stream)].append(eid)
        return eid

    def h2d(self, rank, kind, task, mb, nbytes, deps=(), start_deps=(), stream="swap_in", alloc=0):
        return self.add(rank, stream, kind, task, mb, nbytes / self.hw.h2d_bandwidth, nbytes, deps, start_deps,
                        _H2D, alloc)

    def d2h(self, rank, kind, task, mb, nbytes, deps=()):
        return self.add(rank, "swap_out", kind, task, mb, nbytes / self.hw.d2h_bandwidth, nbytes, deps, (), _D2H)

    def transfer(self, src_rank, dst_rank, kind, task, mb, nbytes, deps):
        """Move an activation between GPUs: P2P when there is a GPU link, else through host memory.
        Returns (event the receiver waits for, event that frees the sender's buffer)."""
        if self.hw.p2p_bandwidth > 0:
            e = self.add(src_rank, "p2p", kind, task, mb, nbytes / self.hw.p2p_bandwidth, nbytes, deps)
            return e, e
        out = self.d2h(src_rank, kind, task, mb, nbytes, deps)
        return out, out

    # -- expansion --------------------------------------------------------------------------------
    def build(self) -> None:
        plan, n = self.plan, self.plan.gpus
        copies = range(n) if plan.mode == "vDP" else [None]
        shares = data_shares(plan.batch, n) if plan.mode == "vDP" else [plan.batch]
        tasks = tasks_of(plan)
        for c, share in zip(copies, shares):
            state: dict[int, dict] = {}
            if plan.input_batch_grouping:
                self._build_copy(tasks, c, share, state, True)
            else:   # naive swapping: each microbatch sweeps every pack, weights come in every time
                sweeps = split_microbatches(share, plan.microbatch_fwd)
                for j, u in enumerate(sweeps):
                    self.sweep = j
                    self._build_copy(tasks, c, u, state, j == len(sweeps) - 1)
        # without a GPU link, each replica's CPU sums every replica's gradient: it waits for all of them
        for group in self.host_sums.values():
            grads = [g for _, g in group]
            for upd, _ in group:
                self.events[upd].deps += [g for g in grads if g not in self.events[upd].deps]

    def _build_copy(self, tasks: list[Task], copy: int | None, share: int, last_task_on_rank: dict,
                    with_update: bool) -> None:
        """Events of one copy of the task list over ``share`` samples; ``last_task_on_rank`` chains
        consecutive calls (sweeps); CPU updates only when ``with_update``."""
        plan, prof = self.plan, self.prof
        uf = split_microbatches(share, plan.microbatch_fwd)
        ub = split_microbatches(share, plan.microbatch_bwd)
        # which forward microbatch holds the last sample of each backward microbatch (re-batching)
        fwd_end = np.cumsum(uf)
        src_of_bwd = [int(np.searchsorted(fwd_end, e, side="left")) for e in np.cumsum(ub)]
        rank_of = (lambda t: copy) if copy is not None else (lambda t: t.rank)
        n_ranks = plan.gpus
        y_out: dict[int, list] = {}        # FWD task index -> per microbatch (event receiver waits for, via host)
        stash_out: dict[int, dict] = {}    # BWD pack -> FWD task index -> per forward microbatch d2h event
        dx_out: dict[int, list] = {}       # BWD task index -> per microbatch (event, via host)
        dw_done: dict[int, int] = {}       # BWD task index -> event after which the update may run
        prev_fb = None
        for t in tasks:
            r = rank_of(t)
            a, b = t.pack
            if t.kind == "U":
                if with_update:
                        self._update(t, r, dw_done[t.index - 1], n_ranks if copy is not None else 1, copy)
                continue
            left = last_task_on_rank.get(r)
            u_list = uf if t.kind == "F" else ub
            phase = "FWD" if t.kind == "F" else "BWD"
            nominal = plan.microbatch_fwd if t.kind == "F" else plan.microbatch_bwd
            costs = prof.costs(phase, nominal)
            mem = self.task_memory(plan, prof, t)
            wb = self.weight_bytes(a, b)
            # weights: prefetch once the previous task on this rank computes, else after it ends
            if left is None:
                wdeps, wstart = [], []
            elif self.prefetch:
                wdeps, wstart = [], [left["first_compute"]]
            else:
                wdeps, wstart = [left["end_marker"]], []
            opt = plan.options[t.bwd_index] if t.kind == "B" else None
            w_in = self.h2d(r, "W", t, 0, wb, wdeps, wstart, stream="swap_in_w", alloc=wb)
            k_in = None
            if opt is not None and opt.optimizer == "gpu":
                k_in = self.h2d(r, "K", t, 0, int(prof.optimizer_bytes(a, b)), [w_in], stream="swap_in_w")
            computes, outs, stash_evs = [], [], {}
            task_outputs = []
            for i, u in enumerate(u_list):
                ci = costs if u == nominal else prof.costs(phase, u)
                # -- input of microbatch i
                in_dep = []
                if t.kind == "F":
                    if a == 0:
                        x_in = self.h2d(r, "X", t, i, int(ci.input[0]), self._buffer_deps(computes, i))
                    else:
                        src_ev, via_host = y_out[t.index - 1][i]
                        if via_host:   # the output went to host memory: swap it in
                            x_in = self.h2d(r, "X", t, i, int(ci.input[a]), [src_ev] + self._buffer_deps(computes, i))
                        else:
                            x_in = src_ev
                    in_dep.append(x_in)
                else:
                    bi = t.bwd_index
                    recompute = plan.options[bi].recompute
                    if bi == len(plan.packs_bwd) - 1:     # holds the loss: input is the last forward's output
                        if a == 0:
                            x_in = self.h2d(r, "X", t, i, int(ci.input[0]), self._buffer_deps(computes, i))
                        else:
                            last_f = t.index - 1
                            src_ev, via_host = y_out[last_f][src_of_bwd[i]]
                            if via_host:
                                x_in = self.h2d(r, "X", t, i, int(ci.input[a]), [src_ev] + self._buffer_deps(computes, i))
                            else:
                                x_in = src_ev
                        in_dep.append(x_in)
                    else:
                        nbytes = int(ci.input[a]) if recompute else int(ci.pack_saved(a, b))
                        src = [piece[src_of_bwd[i]] for piece in stash_out[bi].values()]
                        in_dep.append(self.h2d(r, "sX", t, i, nbytes, src + self._buffer_deps(computes, i)))
                        src_ev, via_host = dx_out[prev_fb.index][i]
                        if via_host:
                            in_dep.append(self.h2d(r, "dY", t, i, int(ci.input[b + 1]), [src_ev]))
                        else:
                            in_dep.append(src_ev)
                # -- compute
                if t.kind == "F":
                    dur = float(ci.pack_time(a, b))
                else:
                    dur = float(ci.pack_time(a, b))
                    if not plan.options[t.bwd_index].recompute:
                        dur -= float(prof.costs("FWD", int(np.clip(u, *prof.size_range("FWD")))).pack_time(a, b))
                        dur = max(dur, 0.0)
                cdeps = in_dep + [w_in] + ([computes[-1]] if computes else [])
                comp = self.add(r, "compute", "FWD" if t.kind == "F" else "BWD", t, i, dur, 0, cdeps,
                                alloc=(mem - wb) if i == 0 else 0)
                computes.append(comp)
                # -- outputs of microbatch i
                if t.kind == "F":
                    for bi, lo, hi in self._stash_pieces(a, b):
                        nb = int(ci.input[lo]) if plan.options[bi].recompute else int(ci.pack_saved(lo, hi))
                        ev = self.d2h(r, "sX", t, i, nb, [comp])
                        stash_out.setdefault(bi, {}).setdefault(t.index, []).append(ev)
                        task_outputs.append(ev)
                    nxt = tasks[t.index + 1]
                    nr = rank_of(nxt)
                    rebatch = nxt.kind == "B" and plan.microbatch_fwd != plan.microbatch_bwd
                    if nr == r or rebatch or self._via_host(r, nr):
                        ev = self.d2h(r, "Y", t, i, int(ci.input[b + 1]), [comp])
                        y_out.setdefault(t.index, []).append((ev, True))
                    else:
                        ev, _ = self.transfer(r, nr, "Y", t, i, int(ci.input[b + 1]), [comp])
                        y_out.setdefault(t.index, []).append((ev, False))
                    task_outputs.append(ev)
                elif a > 0:
                    nxt = next((x for x in tasks[t.index + 1:] if x.kind == "B"), None)
                    nr = rank_of(nxt)
                    if nr == r or self._via_host(r, nr):
                        ev = self.d2h(r, "dX", t, i, int(ci.input[a]), [comp])
                        dx_out.setdefault(t.index, []).append((ev, True))
                    else:
                        ev, _ = self.transfer(r, nr, "dX", t, i, int(ci.input[a]), [comp])
                        dx_out.setdefault(t.index, []).append((ev, False))
                    task_outputs.append(ev)
            if t.kind == "B":
                done = self._gradients(t, r, computes[-1], k_in, copy)
                dw_done[t.index] = done
                task_outputs.append(done)
            # the task's memory is released when its last event ends
            end = self.add(r, "free", "free", t, len(u_list) - 1, 0.0, 0, [computes[-1]] + task_outputs)
            self.events[end].free_after = [mem]
            last_task_on_rank[r] = {"first_compute": computes[0], "end_marker": end}
            prev_fb = t

    def _stash_pieces(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """What the forward of [a, b] sends to the host for the backward packs other than the last, as
        (backward pack, first, last layer): a recompute pack's input if it is in [a, b]; a stash pack's
        saved activations of its layers in [a, b] (a pack may span several forward packs)."""
        out = []
        for bi, (qa, qb) in enumerate(self.plan.packs_bwd[:-1]):
            if self.plan.options[bi].recompute:
                if a <= qa <= b:
                    out.append((bi, qa, qa))
            elif qa <= b and qb >= a:
                out.append((bi, max(a, qa), min(b, qb)))
        return out

    def _via_host(self, src_rank: int, dst_rank: int) -> bool:
        return src_rank != dst_rank and self.hw.p2p_bandwidth <= 0

    def _buffer_deps(self, computes: list[int], i: int) -> list[int]:
        """Input double buffering: with prefetch, input i may arrive while i-1 computes (waits for i-2);
        without, it waits for i-1."""
        k = i - 2 if self.prefetch else i - 1
        return [computes[k]] if k >= 0 else []

    def _gradients(self, t: Task, r: int, last_compute: int, k_in, copy) -> int:
        """Weight gradients leave the GPU: all-reduced in vDP, then to the CPU optimizer (or a GPU step)."""
        plan, prof = self.plan, self.prof
        a, b = t.pack
        w = int(prof.param_bytes(a, b))
        n = plan.gpus if copy is not None else 1
        deps = [last_compute]
        if n > 1 and self.hw.p2p_bandwidth > 0:
            ard = self.add(r, "p2p", "ARD", t, 0, 2 * (n - 1) / n * w / self.hw.p2p_bandwidth, w, deps)
            self.collectives.setdefault((self.sweep, t.index), []).append(ard)
            deps = [ard]
            share = w // n
        else:
            share = w          # no GPU link: every replica's gradient goes to the host, the CPU sums
        if plan.options[t.bwd_index].optimizer == "gpu":
            kb = int(prof.optimizer_bytes(a, b))
            step = self.add(r, "compute", "GPU_UPD", t, 0, (3 * w + 2 * kb) / self.hw.gpu_optimizer_bandwidth, 0,
                            deps + [k_in])
            shards = n if n > 1 and self.hw.p2p_bandwidth > 0 else 1   # each replica writes back its 1/n
            out = self.d2h(r, "WK", t, 0, w // shards + kb // shards, [step])
            return out
        return self.d2h(r, "dW", t, 0, share, deps)

    def _update(self, t: Task, r: int, dw_event: int, n_copies: int, copy) -> None:
        prof, plan = self.prof, self.plan
        a, b = t.pack
        if plan.options[t.bwd_index].optimizer == "gpu":
            return
        dur = float(prof.cpu_update_time(a, b)) * self.hw.cpu_optimizer_scale
        if n_copies > 1 and self.hw.p2p_bandwidth > 0:
            dur /= n_copies     # each rank's CPU steps its shard of the all-reduced gradient
        elif n_copies > 1:
            dur += (n_copies - 1) * int(prof.param_bytes(a, b)) / self.hw.host_copy_bandwidth / n_copies
        upd = self.add(r, "cpu", "UPD", t, 0, dur, 0, [dw_event])
        if n_copies > 1 and self.hw.p2p_bandwidth <= 0:
            self.host_sums.setdefault((self.sweep, t.index), []).append((upd, dw_event))

    # -- the event loop -------------------------------------------------------------------------
    def run(self, with_timeline: bool) -> Timeline:
        ev = self.events
        # collectives: every replica's all-reduce starts together (ring all-reduce is a barrier)
        for group in self.collectives.values():
            for e in group:
                ev[e].start_deps = list({*ev[e].start_deps})
                ev[e].deps = list({*ev[e].deps, *(d for g in group for d in ev[g].deps)})
        queues = {k: list(v) for k, v in self.streams.items()}
        heads = {k: 0 for k in queues}
        busy_until = {k: 0.0 for k in queues}
        stream_busy = {k: False for k in queues}
        slots = {_H2D: self.hw.link_slots, _D2H: self.hw.link_slots}
        link_used = {_H2D: 0, _D2H: 0}
        if not self.hw.shared_host_link:
            slots = {(lk, rk): 1 for lk in (_H2D, _D2H) for rk in range(self.plan.gpus)}
            link_used = {k: 0 for k in slots}
        mem_used = defaultdict(int)
        mem_deltas = defaultdict(list)
        done_end = [False] * len(ev)
        started = [False] * len(ev)
        heap: list[tuple[float, int, int]] = []
        t = 0.0
        remaining = len(ev)
        order = sorted(queues)
        stream_of = {}
        for k, q in queues.items():
            for e in q:
                stream_of[e] = k
        seq = 0
        while remaining:
            progressed = True
            while progressed:
                progressed = False
                for k in order:
                    if stream_busy[k] or heads[k] >= len(queues[k]):
                        continue
                    eid = queues[k][heads[k]]
                    e = ev[eid]
                    if not all(done_end[d] for d in e.deps) or not all(started[d] for d in e.start_deps):
                        continue
                    lk = None
                    if e.link is not None:
                        lk = e.link if self.hw.shared_host_link else (e.link, e.rank)
                        if link_used[lk] >= slots[lk]:
                            continue
                    if e.alloc and mem_used[e.rank] + e.alloc > self.cap and mem_used[e.rank] > 0:
                        continue
                    # start it
                    e.start = t
                    e.end = t + e.duration
                    started[eid] = True
                    if lk is not None:
                        link_used[lk] += 1
                    if e.alloc:
                        mem_used[e.rank] += e.alloc
                        mem_deltas[e.rank].append((t, e.alloc))
                    stream_busy[k] = True
                    heads[k] += 1
                    seq += 1
                    heapq.heappush(heap, (e.end, seq, eid))
                    progressed = True
            if not heap:
                stuck = [ev[queues[k][heads[k]]] for k in order if heads[k] < len(queues[k])]
                e = stuck[0]
                raise PlanError(f"simulation deadlocked: {e.kind} of pack {e.pack} microbatch {e.microbatch} on rank "
                                f"{e.rank} ({e.stream}) can never start; the plan's memory or ordering is inconsistent")
            t, _, eid = heapq.heappop(heap)
            finished = [eid]
            while heap and heap[0][0] <= t:
                finished.append(heapq.heappop(heap)[2])
            for f in finished:
                e = ev[f]
                done_end[f] = True
                remaining -= 1
                stream_busy[stream_of[f]] = False
                if e.link is not None:
                    link_used[e.link if self.hw.shared_host_link else (e.link, e.rank)] -= 1
                if e.free_after:
                    for nb in e.free_after:
                        mem_used[e.rank] -= nb
                        mem_deltas[e.rank].append((t, -nb))
        iteration = max(e.end for e in ev)
        ranks = self.plan.gpus
        records = []
        if with_timeline:
            records = [(e.rank, e.stream, e.kind, e.task, e.pack, e.microbatch, e.start, e.end, e.nbytes)
                       for e in ev if e.kind != "free"]
        mem = [row for r in range(ranks) for row in memory_steps(r, mem_deltas.get(r, []))]
        tl = Timeline.from_records(records, iteration, mem, cost_model="default", ranks=ranks)
        tl.meta["events"] = len(ev)
        if not with_timeline:
            tl.meta["peak_memory"] = {r: max((b for _, _, b in memory_steps(r, mem_deltas.get(r, []))), default=0)
                                      for r in range(ranks)}
            tl.meta["bytes"] = {
                "h2d": sum(e.nbytes for e in ev if e.link == _H2D),
                "d2h": sum(e.nbytes for e in ev if e.link == _D2H),
                "p2p": sum(e.nbytes for e in ev if e.stream == "p2p"),
            }
        return tl
