"""The task graph of a Plan under the default cost model, composed by Harmony's rules.

Harmony (HARMONY_REFERENCE.md section 5) turns a plan into three kinds of tasks: the
forward of a pack (F), its backward with the recompute (B) and the optimizer step of
its weights (U), in the order and on the GPUs of core/placement.py (the rule the compiler and
Harmony's scheduler follow too): the forward packs ascending, then the backward packs from the
last to the first, each followed by its update, dealt round-robin over the GPUs in vPP; in vDP
every GPU runs the whole list on its share of the minibatch (one *replica* per GPU). With naive
swapping (``input_batch_grouping: false``) each microbatch *sweeps* the whole list.

Each task lists its inputs and outputs as :class:`Flow` s: the tensor (weights W,
buffers B, input activation X, output Y, stashed activations sX, gradients dY/dX/dW,
optimizer state K), the layers it belongs to, its bytes per microbatch, the
:class:`Medium` it moves by and the task at the other end::

    >>> nodes = compose(plan, profile, hardware)      # plain data, in the simulator's order
    >>> g = task_graph(plan, profile, hardware)       # the same as a networkx DiGraph
    >>> [str(t) for t in g]                           # ['F[0-3]@0', 'F[4-7]@1', 'B[8-11]@2', ...]
    >>> link_bytes(g)                                 # {'h2d': ..., 'd2h': ..., 'p2p': ...}

Nodes are :class:`Task` keys (compact form ``F[4-7]@1``; ``F[4-7]#2@1`` in naive-swap
sweep 2) whose attributes are those of :class:`TaskNode`; an edge ``producer -> consumer``
carries the flows between them (``flows``: tensor, medium, bytes on each side, and for
each of the consumer's microbatches the producer's microbatches it needs). The
simulator (simulator.py) expands exactly these tasks and flows into events, so the two
agree by construction on what moves where; tests/test_taskgraph.py and
tests/test_simulator.py check that the simulated timeline respects every edge.

Where this differs from Harmony's composition: targets (T) are not modelled (the
profiles have no target bytes); a pack's updated buffers are not swapped out; with the
optimizer on the GPU the step runs inside its backward's memory reservation; in vDP the
gradients are all-reduced over P2P (``dW`` P2P, a collective with no single peer) and
each CPU steps its replica's 1/N shard, or, without a GPU link, every replica's
gradient goes to the host and each CPU sums them (``dW`` MSG from the other replicas).
"""
from __future__ import annotations

import bisect
import dataclasses
import re
from typing import NamedTuple

import networkx as nx
import numpy as np

from ..core.errors import PlanError
from ..core.hardware import Hardware
from ..core.kinds import Medium, TaskKind, Tensor
from ..core.placement import Placement, placement
from ..core.plan import Plan, data_shares, split_microbatches
from ..core.profile import Profile


#: Media that cross the host link when a GPU task reads (host -> GPU) or writes (GPU -> host) them.
H2D_MEDIA = frozenset({Medium.DAT, Medium.SWP, Medium.MSG, Medium.SHM})
D2H_MEDIA = frozenset({Medium.SWP, Medium.MSG, Medium.SHM, Medium.LOC})
#: The producer-side tensor of each activation input.
SOURCE_TENSOR = {Tensor.X: Tensor.Y, Tensor.DY: Tensor.DX, Tensor.SX: Tensor.SX}

_TASK_RE = re.compile(r"^(?P<kind>[FBU])\[(?P<a>\d+)-(?P<b>\d+)\](?:#(?P<sweep>\d+))?@(?P<rank>\d+)$")


