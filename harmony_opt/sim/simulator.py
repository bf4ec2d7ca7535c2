"""Event-driven simulator of a Plan under the project's default cost model.

It is the common judge: every planner's plan (CP-SAT and the baselines) is scored by
it. ``simulate(plan, profile, hardware)`` expands the plan's task graph
(taskgraph.compose: Harmony's tasks, each with its inputs and outputs and the medium
each moves by) into events (see docs/cost_model.md for the exact rules) and plays them:

* per rank the streams ``compute``, ``swap_in_w`` (weights), ``swap_in`` (activations),
  ``swap_out`` and ``p2p``; one ``cpu`` stream per rank for optimizer steps;
* each stream runs its events in order (FIFO), an event starts when its
  dependencies are done; the order is Harmony's rule unless the plan carries its own for the
  ``swap_in``, ``swap_out`` and ``free`` streams (``Plan.transfer_order``, named by
  :meth:`Expansion.key`);
* host->GPU and GPU->host transfers of all GPUs behind a shared switch share the link:
  at most ``hardware.link_slots`` transfers per direction run at once, per server;
* on several servers (``hardware.servers``), GPU<->GPU sends between servers run at
  ``network_bandwidth``, what goes through host memory from one server to another (stashed
  activations, re-batched outputs, updated weights another server's forward reads) is copied
  between the hosts on the sender's ``net`` stream, and vDP's all-reduce is hierarchical
  (``Hardware.allreduce_time``);
* the hardware's execution terms (docs/cost_model.md): a compute event lasts ``compute_scale`` times
  its profiled time plus ``issue_overhead_s`` per instruction the executor issues for it, a swap-in,
  swap-out or GPU-to-GPU send its latency plus bytes / bandwidth, a CPU step its profiled time plus
  ``cpu_optimizer_call_s``; without ``copy_overlap`` (the CPU device) a rank's compute, swap and
  P2P events run one at a time (one "engine" per rank), the ready one first in the task order
  first (the executor runs the rank's program in order), its CPU optimizer steps beside them;
  with ``host_instruction_s`` (a GPU's, as ``calibrate`` fits it from the host's issue times) the
  step lasts at least what the rank's issuing thread spends (:func:`host_floor`);
* a recomputing backward microbatch whose output gradient (dY) comes from another rank is two
  events, as the executor runs it: the recompute (``REC``), which waits for the weights, the
  stashed input and the microbatch before, then the backward (``BWD``), which also waits for dY;
  elsewhere the backward event holds its recompute;
* GPU memory per rank is a resource: a task reserves its weights when their swap-in
  starts and its working set when its first compute starts (the planners' pack memory,
  :mod:`harmony_opt.core.memory`), and frees both when its last event ends; an event that
  does not fit waits. So prefetch (just-in-time) only happens when there is room, and the
  reservations never exceed the cap (``meta["reserved_memory"]``);
* the memory a Timeline reports (``memory``, ``peak_memory()``) is the compiled Program's
  live device bytes in issue order, on the clock of the simulated events doing their work:
  the bytes the executor's guard counts and its trace records
  (:func:`harmony_opt.sim.program_clock.timed_program_memory`). A summary
  (``with_timeline=False``, what the planners call thousands of times) carries the
  reservations only.

Fidelity limits: kernel times are the profile's per-layer times summed over a pack
(no fusion across layers); a transfer runs at full per-direction bandwidth or waits
(no fractional sharing); the input double-buffer of the next microbatch is not counted in memory
(the per-layer peaks already include one input and one output).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
from collections import defaultdict

import pandas as pd

from ..core.errors import PlanError
from ..core.hardware import Hardware
from ..core.kinds import Medium, TaskKind, Tensor
from ..core.plan import Plan, backward_instructions, forward_instructions, in_order, transfer_key
from ..core.profile import Profile
from ..core.units import fmt_bytes
from .taskgraph import SOURCE_TENSOR, Task, TaskNode, compose, placement, stashed_ranges, task_memories, task_memory
from .timeline import Timeline, memory_steps

STREAMS = ("compute", "swap_in_w", "swap_in", "swap_out", "p2p", "cpu", "net")
#: The streams that share a rank's one engine when the hardware does not overlap copies with compute
ENGINE_STREAMS = frozenset(("compute", "swap_in_w", "swap_in", "swap_out", "p2p"))
_H2D, _D2H = "h2d", "d2h"


@dataclasses.dataclass(slots=True)
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
    node: Task | None = None         # the task graph node it belongs to
    peer: Task | None = None         # an activation's swap-out or P2P send: the task it is for
    net: int = 0                     # of its bytes, those that cross the network between servers


#: Harmony's task order and placement for one copy (taskgraph.placement); kept under its old name.
tasks_of = placement


def simulate(plan: Plan, profile: Profile, hardware: Hardware, *, memory_cap: int | None = None,
             prefetch: bool | None = None, with_timeline: bool = True) -> Timeline:
    """Play ``plan`` on ``hardware`` with ``profile``'s costs; return its Timeline.

    Raises PlanError for a plan that does not match the profile or hardware, or whose
    packs do not fit in memory (the simulator never plays an invalid plan).
    """
    plan.check_against(profile, hardware)
    cap = int(memory_cap or plan.memory_cap or hardware.gpu_memory_bytes)
    check_memory(plan, profile, cap)
    sim = Expansion(plan, profile, hardware, cap, plan.prefetch if prefetch is None else prefetch)
    sim.build()
    return sim.run(with_timeline)


def count_events(plan: Plan, profile: Profile, hardware: Hardware) -> int:
    """The events ``simulate`` plays for ``plan``, from its expansion alone (about half the work)."""
    sim = Expansion(plan, profile, hardware, int(plan.memory_cap or hardware.gpu_memory_bytes), plan.prefetch)
    sim.build()
    return len(sim.events)


def check_memory(plan: Plan, profile: Profile, cap: int) -> None:
    """Every task alone must fit: its pack's working set at its microbatch size."""
    need_of = task_memories(plan, profile)
    for t in placement(plan):
        if t.kind == TaskKind.UPD:
            continue
        need = need_of[t.index]
        if need > cap:
            raise PlanError(
                f"plan {'forward' if t.kind == 'F' else 'backward'} pack [{t.pack[0]}, {t.pack[1]}] needs "
                f"{fmt_bytes(need)} ({need} bytes) at microbatch "
                f"{plan.microbatch_fwd if t.kind == 'F' else plan.microbatch_bwd}, more than the cap of "
                f"{fmt_bytes(cap)} ({cap} bytes); split the pack or use a smaller microbatch")