class Task(NamedTuple):
    """A task's identity and the graph's node key: ``F[4-7]@1``, or ``F[4-7]#2@1`` in naive-swap sweep 2."""

    kind: TaskKind
    pack: tuple[int, int]
    rank: int
    sweep: int | None = None     # naive swapping: the microbatch this sweep carries; None with grouping

    def __str__(self) -> str:
        sweep = "" if self.sweep is None else f"#{self.sweep}"
        return f"{self.kind.value}[{self.pack[0]}-{self.pack[1]}]{sweep}@{self.rank}"

    __repr__ = __str__

    @classmethod
    def from_str(cls, s: str) -> "Task":
        m = _TASK_RE.match(s.strip())
        if not m:
            raise ValueError(f"{s!r} is not a task; write KIND[FIRST-LAST]@RANK or KIND[FIRST-LAST]#SWEEP@RANK, "
                             f"e.g. F[4-7]@1")
        sweep = m["sweep"]
        return cls(TaskKind(m["kind"]), (int(m["a"]), int(m["b"])), int(m["rank"]),
                   None if sweep is None else int(sweep))


class Flow(NamedTuple):
    """One input or output of a task."""

    tensor: Tensor
    layers: tuple[int, int]     # the layers whose tensor it is (X: the first layer's input; Y: the last's output)
    medium: Medium
    nbytes: tuple[int, ...]     # per microbatch of the task (one entry for W, B, dW, K)
    peer: Task | None = None    # the task at the other end; None: host memory (DAT, SHM) or the all-reduce
    needs: tuple[tuple[int, ...], ...] = ()   # inputs: per own microbatch, the peer's microbatches it needs

    @property
    def total(self) -> int:
        return sum(self.nbytes)


@dataclasses.dataclass(frozen=True, eq=False)
class TaskNode:
    """A task with everything the simulator needs: where it runs, its microbatches and its flows."""

    task: Task
    index: int                  # position in its copy's order (the Timeline's ``task`` column)
    replica: int                # vDP: the replica (= its GPU); vPP: 0
    bwd_index: int              # index in plan.packs_bwd, -1 for forward tasks
    device: str                 # "gpu" or "cpu" (an update on the CPU)
    microbatches: tuple[int, ...]   # sizes in order; () for updates
    inputs: tuple[Flow, ...]
    outputs: tuple[Flow, ...]
    memory: int                 # bytes it reserves on its GPU (0 for updates)

    @property
    def kind(self) -> TaskKind:
        return self.task.kind

    @property
    def pack(self) -> tuple[int, int]:
        return self.task.pack

    @property
    def rank(self) -> int:
        return self.task.rank

    @property
    def phase(self) -> str | None:
        return {TaskKind.FWD: "FWD", TaskKind.BWD: "BWD"}.get(self.task.kind)

    def attrs(self) -> dict:
        """The node's attributes in the networkx graph."""
        return {"kind": self.kind, "rank": self.rank, "pack": self.pack, "phase": self.phase, "index": self.index,
                "replica": self.replica, "sweep": self.task.sweep, "bwd_index": self.bwd_index,
                "device": self.device, "microbatches": self.microbatches, "inputs": self.inputs,
                "outputs": self.outputs, "memory": self.memory}


def task_memory(plan: Plan, prof: Profile, kind: TaskKind, pack: tuple[int, int], bwd_index: int = -1,
                pieces: list[tuple[int, int, int]] | None = None) -> int:
    """Bytes a forward or backward task holds on its GPU: Harmony's pack compute memory (weights,
    buffers, one microbatch's activations, gradients and workspace) plus what the options add
    (a forward's saved activations of stash packs, a backward's optimizer state on the GPU), the
    allocator's rounding included where the profile counts tensors (``Profile.pad_bytes``).
    ``pieces``: the forward's ``stash_pieces``, if known."""
    a, b = pack
    if kind == TaskKind.FWD:
        c = prof.costs("FWD", plan.microbatch_fwd)
        mem = int(c.pack_memory(a, b))
        # stash packs: activations of one microbatch wait on the GPU for their swap-out
        for bi, lo, hi in stash_pieces(plan, a, b) if pieces is None else pieces:
            if not plan.options[bi].recompute:
                mem += int(c.pack_saved(lo, hi)) + prof.pad_bytes("saved", lo, hi)
        return mem
    c = prof.costs("BWD", plan.microbatch_bwd)
    mem = int(c.pack_memory(a, b))
    if plan.options[bwd_index].optimizer == "gpu":
        mem += int(prof.optimizer_bytes(a, b)) + prof.pad_bytes("optimizer", a, b)
    return mem


def task_memories(plan: Plan, prof: Profile) -> dict[int, int]:
    """``task_memory`` of every forward and backward task of ``placement(plan)``, by index."""
    pieces = _stash_map(plan)[0]
    return {p.index: task_memory(plan, prof, p.kind, p.pack, p.bwd_index, pieces.get(p.pack, []))
            for p in placement(plan) if p.kind != TaskKind.UPD}


def stash_pieces(plan: Plan, a: int, b: int) -> list[tuple[int, int, int]]:
    """What the forward of [a, b] keeps for the backward packs other than the last (which recomputes
    from the last forward's output), as (backward pack, first, last layer): a recompute pack's input if
    its first layer is in [a, b]; a stash pack's saved activations of its layers in [a, b] (such a pack
    may span several forward packs, each keeps its own part)."""
    return _stash_map(plan)[0].get((a, b), [])


def stashed_ranges(plan: Plan) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """Per forward pack, the layer ranges whose graph it keeps for stash packs (their saved activations):
    the forward of those layers runs on the stash path (Profile.stash_forward_extra)."""
    return {f: [(lo, hi) for bi, lo, hi in pieces if not plan.options[bi].recompute]
            for f, pieces in _stash_map(plan)[0].items()}


def _stash_map(plan: Plan) -> tuple[dict, dict]:
    """``stash_pieces`` of every forward pack (keyed by pack) and, per backward pack, its pieces as
    (forward pack index, first, last layer); O(packs) with binary search over the forward packs."""
    starts = [p[0] for p in plan.packs_fwd]
    by_f: dict[tuple[int, int], list] = {}
    by_b: dict[int, list] = {}
    for bi, (qa, qb) in enumerate(plan.packs_bwd[:-1]):
        first = bisect.bisect_right(starts, qa) - 1
        last = first if plan.options[bi].recompute else bisect.bisect_right(starts, qb) - 1
        for fi in range(first, last + 1):
            a, b = plan.packs_fwd[fi]
            lo, hi = (qa, qa) if plan.options[bi].recompute else (max(a, qa), min(b, qb))
            by_f.setdefault((a, b), []).append((bi, lo, hi))
            by_b.setdefault(bi, []).append((fi, lo, hi))
    return by_f, by_b


def rebatch_needs(fwd: list[int], bwd: list[int]) -> tuple[tuple[int, ...], ...]:
    """For each backward microbatch, the forward microbatches holding its samples (in order)."""
    f_end = np.cumsum(fwd)
    out, start = [], 0
    for size in bwd:
        first = int(np.searchsorted(f_end, start, side="right"))
        last = int(np.searchsorted(f_end, start + size, side="left"))
        out.append(tuple(range(first, last + 1)))
        start += size
    return tuple(out)


# -- composition -------------------------------------------------------------------------------------
def compose(plan: Plan, profile: Profile, hardware: Hardware) -> list[TaskNode]:
    """Every task of one iteration with its flows, in the order the simulator expands them:
    replica by replica (vDP), sweep by sweep (naive swapping), then Harmony's order."""
    return _Composer(plan, profile, hardware).nodes()