@contextlib.contextmanager
def _gc_paused():
    """Pause Python's cyclic garbage collector: building and playing tens of thousands of events
    allocates no reference cycles, but the collector's passes over them cost as much as the work
    (naive swapping of vgg416: 0.26 s instead of 0.75 s)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def host_floor(events, per_instruction: float) -> float:
    """The issuing thread's least time in the step, the largest over ranks: one thread per rank issues
    every instruction in turn, launching each compute instruction's kernels (where they are short, as
    a GPU's small layers' are, their time is the thread's own) and spending ``per_instruction`` on
    each instruction it issues (copies, the step's work between them). Frees and CPU steps are left
    out (the CPU steps run on a thread of their own); an instruction's fixed cost is counted per
    event, as the fit (``calibrate.host_instruction``) counts it."""
    busy: dict = defaultdict(float)
    count: dict = defaultdict(int)
    for e in events:
        if e.kind == "free" or e.stream == "cpu":
            continue
        count[e.rank] += 1
        if e.stream == "compute":
            busy[e.rank] += e.duration
    return max((busy[r] + count[r] * per_instruction for r in count), default=0.0)


class Expansion:
    """Builds the events of one iteration from the task graph and runs them (one object per simulation)."""

    def __init__(self, plan: Plan, profile: Profile, hw: Hardware, cap: int, prefetch: bool,
                 nodes: list[TaskNode] | None = None):
        self.plan, self.prof, self.hw, self.cap, self.prefetch = plan, profile, hw, cap, prefetch
        self.nodes = nodes          # taskgraph.compose(plan, profile, hw), made by build() if not given
        self.events: list[_Event] = []
        self.streams: dict[tuple[int, str], list[int]] = defaultdict(list)
        self.replicas = plan.gpus if plan.mode == "vDP" else 1
        self.collectives: dict[tuple, list[int]] = {}   # (sweep, BWD task) -> its all-reduce on every replica
        self.sent: dict[tuple, list[int]] = {}          # (producer, consumer, tensor) -> event per microbatch
        self.grads: dict[Task, int] = {}                # BWD task -> event after which its gradient is out
        self.reduced: dict[Task, int] = {}              # BWD task -> its all-reduce (vDP with a GPU link)
        self.labels: dict[tuple, str] = {}              # pack -> "first-last"
        self.spans = hw.servers_used(plan.gpus) > 1     # ranks on several servers
        self.stashed = stashed_ranges(plan)             # forward pack -> layers it runs on the stash path
        self.pieces = forward_instructions(plan.packs_fwd, plan.packs_bwd)   # forward pack -> instructions

    # -- memory rules ------------------------------------------------------------------------
    @staticmethod
    def task_memory(plan: Plan, prof: Profile, t) -> int:
        """Bytes a task holds on its GPU (taskgraph.task_memory)."""
        return task_memory(plan, prof, t.kind, t.pack, t.bwd_index)

    # -- event helpers ---------------------------------------------------------------------------
    def add(self, rank, stream, kind, node, mb, duration, nbytes=0, deps=(), start_deps=(), link=None,
            alloc=0, free_after=None, key=None, peer=None) -> int:
        label = self.labels.get(node.pack)
        if label is None:
            label = self.labels[node.pack] = f"{node.pack[0]}-{node.pack[1]}"
        eid = len(self.events)
        self.events.append(_Event(rank, stream, kind, node.index, label, mb, float(duration), int(nbytes), list(deps),
                                  list(start_deps), link, alloc, free_after, -1.0, -1.0,
                                  node.task if key is None else key, peer))
        self.streams[(rank, stream)].append(eid)
        return eid

    def h2d(self, rank, kind, node, mb, nbytes, deps=(), start_deps=(), stream="swap_in", alloc=0, key=None):
        return self.add(rank, stream, kind, node, mb, nbytes / self.hw.h2d_bandwidth + self.hw.h2d_latency_s, nbytes,
                        deps, start_deps, _H2D, alloc, key=key)

    def d2h(self, rank, kind, node, mb, nbytes, deps=(), key=None, peer=None):
        return self.add(rank, "swap_out", kind, node, mb, nbytes / self.hw.d2h_bandwidth + self.hw.d2h_latency_s,
                        nbytes, deps, (), _D2H, key=key, peer=peer)

    def p2p(self, rank, kind, node, mb, nbytes, deps, peer):
        """Send an activation to another GPU over the GPU link, or the network to another server (on the
        sender's p2p stream)."""
        eid = self.add(rank, "p2p", kind, node, mb,
                       nbytes / self.hw.gpu_bandwidth(rank, peer.rank) + self.hw.p2p_latency_s, nbytes, deps, peer=peer)
        if self.spans and self.hw.server_of(rank) != self.hw.server_of(peer.rank):
            self.events[eid].net = int(nbytes)
        return eid

    def other_server(self, rank: int, peer: Task | None) -> bool:
        return self.spans and peer is not None and self.hw.server_of(rank) != self.hw.server_of(peer.rank)

    def net(self, rank, kind, node, mb, nbytes, deps, peer=None, key=None, seconds=None) -> int:
        """Copy ``nbytes`` from this server's host memory to another's over the network (on the sender's
        net stream); ``seconds``: its time where the network link is shared by several senders."""
        eid = self.add(rank, "net", kind, node, mb, nbytes / self.hw.network_bandwidth if seconds is None else seconds,
                       nbytes, deps, key=key, peer=peer)
        self.events[eid].net = int(nbytes)
        return eid

    # -- expansion --------------------------------------------------------------------------------
    def build(self) -> None:
        with _gc_paused():
            self._build()

    def _build(self) -> None:
        if self.nodes is None:
            self.nodes = compose(self.plan, self.prof, self.hw)
        self.by_key = {n.task: n for n in self.nodes}
        last_on_rank: dict[int, dict] = {}     # the rank's previous F/B task: its first compute and end
        waiting = []                            # (update event, gradient producers not built yet)
        for node in self.nodes:
            if node.kind == TaskKind.UPD:
                if node.device == "cpu":
                    waiting.append(self._update(node))
            else:
                self._task(node, last_on_rank)
        # an update also waits for what the replicas built after it contribute (vDP: their gradient in host
        # memory, or their all-reduce)
        for upd, producers in waiting:
            self.events[upd].deps += [g for g in (self._gradient_ready(*p) for p in producers)
                                      if g not in self.events[upd].deps]
        if self.spans:
            self._weights_across()
        for rank, stream, keys in self.plan.transfer_order or ():
            self._reorder(rank, stream, keys)

    # -- the plan's own transfer order ------------------------------------------------------------
    def key(self, eid: int) -> str:
        """The name of event ``eid`` in ``Plan.transfer_order``: a transfer's tensor, layer and rows
        (plan.transfer_key, as the compiler names the same transfer), a free event's task."""
        e = self.events[eid]
        node = self.by_key[e.node]
        if e.stream == "free":
            return str(e.node)
        a, b = node.pack
        if e.kind in ("Y", "dY"):
            layer = b + 1
        elif e.kind == "sX" and e.stream == "swap_out":     # what it stashes for the backward pack it is for
            layer = next(f.layers[0] for f in node.outputs if f.tensor == Tensor.SX and f.peer == e.peer)
        else:
            layer = a
        sweep = e.node.sweep
        if sweep is not None:       # naive swapping: the sweep's one microbatch, at its place in the share
            return transfer_key(e.kind, layer, sweep * self.plan.microbatch_fwd, node.microbatches[0])
        if e.kind in ("dW", "WK"):  # a whole pack's
            return transfer_key(e.kind, layer, 0, 0)
        sizes = node.microbatches
        return transfer_key(e.kind, layer, sum(sizes[:e.microbatch]), sizes[e.microbatch])

    def _reorder(self, rank: int, stream: str, keys: tuple[str, ...]) -> None:
        """The stream in the plan's order (plan.in_order, as compiler.follow_order issues it)."""
        queue = self.streams.get((rank, stream), [])
        name = {eid: self.key(eid) for eid in queue}
        names = set(name.values())
        where = f"plan field transfer_order: rank {rank} stream {stream}"
        if len(names) != len(queue):            # a bug: two transfers of one stream with one name
            raise PlanError(f"{where}: {len(queue) - len(names)} transfers share a name; this plan's order "
                            f"cannot be carried")
        unknown = [k for k in keys if k not in names]
        if unknown:
            raise PlanError(f"{where} names {unknown[0]}, which this plan does not move there ({len(unknown)} such); "
                            f"the order belongs to another plan: re-plan, or drop transfer_order")
        self.streams[(rank, stream)] = in_order(queue, name.get, keys)

    def _task(self, node: TaskNode, last_on_rank: dict) -> None:
        """The events of a forward or backward task, microbatch by microbatch."""
        plan, prof = self.plan, self.prof
        r, (a, b) = node.rank, node.pack
        fwd = node.kind == TaskKind.FWD
        left = last_on_rank.get(r)
        phase = "FWD" if fwd else "BWD"
        nominal = plan.microbatch_fwd if fwd else plan.microbatch_bwd
        costs = prof.costs(phase, nominal)
        mem = node.memory
        ins: dict[Tensor, list] = defaultdict(list)
        for f in node.inputs:
            ins[f.tensor].append(f)
        wb = sum(f.nbytes[0] for f in ins[Tensor.W] + ins[Tensor.B])
        # weights: prefetch once the previous task on this rank computes, else after it ends
        if left is None:
            wdeps, wstart = [], []
        elif self.prefetch:
            wdeps, wstart = [], [left["first_compute"]]
        else:
            wdeps, wstart = [left["end_marker"]], []
        w_in = self.h2d(r, "W", node, 0, wb, wdeps, wstart, stream="swap_in_w", alloc=wb)
        # optimizer on the GPU: its update runs inside this task; the state comes in with the weights
        upd = next((self.by_key[f.peer] for f in node.outputs
                    if f.tensor == Tensor.DW and f.medium == Medium.PIN), None)
        k_in = None
        if upd is not None:
            kb = sum(f.nbytes[0] for f in upd.inputs if f.tensor == Tensor.K)
            k_in = self.h2d(r, "K", node, 0, kb, [w_in], stream="swap_in_w", key=upd.task)
        x_in, sx_in, dy_in = (ins[Tensor.X] or [None])[0], ins[Tensor.SX], (ins[Tensor.DY] or [None])[0]
        # where each input comes from: the producer's events per microbatch (swap-out or P2P send)
        x_src = None if x_in is None or x_in.medium == Medium.DAT else \
            self.sent[(x_in.peer, node.task, SOURCE_TENSOR[x_in.tensor])]
        sx_src = [(self.sent[(f.peer, node.task, Tensor.SX)], f.needs) for f in sx_in]
        dy_src = None if dy_in is None else self.sent[(dy_in.peer, node.task, Tensor.DX)]
        outs = [(f, f.tensor.value, f.medium, self.sent.setdefault((node.task, f.peer, f.tensor), []))
                for f in node.outputs if f.tensor in (Tensor.SX, Tensor.Y, Tensor.DX)]
        # a gradient kept on the GPU (one microbatch, Plan.keeps_on_gpu): the producer keeps it reserved past
        # its end, the consumer finds it there and frees it with its own working set
        kept_out = sum(f.nbytes[0] for f, _, medium, _ in outs if medium == Medium.PIN)
        kept_in = dy_in.nbytes[0] if dy_in is not None and dy_in.medium == Medium.PIN else 0
        computes, task_outputs = [], []
        recompute = fwd or plan.options[node.bwd_index].recompute
        # the executor's instructions per microbatch: a forward per piece of the pack (forward_instructions);
        # a recompute and a backward, or a backward
        issues = self.pieces[(a, b)] if fwd else backward_instructions(recompute)
        stashed = self.stashed.get((a, b), []) if fwd else []
        scale, issue = self.hw.compute_scale, self.hw.issue_overhead_s
        durations: dict[int, float] = {}
        # a recomputing backward whose dY comes from another rank recomputes while dY is on its way: the
        # executor's recompute waits for the weights and the stashed input, its backward for dY too
        split = not fwd and recompute and dy_in is not None and self.by_key[dy_in.peer].rank != r
        first_compute = None
        recomputes: dict[int, float] = {}      # split: per size, the recompute event's time
        for i, u in enumerate(node.microbatches):
            # -- inputs of microbatch i
            in_dep = []
            if x_in is not None:
                if x_src is None:
                    in_dep.append(self.h2d(r, "X", node, i, x_in.nbytes[i], self._buffer_deps(computes, i)))
                else:
                    in_dep.append(self._receive(node, x_in, x_src, i, self._buffer_deps(computes, i)))
            if sx_in:
                src = [sent[needs[i][-1]] for sent, needs in sx_src]
                in_dep.append(self.h2d(r, "sX", node, i, sum(f.nbytes[i] for f in sx_in),
                                       src + self._buffer_deps(computes, i)))
            alloc = (mem - wb - kept_in) if i == 0 else 0
            after = [w_in] + ([computes[-1]] if computes else [])
            if split:                   # the recompute, before dY's event (the executor's order)
                if u not in recomputes:
                    rec, rest = prof.recompute_split(u, a, b)
                    recomputes[u], durations[u] = float(rec) * scale + issue, float(rest) * scale + issue
                rec_ev = self.add(r, "compute", "REC", node, i, recomputes[u], 0, in_dep + after, alloc=alloc)
                first_compute = rec_ev if first_compute is None else first_compute
                in_dep, after, alloc = [rec_ev], [], 0
            if dy_in is not None:
                in_dep.append(self._receive(node, dy_in, dy_src, i, []))
            # -- compute
            dur = durations.get(u)
            if dur is None:             # (split: set with its recompute above)
                if recompute:
                    ci = costs if u == nominal else prof.costs(phase, u)
                    dur = float(ci.pack_time(a, b))
                    if stashed:         # a forward keeping the graph of the layers a stash pack saves
                        extra = prof.stash_forward_extra(u)
                        dur += float(sum(extra[lo:hi + 1].sum() for lo, hi in stashed))
                    dur = dur * scale + issues * issue
                else:                   # stashed activations: no recompute of the pack's forward
                    dur = float(prof.stashed_backward_time(u, a, b)) * scale + issues * issue
                durations[u] = dur
            comp = self.add(r, "compute", phase, node, i, dur, 0, in_dep + after, alloc=alloc)
            computes.append(comp)
            # -- outputs of microbatch i
            for f, kind, medium, sent in outs:
                if medium == Medium.PIN:
                    sent.append(comp)
                    continue
                if medium == Medium.P2P:
                    ev = self.p2p(r, kind, node, i, f.nbytes[i], [comp], f.peer)
                else:
                    ev = self.d2h(r, kind, node, i, f.nbytes[i], [comp], peer=f.peer)
                    if self.other_server(r, f.peer):      # to the consumer's host, over the network
                        ev = self.net(r, kind, node, i, f.nbytes[i], [ev], peer=f.peer)
                sent.append(ev)
                task_outputs.append(ev)
        if not fwd:
            done = self._gradients(node, r, computes[-1], upd, k_in)
            self.grads[node.task] = done
            task_outputs.append(done)
        # the task's memory is released when its last event ends
        end = self.add(r, "free", "free", node, len(node.microbatches) - 1, 0.0, 0, [computes[-1]] + task_outputs)
        self.events[end].free_after = [mem - kept_out]
        last_on_rank[r] = {"first_compute": computes[0] if first_compute is None else first_compute, "end_marker": end}

    def _receive(self, node: TaskNode, f, sent: list[int], i: int, buffer_deps: list) -> int:
        """The event after which activation input ``f`` (X or dY) of microbatch ``i`` is on this GPU: the
        sender's P2P transfer, the producer's compute (PIN), or a swap-in after the producer's swap-out
        (SWP, MSG); ``sent``: the producer's events for this task, per microbatch."""
        src = sent[f.needs[i][-1]]
        if f.medium in (Medium.P2P, Medium.PIN):
            return src
        return self.h2d(node.rank, f.tensor.value, node, i, f.nbytes[i], [src] + buffer_deps)

    def _buffer_deps(self, computes: list[int], i: int) -> list[int]:
        """Input double buffering: with prefetch, input i may arrive while i-1 computes (waits for i-2);
        without, it waits for i-1."""
        k = i - 2 if self.prefetch else i - 1
        return [computes[k]] if k >= 0 else []

    def _gradients(self, node: TaskNode, r: int, last_compute: int, upd: TaskNode | None, k_in) -> int:
        """Weight gradients leave the GPU: all-reduced in vDP (P2P), then to the CPU optimizer (LOC, or MSG
        for every replica's CPU when there is no GPU link), or stepped on the GPU (PIN to a GPU update)."""
        n = self.replicas
        w = int(self.prof.param_bytes(*node.pack))
        deps = [last_compute]
        if any(f.tensor == Tensor.DW and f.medium == Medium.P2P and f.peer is None for f in node.outputs):
            ard = self.add(r, "p2p", "ARD", node, 0, self.hw.allreduce_time(w, n), w, deps)
            if self.spans:      # this rank's share of what its server sends to the others
                s = self.hw.servers_used(n)
                self.events[ard].net = int(2 * (s - 1) / s * w / min(n, self.hw.gpus_per_server))
            self.collectives.setdefault((node.task.sweep, node.index), []).append(ard)
            self.reduced[node.task] = ard
            deps = [ard]
        if upd is not None:
            kb = sum(f.nbytes[0] for f in upd.inputs if f.tensor == Tensor.K)
            step = self.add(r, "compute", "GPU_UPD", node, 0,
                            self.hw.gpu_step_time(w, kb, self.prof.param_tensor_count(*node.pack))
                            + self.hw.issue_overhead_s, 0,
                            deps + [k_in], key=upd.task)
            return self.d2h(r, "WK", node, 0, sum(f.nbytes[0] for f in upd.outputs), [step], key=upd.task)
        out = next(f for f in node.outputs if f.tensor == Tensor.DW and f.medium in (Medium.LOC, Medium.MSG))
        return self.d2h(r, "dW", node, 0, out.nbytes[0], deps)

    def _update(self, node: TaskNode) -> tuple[int, list[Task]]:
        """The CPU optimizer step; returns it with the gradient producers not built yet."""
        prof, n = self.prof, self.replicas
        a, b = node.pack
        dur = float(prof.cpu_update_time(a, b)) * self.hw.cpu_optimizer_scale
        if self.hw.can_allreduce(n):
            dur /= n     # each rank's CPU steps its shard of the all-reduced gradient
        elif n > 1:
            dur += (n - 1) * int(prof.param_bytes(a, b)) / self.hw.host_copy_bandwidth / n
        dur += self.hw.cpu_optimizer_call_s
        # its gradients: in host memory (LOC, MSG), or all-reduced by another replica (P2P)
        producers = [(f.peer, f.medium == Medium.P2P) for f in node.inputs if f.tensor == Tensor.DW]
        ready = [self._gradient_ready(*p) for p in producers if p[0] in self.grads]
        upd = self.add(node.rank, "cpu", "UPD", node, 0, dur, 0, ready)
        return upd, [p for p in producers if p[0] not in self.grads]

    def _gradient_ready(self, producer: Task, reduced: bool) -> int:
        return self.reduced[producer] if reduced else self.grads[producer]

    def _weights_across(self) -> None:
        """On several servers, updated weights reach the host of every other server whose forward reads
        them (before the next iteration, so within this one): in vPP the layers of an updated pack that a
        forward pack on another server holds; in vDP each rank's updated shard, to every other server
        (the ranks of a server share its network link)."""
        hw, plan, prof = self.hw, self.plan, self.prof
        done = {}       # the update's last event: a CPU step, or the GPU step's weights back in host memory
        for eid, e in enumerate(self.events):
            if e.kind in ("UPD", "WK"):
                done[(e.rank, e.node)] = eid
        if plan.mode == "vDP":
            n, s = plan.gpus, hw.servers_used(plan.gpus)
            p = min(n, hw.gpus_per_server)
            for (r, key), eid in done.items():
                w = int(prof.param_bytes(*key.pack))
                self.net(r, "W", self.by_key[key], 0, (s - 1) * w // n, [eid], key=key,
                         seconds=(s - 1) * w * p / n / hw.network_bandwidth)
            return
        server_of_layer = {}
        for node in self.nodes:
            if node.kind == TaskKind.FWD:
                for layer in range(node.pack[0], node.pack[1] + 1):
                    server_of_layer[layer] = hw.server_of(node.rank)
        for (r, key), eid in done.items():
            a, b = key.pack
            here = hw.server_of(r)
            nbytes = sum(int(prof.param_bytes(l, l)) for l in range(a, b + 1)
                         if server_of_layer.get(l, here) != here)
            if nbytes:
                self.net(r, "W", self.by_key[key], 0, nbytes, [eid], key=key)

    # -- the event loop -------------------------------------------------------------------------
    def _memory(self, tl: Timeline, reserved_rows: list, reserved: dict) -> None:
        """The timeline's memory: the compiled program's live bytes, timed on the simulated events
        (what the executor's guard counts and its trace records); the reservations above where no
        program can run the plan (``meta["memory_model"]`` says which)."""
        from .program_clock import timed_program_memory
        try:
            mem, rows = timed_program_memory(self.plan, self.prof, tl.events, self.cap)
        except PlanError:
            tl.memory = pd.DataFrame.from_records(reserved_rows, columns=["rank", "time", "bytes"])
            tl.meta.update(memory_model="reserved", peak_memory=dict(reserved))
            return
        tl.memory = pd.DataFrame.from_records(rows, columns=["rank", "time", "bytes"])
        tl.meta.update(memory_model="program", peak_memory=dict(enumerate(mem.peaks)))

    def run(self, with_timeline: bool) -> Timeline:
        with _gc_paused():
            return self._run(with_timeline)

    def _run(self, with_timeline: bool) -> Timeline:
        """Play the events. The dispatcher works in rounds: at time ``t`` the events that end at ``t``
        finish, then the streams whose head event is ready are scanned first come, first served (the
        head that has been ready longest first, ties in (rank, stream) order), again and again while
        an event starts, and each head that fits (link slot, memory) starts; then time moves to the
        next end. So a transfer waiting for the shared link is not overtaken by one that became ready
        after it on another GPU, as a fixed GPU order would let happen. A stream starts at most one
        event per round (it is busy until that event's end, even for a zero-length one), and within a
        round the link and memory only fill up, so a head that does not fit stays out for the round.
        The scan is replayed exactly but visits only the streams whose head is ready (kept with
        counters of dependencies not ended or not started): a head made ready by a start in this pass
        is visited later in the pass if it comes after in the scan order, else in the next pass, as
        the dispatcher's repeated scans would. Without ``copy_overlap`` the scan goes in the order of
        the heads' events (each rank's task order) instead: the CPU executor runs a rank's program in
        order, so a microbatch's send is not held behind the next microbatch's compute."""
        ev = self.events
        # collectives: every replica's all-reduce starts together (ring all-reduce is a barrier)
        for group in self.collectives.values():
            for e in group:
                ev[e].start_deps = list({*ev[e].start_deps})
                ev[e].deps = list({*ev[e].deps, *(d for g in group for d in ev[g].deps)})
        # ... and ends on every replica when the last one's ends: what waits for one waits for all (they
        # end together unless a rank runs its events one at a time, Hardware.copy_overlap)
        group_of = {e: group for group in self.collectives.values() for e in group}
        if group_of and not self.hw.copy_overlap:
            for e in ev:
                if any(d in group_of for d in e.deps):
                    e.deps = list(dict.fromkeys([*e.deps, *(m for d in e.deps if d in group_of for m in group_of[d])]))
        n = len(ev)
        keys = sorted(self.streams)                     # the scan order
        queues = [self.streams[k] for k in keys]
        qlen = [len(q) for q in queues]
        pos = [0] * len(keys)                           # index of each stream's head
        busy = [False] * len(keys)
        stream_of = [0] * n
        for si, q in enumerate(queues):
            for e in q:
                stream_of[e] = si
        # resources: link slots per direction and server (per GPU when the link is not shared), memory per rank
        shared = self.hw.shared_host_link
        server_of = self.hw.server_of
        link_ids: dict = {}
        link_of = [-1] * n
        for i, e in enumerate(ev):
            if e.link is not None:
                link_of[i] = link_ids.setdefault((e.link, server_of(e.rank)) if shared else (e.link, e.rank),
                                                 len(link_ids))
        slots = [self.hw.link_slots if shared else 1] * len(link_ids)
        used = [0] * len(link_ids)
        # without copy/compute overlap each rank has one engine its compute, swap and P2P events share
        serial = not self.hw.copy_overlap
        engine_of = [e.rank if serial and e.stream in ENGINE_STREAMS else -1 for e in ev]
        engine_busy = [False] * (max((e.rank for e in ev), default=0) + 1)
        cap = self.cap
        mem_used = defaultdict(int)
        mem_deltas = defaultdict(list)
        # dependency counters and who waits on whom
        wait = [0] * n                  # dependencies not ended + start dependencies not started
        on_end: list = [None] * n
        on_start: list = [None] * n
        for i, e in enumerate(ev):
            for d in e.deps:
                if on_end[d] is None:
                    on_end[d] = []
                on_end[d].append(i)
            for d in e.start_deps:
                if on_start[d] is None:
                    on_start[d] = []
                on_start[d].append(i)
            wait[i] = len(e.deps) + len(e.start_deps)
        ready = {si for si, q in enumerate(queues) if q and wait[q[0]] == 0}   # idle, head ready
        # the scan's key: when each stream's head became ready; on one engine per rank (serial), the head's
        # place in the task order instead, as the CPU executor runs its program in order
        since = [float(q[0]) if serial and q else 0.0 for q in queues]

        def wake(waiters: list[int]) -> list[int]:
            """Count down the waiters' dependencies; the idle streams whose head is now ready."""
            woken = []
            for w in waiters:
                wait[w] -= 1
                if not wait[w]:
                    sw = stream_of[w]
                    if not busy[sw] and queues[sw][pos[sw]] == w:
                        ready.add(sw)
                        since[sw] = float(w) if serial else t
                        woken.append(sw)
            return woken
        finishing: list[tuple[float, int, int]] = []
        t = 0.0
        remaining = n
        seq = 0
        heappush, heappop = heapq.heappush, heapq.heappop
        while remaining:
            # -- start what can start at t, in the dispatcher's scan order
            scan = sorted(ready)            # this pass, in scan order: by (since, stream), the sort is stable
            if len(scan) > 1:
                scan.sort(key=since.__getitem__)
            at = 0
            late: list = []                 # (since, stream) ready during this pass, after its current position
            later: list = []                # streams ready during this pass, before it: the next pass
            while True:
                if late and (at >= len(scan) or late[0] < (since[scan[at]], scan[at])):
                    si = heappop(late)[1]
                elif at < len(scan):
                    si = scan[at]
                    at += 1
                elif later:                 # another pass (all became ready at t: stream order)
                    scan, at, later = sorted(later), 0, []
                    continue
                else:
                    break
                eid = queues[si][pos[si]]
                e = ev[eid]
                lk = link_of[eid]
                if lk >= 0 and used[lk] >= slots[lk]:
                    continue
                if serial and engine_of[eid] >= 0 and engine_busy[engine_of[eid]]:
                    continue
                alloc = e.alloc
                if alloc and mem_used[e.rank] + alloc > cap and mem_used[e.rank] > 0:
                    continue
                e.start = t
                e.end = end = t + e.duration
                if lk >= 0:
                    used[lk] += 1
                if serial and engine_of[eid] >= 0:
                    engine_busy[engine_of[eid]] = True
                if alloc:
                    mem_used[e.rank] += alloc
                    mem_deltas[e.rank].append((t, alloc))
                busy[si] = True
                pos[si] += 1
                ready.discard(si)
                seq += 1
                heappush(finishing, (end, seq, eid))
                if on_start[eid]:
                    cur = (since[si], si)
                    for sw in wake(on_start[eid]):
                        if (since[sw], sw) > cur:
                            heappush(late, (since[sw], sw))
                        else:
                            later.append(sw)
            if not finishing:
                e = next(ev[queues[si][pos[si]]] for si in range(len(keys)) if pos[si] < qlen[si])
                why = ("its transfer_order runs a transfer before what it needs: re-plan, or drop transfer_order"
                       if self.plan.transfer_order else "the plan's memory or ordering is inconsistent")
                raise PlanError(f"simulation deadlocked: {e.kind} of pack {e.pack} microbatch {e.microbatch} on rank "
                                f"{e.rank} ({e.stream}) can never start; {why}")
            # -- finish everything that ends at the next end time
            t, _, eid = heappop(finishing)
            done = [eid]
            while finishing and finishing[0][0] <= t:
                done.append(heappop(finishing)[2])
            remaining -= len(done)
            for f in done:
                e = ev[f]
                si = stream_of[f]
                busy[si] = False
                if link_of[f] >= 0:
                    used[link_of[f]] -= 1
                if serial and engine_of[f] >= 0:
                    engine_busy[engine_of[f]] = False
                if e.free_after:
                    for nb in e.free_after:
                        mem_used[e.rank] -= nb
                        mem_deltas[e.rank].append((t, -nb))
                if on_end[f]:
                    wake(on_end[f])
                if pos[si] < qlen[si] and not wait[queues[si][pos[si]]]:
                    ready.add(si)
                    since[si] = float(queues[si][pos[si]]) if serial else t
        iteration = played = max(e.end for e in ev)
        if self.hw.host_instruction_s:
            iteration = max(iteration, host_floor(ev, self.hw.host_instruction_s))
        ranks = self.plan.gpus
        steps = [memory_steps(r, mem_deltas.get(r, [])) for r in range(ranks)]
        self.reservations = [row for rows in steps for row in rows]     # (rank, time, bytes reserved)
        reserved = {r: max((b for _, _, b in rows), default=0) for r, rows in enumerate(steps)}
        if with_timeline:
            records = [(e.rank, e.stream, e.kind, e.task, e.pack, e.microbatch, e.start, e.end, e.nbytes)
                       for e in ev if e.kind != "free"]
            tl = Timeline.from_records(records, iteration, cost_model="default", ranks=ranks)
            self._memory(tl, self.reservations, reserved)
        else:
            tl = Timeline.summary(iteration, cost_model="default", ranks=ranks)
        tl.meta["reserved_memory"] = reserved
        tl.meta["events"] = len(ev)
        if iteration > played:
            tl.meta["host_bound"] = iteration - played      # seconds the host's issue adds to the events' span
        if self.spans:
            tl.meta["network_bytes"] = sum(e.net for e in ev)
        if not with_timeline:
            moved = {_H2D: 0, _D2H: 0, "p2p": 0}
            for e in ev:
                if e.link is not None:
                    moved[e.link] += e.nbytes
                elif e.stream == "p2p":
                    moved["p2p"] += e.nbytes
            tl.meta["bytes"] = {"h2d": moved[_H2D], "d2h": moved[_D2H], "p2p": moved["p2p"]}
        return tl