class _Composer:
    """Builds the task nodes; what does not depend on the replica or sweep is computed once."""

    def __init__(self, plan: Plan, prof: Profile, hw: Hardware):
        self.plan, self.prof, self.hw = plan, prof, hw
        self.order = placement(plan)
        self.vdp = plan.mode == "vDP"
        self.replicas = plan.gpus if self.vdp else 1
        self.allreduce = self.replicas > 1 and hw.can_allreduce(self.replicas)
        self.host_sum = self.replicas > 1 and not self.allreduce
        self.nf = len(plan.packs_fwd)
        self.pieces_f, self.pieces_b = _stash_map(plan)
        self.memory = task_memories(plan, prof)
        self.bwd_at = {p.bwd_index: p for p in self.order if p.kind == TaskKind.BWD}
        self.costs: dict = {}
        self.statics: dict = {}

    def nodes(self) -> list[TaskNode]:
        plan = self.plan
        shares = data_shares(plan.batch, plan.gpus) if self.vdp else [plan.batch]
        # naive swapping: each replica sweeps once per microbatch of its share (shares may differ)
        self.sweeps_of = [1 if plan.input_batch_grouping else len(split_microbatches(s, plan.microbatch_fwd))
                          for s in shares]
        out: list[TaskNode] = []
        for rep, share in enumerate(shares):
            sweeps = [share] if plan.input_batch_grouping else split_microbatches(share, plan.microbatch_fwd)
            for j, size in enumerate(sweeps):
                self.replica = rep if self.vdp else None
                self.sweep = None if plan.input_batch_grouping else j
                self.last_sweep = None if plan.input_batch_grouping else len(sweeps) - 1
                self.uf = split_microbatches(size, plan.microbatch_fwd)
                self.ub = split_microbatches(size, plan.microbatch_bwd)
                self.needs_b = rebatch_needs(self.uf, self.ub)     # backward microbatch -> forward microbatches
                self.same_f = tuple((i,) for i in range(len(self.uf)))
                self.same_b = tuple((i,) for i in range(len(self.ub)))
                for p in self.order:
                    if p.kind == TaskKind.FWD:
                        out.append(self.forward(p))
                    elif p.kind == TaskKind.BWD:
                        out.append(self.backward(p))
                    elif self.update_exists(p.bwd_index):
                        out.append(self.update(p))
        return out

    # -- helpers
    def rank(self, p: Placement) -> int:
        return self.replica if self.replica is not None else p.rank

    def key(self, p: Placement, sweep=...) -> Task:
        return Task(p.kind, p.pack, self.rank(p), self.sweep if sweep is ... else sweep)

    def c(self, phase: str, u: int):
        k = (phase, u)
        if k not in self.costs:
            self.costs[k] = self.prof.costs(phase, u)
        return self.costs[k]

    def per_mb(self, phase: str, sizes: list[int], f) -> tuple[int, ...]:
        """``f(costs)`` at each microbatch size (most microbatches have the same size: computed once)."""
        seen: dict[int, int] = {}
        out = []
        for u in sizes:
            v = seen.get(u)
            if v is None:
                v = seen[u] = int(f(self.c(phase, u)))
            out.append(v)
        return tuple(out)

    def static(self, a: int, b: int) -> tuple[int, int, int]:
        """Parameter, buffer and optimizer-state bytes of [a, b]."""
        v = self.statics.get((a, b))
        if v is None:
            prof = self.prof
            v = self.statics[(a, b)] = (int(prof.param_bytes(a, b)), int(prof.buffer_bytes(a, b)),
                                        int(prof.optimizer_bytes(a, b)))
        return v

    def medium(self, src: int, dst: int, rebatch: bool = False, sizes=((), ())) -> Medium:
        """An activation between two tasks: on the same GPU, kept there (a gradient between backward
        packs, Plan.keeps_on_gpu of the producer's and consumer's microbatch ``sizes``) or swapped;
        else P2P if there is a GPU link (the network between servers) and the microbatches match, else
        through host memory."""
        if src == dst:
            return Medium.PIN if self.plan.keeps_on_gpu(*sizes) else Medium.SWP
        if rebatch or not (self.hw.p2p_bandwidth > 0 or self.hw.server_of(src) != self.hw.server_of(dst)):
            return Medium.MSG
        return Medium.P2P

    def update_exists(self, bi: int) -> bool:
        """A CPU update runs once per iteration (after the last sweep); a GPU one after every sweep."""
        return self.plan.options[bi].optimizer == "gpu" or self.sweep == self.last_sweep

    def node(self, p: Placement, device: str, sizes, ins, outs) -> TaskNode:
        return TaskNode(self.key(p), p.index, self.replica or 0, p.bwd_index, device, tuple(sizes), tuple(ins),
                        tuple(outs), self.memory.get(p.index, 0))

    def weights(self, a: int, b: int) -> list[Flow]:
        w, buf, _ = self.static(a, b)
        return [Flow(Tensor.W, (a, b), Medium.SHM, (w,)), Flow(Tensor.B, (a, b), Medium.SHM, (buf,))]

    def stash_bytes(self, bi: int, lo: int, hi: int):
        if self.plan.options[bi].recompute:
            return lambda c: c.input[lo]
        return lambda c: c.pack_saved(lo, hi)

    # -- tasks
    def forward(self, p: Placement) -> TaskNode:
        plan, (a, b), r = self.plan, p.pack, self.rank(p)
        ins = self.weights(a, b)
        x = self.per_mb("FWD", self.uf, lambda c: c.input[a])
        if a == 0:
            ins.append(Flow(Tensor.X, (a, a), Medium.DAT, x))
        else:
            prev = self.order[p.index - 1]
            ins.append(Flow(Tensor.X, (a, a), self.medium(self.rank(prev), r), x, self.key(prev), self.same_f))
        outs = [Flow(Tensor.SX, (lo, hi), Medium.MSG, self.per_mb("FWD", self.uf, self.stash_bytes(bi, lo, hi)),
                     self.key(self.bwd_at[bi]))
                for bi, lo, hi in self.pieces_f.get(p.pack, [])]
        nxt = self.order[p.index + 1]
        rebatch = nxt.kind == TaskKind.BWD and plan.microbatch_fwd != plan.microbatch_bwd
        outs.append(Flow(Tensor.Y, (b, b), self.medium(r, self.rank(nxt), rebatch),
                         self.per_mb("FWD", self.uf, lambda c: c.input[b + 1]), self.key(nxt)))
        return self.node(p, "gpu", self.uf, ins, outs)

    def backward(self, p: Placement) -> TaskNode:
        plan, (a, b), r, bi = self.plan, p.pack, self.rank(p), p.bwd_index
        ins = self.weights(a, b)
        ub = self.ub
        if bi == len(plan.packs_bwd) - 1:       # holds the loss: its input is the last forward's output
            x = self.per_mb("BWD", ub, lambda c: c.input[a])
            if a == 0:
                ins.append(Flow(Tensor.X, (a, a), Medium.DAT, x))
            else:
                src = self.order[p.index - 1]
                rebatch = plan.microbatch_fwd != plan.microbatch_bwd
                ins.append(Flow(Tensor.X, (a, a), self.medium(self.rank(src), r, rebatch), x, self.key(src),
                                self.needs_b))
        else:
            ins += [Flow(Tensor.SX, (lo, hi), Medium.MSG, self.per_mb("BWD", ub, self.stash_bytes(bi, lo, hi)),
                         self.key(self.order[fi]), self.needs_b)
                    for fi, lo, hi in self.pieces_b[bi]]
            prev = self.order[p.index - 2]      # the backward before this one (its update lies between)
            ins.append(Flow(Tensor.DY, (b, b), self.medium(self.rank(prev), r, sizes=(ub, ub)),
                            self.per_mb("BWD", ub, lambda c: c.input[b + 1]), self.key(prev), self.same_b))
        outs = []
        if a > 0:
            nxt = self.order[p.index + 2]
            outs.append(Flow(Tensor.DX, (a, a), self.medium(r, self.rank(nxt), sizes=(ub, ub)),
                             self.per_mb("BWD", ub, lambda c: c.input[a]), self.key(nxt)))
        w, n = self.static(a, b)[0], self.replicas
        upd = self.order[p.index + 1]
        if self.allreduce:
            outs.append(Flow(Tensor.DW, (a, b), Medium.P2P, (w,)))      # all-reduce among the replicas
        if plan.options[bi].optimizer == "gpu":
            outs += [Flow(Tensor.DW, (a, b), Medium.PIN, (w,), self.key(upd)),
                     Flow(Tensor.W, (a, b), Medium.PIN, (w,), self.key(upd))]
        elif self.host_sum:     # to host memory, where every replica's CPU reads it
            outs.append(Flow(Tensor.DW, (a, b), Medium.MSG, (w,)))
        else:
            outs.append(Flow(Tensor.DW, (a, b), Medium.LOC, (w // n if self.allreduce else w,),
                             self.key(upd, self.last_sweep)))
        return self.node(p, "gpu", ub, ins, outs)

    def update(self, p: Placement) -> TaskNode:
        plan, (a, b), bi = self.plan, p.pack, p.bwd_index
        src = self.order[p.index - 1]
        (w, _, kb), n = self.static(a, b), self.replicas
        others = [q for q in range(n) if self.replica is not None and q != self.replica]
        shard = n if self.allreduce else 1      # the part of the pack this replica's step updates
        if plan.options[bi].optimizer == "gpu":
            ins = [Flow(Tensor.DW, (a, b), Medium.PIN, (w,), self.key(src))]
            if self.allreduce:      # the replicas that run this sweep too
                ins += [Flow(Tensor.DW, (a, b), Medium.P2P, (w // n,), Task(src.kind, src.pack, q, self.sweep))
                        for q in others if self.sweep is None or self.sweep < self.sweeps_of[q]]
            ins += [Flow(Tensor.W, (a, b), Medium.PIN, (w,), self.key(src)), Flow(Tensor.K, (a, b), Medium.SHM, (kb,))]
            outs = [Flow(Tensor.W, (a, b), Medium.SHM, (w // shard,)), Flow(Tensor.K, (a, b), Medium.SHM, (kb // shard,))]
            return self.node(p, "gpu", (), ins, outs)
        ins = []
        for q in ([self.replica] if self.replica is not None else [None]) + others:
            rank = src.rank if q is None else q
            for s in ([None] if self.sweep is None else range(self.sweeps_of[q or 0])):
                key = Task(src.kind, src.pack, rank, s)
                if self.host_sum:       # every replica's whole gradient, from host memory
                    ins.append(Flow(Tensor.DW, (a, b), Medium.MSG, (w,), key))
                elif q is None or q == self.replica:
                    ins.append(Flow(Tensor.DW, (a, b), Medium.LOC, (w // shard,), key))
                else:       # another replica's part of this replica's shard, all-reduced over P2P
                    ins.append(Flow(Tensor.DW, (a, b), Medium.P2P, (w // n,), key))
        ins += [Flow(Tensor.W, (a, b), Medium.SHM, (w // shard,)), Flow(Tensor.K, (a, b), Medium.SHM, (kb // shard,))]
        outs = [Flow(Tensor.W, (a, b), Medium.SHM, (w // shard,)), Flow(Tensor.K, (a, b), Medium.SHM, (kb // shard,))]
        return self.node(p, "cpu", (), ins, outs)


# -- the graph ---------------------------------------------------------------------------------------
def task_graph(plan: Plan, profile: Profile, hardware: Hardware, nodes: list[TaskNode] | None = None) -> nx.DiGraph:
    """The plan's tasks as a networkx DiGraph (nodes: Task keys; edges: producer -> consumer with
    ``flows``, a list of dicts: tensor and medium, ``layers``, ``bytes_out`` (the producer's bytes per
    microbatch, or its share of a collective), ``bytes_in`` (the consumer's) and ``needs``).
    ``graph.graph["order"]`` lists the nodes in the simulator's order."""
    nodes = compose(plan, profile, hardware) if nodes is None else nodes
    g = nx.DiGraph(mode=plan.mode, gpus=plan.gpus, num_layers=plan.num_layers, order=[n.task for n in nodes])
    for n in nodes:
        g.add_node(n.task, **n.attrs())
    for n in nodes:
        for f in n.inputs:
            if f.peer is None:
                continue
            if f.peer not in g:
                raise PlanError(f"task graph: {n.task} reads {f.tensor.value} from {f.peer}, which is not a task")
            sent = _matching_output(g.nodes[f.peer]["outputs"], f, n.task)
            flow = {"tensor": f.tensor, "medium": f.medium, "layers": f.layers,
                    "bytes_out": sent.nbytes if sent is not None else None, "bytes_in": f.nbytes, "needs": f.needs}
            if g.has_edge(f.peer, n.task):
                g.edges[f.peer, n.task]["flows"].append(flow)
            else:
                g.add_edge(f.peer, n.task, flows=[flow])
    return g


def _matching_output(outputs: tuple[Flow, ...], f: Flow, consumer: Task) -> Flow | None:
    """The producer's output that an input flow receives: same medium, the producer's tensor of the same
    layers sent to this consumer, or (all-reduce) the collective with no peer."""
    want = SOURCE_TENSOR.get(f.tensor, f.tensor)
    for o in outputs:
        if o.tensor == want and o.medium == f.medium and o.peer == consumer and \
                (want is not Tensor.SX or o.layers == f.layers):
            return o
    for o in outputs:
        if o.tensor == want and o.medium == f.medium and o.peer is None:
            return o
    return None


def link_bytes(graph_or_nodes, by_tensor: bool = False) -> dict:
    """Bytes each link carries in one iteration, implied by the flows: ``{"h2d", "d2h", "p2p"}`` (or,
    with ``by_tensor``, keyed by ``(link, tensor, medium)``). A GPU task's input by DAT/SWP/MSG/SHM
    comes host -> GPU, its output by SWP/MSG/SHM/LOC goes GPU -> host, a P2P output crosses the GPU
    link once (the sender counts it); CPU tasks work in host memory and move nothing."""
    if isinstance(graph_or_nodes, nx.DiGraph):
        items = [(d["device"], d["inputs"], d["outputs"]) for _, d in graph_or_nodes.nodes(data=True)]
    else:
        items = [(n.device, n.inputs, n.outputs) for n in graph_or_nodes]
    out: dict = {} if by_tensor else {"h2d": 0, "d2h": 0, "p2p": 0}
    for device, ins, outs in items:
        if device != "gpu":
            continue
        for link, flows, media in (("h2d", ins, H2D_MEDIA), ("d2h", outs, D2H_MEDIA), ("p2p", outs, {Medium.P2P})):
            for f in flows:
                if f.medium in media:
                    k = (link, f.tensor, f.medium) if by_tensor else link
                    out[k] = out.get(k, 0) + f.total
    return out


# -- validation ----------------------------------------------------------------------------------------
def validate(graph: nx.DiGraph) -> dict[str, dict[int, int]]:
    """Check a task graph and return its placement: ``{"FWD": {layer: rank}, "BWD": {...}}`` of the
    first replica's first sweep.

    Checks: acyclic; in every replica's sweep the forward packs cover layers 0.. up to the last
    backward pack's first layer and the backward packs cover every layer, each exactly once, in
    contiguous packs; every backward's update exists; every flow with a peer has a matching output
    at the peer; within a copy every edge goes forward in the order (F before B before U). Raises
    PlanError with the schedule drawn (``format_task_table``) and the failing task marked."""
    R = graph.graph["num_layers"]
    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        _fail(graph, cycle[0][0], "the task graph has a cycle: " + " -> ".join(str(u) for u, _ in cycle))
    copies: dict[tuple, list] = {}
    for t, d in graph.nodes(data=True):
        copies.setdefault((d["replica"], t.sweep), []).append(t)
    result = None
    for key, tasks in sorted(copies.items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else kv[0][1])):
        tasks.sort(key=lambda t: graph.nodes[t]["index"])
        cover = {}
        for kind in (TaskKind.FWD, TaskKind.BWD):
            packs = sorted((t for t in tasks if t.kind == kind), key=lambda t: t.pack)
            expect = 0
            for t in packs:
                a, b = t.pack
                if a != expect or b < a:
                    _fail(graph, t, f"{kind.name} packs do not cover the layers once each in contiguous packs: "
                                    f"{t} starts at layer {a}, expected {expect}")
                expect = b + 1
            end = R if kind == TaskKind.BWD else (min((t.pack[0] for t in tasks if t.kind == TaskKind.BWD
                                                       and t.pack[1] == R - 1), default=0))
            if expect != end:
                last = packs[-1] if packs else tasks[0]
                _fail(graph, last, f"{kind.name} packs end at layer {expect - 1}, expected {end - 1}")
            cover[kind] = {l: t.rank for t in packs for l in range(t.pack[0], t.pack[1] + 1)}
        if result is None:
            result = {"FWD": cover[TaskKind.FWD], "BWD": cover[TaskKind.BWD]}
    for t, d in graph.nodes(data=True):
        if t.kind == TaskKind.BWD:
            ups = [v for v in graph.successors(t) if v.kind == TaskKind.UPD and v.pack == t.pack]
            if not ups:
                _fail(graph, t, f"backward {t} has no update of its weights")
        for f in d["inputs"]:
            if f.peer is None:
                continue
            if _matching_output(graph.nodes[f.peer]["outputs"], f, t) is None:
                _fail(graph, t, f"{t} reads {f.tensor.value} by {f.medium.value} from {f.peer}, which sends no such "
                                f"output")
        for f in d["outputs"]:
            if f.peer is not None and not any(g.tensor == f.tensor or SOURCE_TENSOR.get(g.tensor) == f.tensor
                                              for g in graph.nodes[f.peer]["inputs"] if g.peer == t):
                _fail(graph, t, f"{t} sends {f.tensor.value} to {f.peer}, which does not read it")
    for u, v in graph.edges:
        du, dv = graph.nodes[u], graph.nodes[v]
        if du["replica"] == dv["replica"] and u.sweep == v.sweep and du["index"] >= dv["index"]:
            _fail(graph, v, f"{v} depends on {u}, which comes later in the order")
    return result or {"FWD": {}, "BWD": {}}


def format_task_table(graph: nx.DiGraph, error_task: Task | None = None) -> str:
    """The first replica's first sweep as a step x GPU grid (Harmony's order down, GPUs across); the
    step of ``error_task`` is marked ``<-- ERROR HERE``."""
    first = min(((d["replica"], -1 if t.sweep is None else t.sweep) for t, d in graph.nodes(data=True)), default=None)
    rows: dict[int, dict[int, str]] = {}
    err_row = None
    for t, d in graph.nodes(data=True):
        if (d["replica"], -1 if t.sweep is None else t.sweep) != first:
            continue
        rows.setdefault(d["index"], {})[t.rank] = f"{t.kind.value}[{t.pack[0]}-{t.pack[1]}]"
    if error_task is not None and error_task in graph:
        err_row = graph.nodes[error_task]["index"]
    ranks = sorted({r for row in rows.values() for r in row})
    width = max([len(s) for row in rows.values() for s in row.values()] + [6])
    lines = ["step | " + " | ".join(f"GPU{r}".ljust(width) for r in ranks)]
    for i in sorted(rows):
        line = f"{i:>4} | " + " | ".join(rows[i].get(r, "").ljust(width) for r in ranks)
        lines.append(line + ("  <-- ERROR HERE" if i == err_row else ""))
    return "\n".join(lines)


def _fail(graph: nx.DiGraph, task: Task, message: str):
    raise PlanError(f"{message}\n{format_task_table(graph, task)}")
