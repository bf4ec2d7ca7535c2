"""Harmony's original scheduler, re-implemented to the letter (the ``harmony`` cost model).

Harmony (VLDB 2022) searches microbatch sizes and layer packs by enumerating a few packing
heuristics and scoring each candidate with an event-driven simulator; its Top-1 estimate
is ``global_endtime``. This module reproduces that search and simulator exactly as
HARMONY_REFERENCE.md sections 1-6 describe them, so the project can compare against
Harmony's own choices and estimates. It follows the reference and does not deviate: the
same candidate sizes, packers (:mod:`harmony_opt.harmony_compat_packing`), enumeration order
and Top-K rule, task graph (order, placement, media and the two vPP patches), event
expansion with and without ``prefetch_offload``, durations, rendezvous, re-batching,
deadlock handling and per-task memory estimate. Its known weaknesses (bandwidth divided by
the number of busy GPUs, prefetch off while scoring, a reported memory that is not what
the packers check, a fixed 40 ms per deletion) are kept on purpose; the project's default
cost model does not share them. Flags not offered: ``--reverse_bwd`` (deprecated),
``--memory_cap_scale`` (pass the scaled cap), ``--no_offload_optim`` (the simulator
requires offload) and the debug flags. Where the original would crash (no size to search,
a re-batching mismatch) this module raises InfeasibleError or PlanError instead.

Usage::

    profile = load_profile("bert_96")
    res = harmony_search(profile, batch=32, gpus=2, mode="vPP", memory_cap=10 * 2**30,
                         rank_fit_normally=True)             # res.best.time: 17.873845 s
    plan = res.best_plan()
    timeline = simulate_harmony(plan, profile)        # timeline.iteration_time == plan's time

Pieces, in pipeline order: :func:`candidate_sizes` and the ``PACKERS`` (search space),
:func:`compose_task_graph` (a networkx DiGraph of FWD/BWD/UPD tasks whose nodes carry their
rank and the medium of every input and output), :func:`expand_events` (the graph as
events on per-rank FIFO streams), :func:`run_events` (begin/end times, or a deadlock) and
:func:`task_memory` (the reported per-task memory).

Implementation notes: numbers are exact where Harmony's are integers (memory, bytes); pack
times are prefix-sum differences, which differ from Harmony's sequential sums only in the
last bits. Identical candidates (same sizes and packs from different methods) are
simulated once, and the dependency graph is resolved in topological order, which gives the
same times as Harmony's round-robin dispatcher (the reference shows that the order does
not matter).
"""
from __future__ import annotations

import dataclasses
import time
from enum import Enum
from typing import Callable, Iterable, NamedTuple, Sequence

import networkx as nx
import numpy as np

from .bundled import load_profile, profile_ident
from .errors import InfeasibleError, PlanError, UsageError
from .harmony_compat_packing import (PACKERS, PACKING_SETS, Packs, candidate_sizes, data_shares,
                                     get_packer, packing_methods, split_microbatches)
from .kinds import Medium, TaskKind, Tensor
from .plan import Plan
from .profile import Profile
from .timeline import Timeline

__all__ = [
    "PACKERS", "PACKING_SETS", "get_packer", "packing_methods", "candidate_sizes",
    "TaskKind", "Medium", "Tensor", "Stream", "EventKind", "Port", "Rebatch", "rebatch",
    "compose_task_graph", "expand_events", "merge_rendezvous", "run_events", "task_memory", "simulate_harmony",
    "HarmonyCandidate", "HarmonySearchResult", "harmony_search",
]

GiB = 2**30
#: The original scheduler's defaults (sched_args.py): host<->GPU swap, GPU<->GPU, CPU message, DEL.
BW_SWAP = 11.5 * GiB
BW_P2P = 8.2 * GiB
BW_MSG = 128 / 8 * GiB
TIME_DEL = 0.040
#: End time of a rank that holds no event (Harmony's "zero").
_EMPTY_RANK_END = 1e-10
_SIM_KEYS = ("bw_swap", "bw_p2p", "bw_msg", "time_del", "prefetch_offload")


class Stream(str, Enum):
    SWAP_IN = "SwapIn"
    P2P_IN = "P2PIn"
    COMPUTE = "Compute"
    P2P_OUT = "P2POut"
    SWAP_OUT = "SwapOut"
    CPU = "CPU"


class EventKind(str, Enum):
    WB = "WB"
    X = "X"
    FWD = "FWD"
    SX = "sX"
    MSG_SX = "MSGsX"
    Y = "Y"
    MSG_Y = "MSGY"
    DEL = "DEL"
    REC = "REC"
    BWD = "BWD"
    DY = "dY"
    DX = "dX"
    ARD = "ARD"
    DWB = "dWB"
    UPDATE = "Update"


class Port(NamedTuple):
    """One input or output of a task: a tensor of layers first..last on a medium.

    ``peer`` is the index of the task on the other end (None for DAT and SHM).
    LOC ports name the BWD task that produced the gradient (or the UPD that consumes it).
    """

    tensor: Tensor
    first: int
    last: int
    medium: Medium
    peer: int | None = None


# =====================================================================================
# Task graph (section 5)
# =====================================================================================

def compose_task_graph(mode: str, gpus: int, batch: int, num_layers: int, u_fwd: int, packs_fwd: Packs,
                       u_bwd: int, packs_bwd: Packs) -> nx.DiGraph:
    """Harmony's task graph for one candidate.

    Nodes are task indices with attributes ``kind`` (TaskKind), ``first``, ``last``,
    ``rank``, ``device`` ("GPU:n" / "CPU:n"), ``copy`` (vDP GPU copy), ``ubatchszs``,
    ``has_data``, ``has_criterion``, ``is_last_fwd``, ``inputs`` and ``outputs`` (tuples of
    :class:`Port`). An edge src -> dst exists for every input of dst that src provides;
    its ``ports`` attribute lists those inputs. ``G.graph`` holds the configuration,
    the per-copy microbatch lists and ``last_fwd_msg``.
    """
    R = num_layers
    vpp = mode == "vPP"
    shares = [batch] if vpp else data_shares(batch, gpus)
    fwd = tuple(tuple(p) for p in packs_fwd)
    bwd = tuple(tuple(p) for p in packs_bwd)
    last_fwd_msg = vpp and gpus > 1 and u_fwd != u_bwd and bool(fwd)
    G = nx.DiGraph(mode=mode, gpus=gpus, batch=batch, num_layers=R, u_fwd=u_fwd, u_bwd=u_bwd,
                   packs_fwd=fwd, packs_bwd=bwd, last_fwd_msg=last_fwd_msg,
                   ubatchszs_fwd=[split_microbatches(s, u_fwd) for s in shares],
                   ubatchszs_bwd=[split_microbatches(s, u_bwd) for s in shares])
    # Order: FWD packs ascending, then from the last BWD pack down, each BWD with its UPD (jit update).
    order = [(TaskKind.FWD, p) for p in fwd]
    for p in reversed(bwd):
        order += [(TaskKind.BWD, p), (TaskKind.UPD, p)]
    nF, per_copy = len(fwd), len(order)
    for n, share in enumerate(shares):
        base = n * per_copy
        ranks = [_rank(k, kind, nF, gpus) if vpp else n for k, (kind, _) in enumerate(order)]
        ub = {TaskKind.FWD: tuple(split_microbatches(share, u_fwd)),
              TaskKind.BWD: tuple(split_microbatches(share, u_bwd)), TaskKind.UPD: ()}
        fwd_of = {l: base + k for k, (kind, (a, b)) in enumerate(order) if kind is TaskKind.FWD
                  for l in range(a, b + 1)}
        bwd_first = {a: base + k for k, (kind, (a, _)) in enumerate(order) if kind is TaskKind.BWD}
        tasks = [_task_ports(k, kind, a, b, base, ranks, R, fwd_of, bwd_first)
                 for k, (kind, (a, b)) in enumerate(order)]
        if vpp:
            _pin_jit_weights(tasks, order, ranks, base, gpus)
            if last_fwd_msg:
                _last_fwd_to_msg(tasks, nF)
        for k, (kind, (a, b)) in enumerate(order):
            ins, outs = tasks[k]
            G.add_node(base + k, kind=kind, first=a, last=b, rank=ranks[k], copy=n,
                       device=f"{'CPU' if kind is TaskKind.UPD else 'GPU'}:{ranks[k]}",
                       ubatchszs=ub[kind], has_data=a == 0, has_criterion=b == R - 1,
                       is_last_fwd=kind is TaskKind.FWD and k == nF - 1,
                       inputs=tuple(ins), outputs=tuple(outs))
        for k in range(per_copy):
            for port in tasks[k][0]:
                if port.peer is not None:
                    if not G.has_edge(port.peer, base + k):
                        G.add_edge(port.peer, base + k, ports=[])
                    G.edges[port.peer, base + k]["ports"].append(port)
    return G


def _rank(k: int, kind: TaskKind, nF: int, gpus: int) -> int:
    """vPP round-robin: FWD i on i mod N; the k-th BWD (and its UPD) on (nF + k) mod N."""
    if kind is TaskKind.FWD:
        return k % gpus
    if kind is TaskKind.BWD:
        return (nF + (k - nF) // 2) % gpus
    return (nF + (k - 1 - nF) // 2) % gpus


def _task_ports(k, kind, a, b, base, ranks, R, fwd_of, bwd_first) -> tuple[list[Port], list[Port]]:
    """Inputs and outputs of task k (5.3): P2P to a task on another rank, else a local swap."""
    idx = base + k

    def near(j):
        return Medium.P2P if ranks[j] != ranks[k] else Medium.SWP

    ins: list[Port] = []
    outs: list[Port] = []
    if kind is TaskKind.FWD:
        ins.append(Port(Tensor.X, a, a, Medium.DAT) if a == 0 else Port(Tensor.X, a, a, near(k - 1), idx - 1))
        ins += [Port(Tensor.W, a, b, Medium.SHM), Port(Tensor.B, a, b, Medium.SHM)]
        outs.append(Port(Tensor.Y, b, b, near(k + 1), idx + 1))
        outs += [Port(Tensor.SX, l, l, Medium.MSG, bwd_first[l]) for l in range(a, b + 1) if l in bwd_first]
    elif kind is TaskKind.BWD:
        if b == R - 1:
            ins.append(Port(Tensor.X, a, a, Medium.DAT) if a == 0 else Port(Tensor.X, a, a, near(k - 1), idx - 1))
            ins.append(Port(Tensor.T, R - 1, R - 1, Medium.DAT))
        else:
            ins.append(Port(Tensor.DY, b, b, near(k - 2), idx - 2))
            ins.append(Port(Tensor.X, a, a, Medium.MSG, fwd_of[a]))
        ins += [Port(Tensor.W, a, b, Medium.SHM), Port(Tensor.B, a, b, Medium.SHM)]
        if a != 0:
            outs.append(Port(Tensor.DX, a, a, near(k + 2), idx + 2))
        outs += [Port(Tensor.DW, a, b, Medium.LOC, idx + 1), Port(Tensor.B, a, b, Medium.SHM)]
    else:
        ins += [Port(Tensor.DW, a, b, Medium.LOC, idx - 1), Port(Tensor.W, a, b, Medium.SHM),
                Port(Tensor.K, a, b, Medium.SHM)]
        outs += [Port(Tensor.W, a, b, Medium.SHM), Port(Tensor.K, a, b, Medium.SHM)]
    return ins, outs


def _pin_jit_weights(tasks, order, ranks, base, gpus) -> None:
    """vPP patch 1: on each GPU, W and B of layers shared by its last FWD and first BWD stay pinned.

    It changes media only; the simulator's estimate does not depend on it.
    """
    for g in range(gpus):
        f = [k for k, (kind, _) in enumerate(order) if kind is TaskKind.FWD and ranks[k] == g]
        w = [k for k, (kind, _) in enumerate(order) if kind is TaskKind.BWD and ranks[k] == g]
        if not f or not w:
            continue
        kf, kb = f[-1], w[0]
        (fa, fb), (ba, bb) = order[kf][1], order[kb][1]
        lo, hi = max(fa, ba), min(fb, bb)
        if lo > hi:
            continue
        ins_f, outs_f = tasks[kf]
        ins_b, _ = tasks[kb]
        for t in (Tensor.W, Tensor.B):
            outs_f.append(Port(t, lo, hi, Medium.PIN, base + kb))
            i = next(j for j, p in enumerate(ins_b) if p.tensor is t)
            pieces = ([Port(t, ba, lo - 1, Medium.SHM)] if lo > ba else []) + \
                [Port(t, lo, hi, Medium.PIN, base + kf)] + \
                ([Port(t, hi + 1, bb, Medium.SHM)] if hi < bb else [])
            ins_b[i:i + 1] = pieces


def _last_fwd_to_msg(tasks, nF) -> None:
    """vPP patch 2: P2P cannot re-batch, so the last FWD's Y goes to the loss BWD through MSG."""
    outs = tasks[nF - 1][1]
    ins = tasks[nF][0]
    for lst, t in ((outs, Tensor.Y), (ins, Tensor.X)):
        i = next(j for j, p in enumerate(lst) if p.tensor is t)
        if lst[i].medium is Medium.P2P:
            lst[i] = lst[i]._replace(medium=Medium.MSG)


def _port(ports: Iterable[Port], tensor: Tensor) -> Port | None:
    return next((p for p in ports if p.tensor is tensor), None)


# =====================================================================================
# Re-batching converter (6.3)
# =====================================================================================

class Rebatch(NamedTuple):
    """How FWD microbatches become BWD microbatches when u_fwd != u_bwd.

    ``targets[i]``: the (BWD index, BWD size) that FWD microbatch i completes;
    ``producer[j]``: the FWD microbatch that completes BWD microbatch j.
    """

    targets: tuple[tuple[tuple[int, int], ...], ...]
    producer: tuple[int, ...]


def rebatch(fwd_sizes: Sequence[int], bwd_sizes: Sequence[int], u_bwd: int) -> Rebatch:
    """Walk the FWD microbatches with a carried residual and cut them into BWD microbatches."""
    if sum(fwd_sizes) != sum(bwd_sizes):
        raise PlanError(f"re-batching needs equal totals, got FWD {sum(fwd_sizes)} and BWD {sum(bwd_sizes)}")
    targets, producer = [], []
    r = 0
    for i, u in enumerate(fwd_sizes):
        c = r + u
        chunks = split_microbatches(c, u_bwd) if c >= u_bwd else [c]
        r = 0
        done = []
        for j, chunk in enumerate(chunks):
            if len(producer) >= len(bwd_sizes):
                raise PlanError(f"re-batching FWD {list(fwd_sizes)} into BWD {list(bwd_sizes)} overruns")
            want = bwd_sizes[len(producer)]
            if chunk == want:
                done.append((len(producer), chunk))
                producer.append(i)
            elif chunk < want and j == len(chunks) - 1:
                r = chunk
            else:
                raise PlanError(f"re-batching FWD {list(fwd_sizes)} into BWD {list(bwd_sizes)}: chunk {chunk} "
                                f"does not match BWD microbatch {len(producer)} of size {want}")
        targets.append(tuple(done))
    if len(producer) != len(bwd_sizes):
        raise PlanError(f"re-batching FWD {list(fwd_sizes)} leaves BWD microbatches unfilled")
    return Rebatch(tuple(targets), tuple(producer))


# =====================================================================================
# Events (6.2 - 6.4)
# =====================================================================================

class Events(NamedTuple):
    """Expanded events as parallel lists (index = event id) plus FIFO queues and rendezvous pairs."""

    key: list          # (task, ui, spi, stream, kind)
    rank: list
    ubs: list          # microbatch size, or None for task-level events
    dur: list
    nbytes: list
    deps: list         # event ids each event waits for (its own side only)
    queues: dict       # (rank, Stream) -> [event id, ...] in FIFO order
    peers: list        # [(event id, peer event id)] rendezvous, one entry per side
    ranks: tuple       # simulated ranks
    n_busy: int        # N': ranks holding tasks


class _Sim:
    """Per-simulation state while expanding events; one instance per candidate."""

    def __init__(self, G: nx.DiGraph, profile: Profile, bw_swap, bw_p2p, bw_msg, time_del, prefetch):
        g = G.graph
        self.G, self.nodes, self.profile = G, G.nodes, profile
        self.vpp = g["mode"] == "vPP" and g["gpus"] > 1
        self.n = len({G.nodes[i]["rank"] for i in G})
        self.swap = bw_swap / self.n
        self.p2p, self.msg, self.time_del, self.pf = bw_p2p, bw_msg / self.n, time_del, prefetch
        self.cvt = (rebatch(g["ubatchszs_fwd"][0], g["ubatchszs_bwd"][0], g["u_bwd"])
                    if g["u_fwd"] != g["u_bwd"] else None)
        self.key, self.rank, self.ubs, self.dur, self.nbytes, self.rawdeps = [], [], [], [], [], []
        self.index: dict[tuple, int] = {}
        self.queues: dict[tuple, list[int]] = {}
        self.peer_keys: list[tuple[int, tuple]] = []
        self._cuts: dict[int, list[int]] = {}
        self._x: dict[int, list[int]] = {}

    # -- helpers ------------------------------------------------------------------------
    def xbytes(self, u: int, layer: int) -> int:
        """X(u, layer), with X(u, R) = 0."""
        x = self._x.get(u)
        if x is None:
            x = self._x[u] = self.profile.input_bytes_at(u).tolist() + [0]
        return x[layer]

    def cuts(self, t: int) -> list[int]:
        """Sub-pack boundaries of FWD task t: its stash layers, the first layer, last + 1."""
        c = self._cuts.get(t)
        if c is None:
            nd = self.nodes[t]
            stash = sorted(p.first for p in nd["outputs"] if p.tensor is Tensor.SX)
            c = ([] if nd["first"] in stash else [nd["first"]]) + stash + [nd["last"] + 1]
            self._cuts[t] = c
        return c

    def last_spi(self, t: int) -> int:
        return len(self.cuts(t)) - 2 if self.nodes[t]["kind"] is TaskKind.FWD else 0

    def add(self, t, ui, spi, stream, kind, ubs, dur, nbytes, deps, enqueue=True) -> int:
        e = len(self.key)
        k = (t, ui, spi, stream, kind)
        self.index[k] = e
        self.key.append(k)
        self.rank.append(self.nodes[t]["rank"])
        self.ubs.append(ubs)
        self.dur.append(dur)
        self.nbytes.append(nbytes)
        self.rawdeps.append(list(deps))
        if enqueue:
            self.enqueue(e)
        return e

    def enqueue(self, e: int) -> None:
        self.queues.setdefault((self.rank[e], self.key[e][3]), []).append(e)

    def compute_key(self, t, ui, kind) -> tuple:
        """Key of task t's compute event ``kind`` for microbatch ui, at its last sub-pack."""
        return (t, ui, self.last_spi(t), Stream.COMPUTE, kind)

    def xfer(self, stream, nbytes) -> float:
        return nbytes / (self.p2p if stream in (Stream.P2P_IN, Stream.P2P_OUT) else self.swap)

    def wb_bytes(self, t) -> int:
        nd = self.nodes[t]
        a, b = nd["first"], nd["last"]
        return int(self.profile.param_bytes(a, b) + self.profile.buffer_bytes(a, b))

    def del_key(self, t) -> tuple:
        return (t, 0, 0, Stream.COMPUTE, EventKind.DEL)

    # -- task expansions ----------------------------------------------------------------
    def in_wb(self, t, left, delay) -> int:
        nb = self.wb_bytes(t)
        if left is None:
            return self.add(t, 0, 0, Stream.SWAP_IN, EventKind.WB, None, nb / self.swap, nb, [])
        if self.pf:
            lk = self.nodes[left]
            dep = self.compute_key(left, len(lk["ubatchszs"]) - 1, EventKind(lk["kind"].harmony))
            return self.add(t, 0, 0, Stream.SWAP_IN, EventKind.WB, None, nb / self.swap, nb, [dep],
                            enqueue=not delay)
        return self.add(t, 0, 0, Stream.SWAP_IN, EventKind.WB, None, nb / self.swap, nb, [self.del_key(left)])

    def prefetch_dep(self, t, i, left, left2) -> list:
        """Double-buffered input: after left's second-to-last compute, left's DEL, or own compute i-2."""
        if i == 0:
            if left is None:
                return []
            n_left = len(self.nodes[left]["ubatchszs"])
            if n_left >= 2:
                return [self.compute_key(left, n_left - 2, EventKind(self.nodes[left]["kind"].harmony))]
            return [self.del_key(left2)] if left2 is not None else []
        if i == 1:
            return [self.del_key(left)] if left is not None else []
        return [self.compute_key(t, i - 2, EventKind(self.nodes[t]["kind"].harmony))]

    def in_x(self, t, i, left, left2, wb, wb_delayed, chain) -> int:
        """Input X of an FWD or loss-BWD task (DAT, P2P rendezvous, MSG or local swap)."""
        nd = self.nodes[t]
        u = nd["ubatchszs"][i]
        port = _port(nd["inputs"], Tensor.X)
        a = nd["first"]
        deps: list = []
        if nd["has_data"]:
            stream = Stream.SWAP_IN
        elif port.medium is Medium.P2P:
            stream = Stream.P2P_IN
        elif port.medium is Medium.MSG:
            stream = Stream.SWAP_IN
            deps.append((port.peer, i, self.last_spi(port.peer), Stream.CPU, EventKind.MSG_Y))
        else:
            stream = Stream.SWAP_IN
            ui = i if (self.cvt is None or nd["kind"] is TaskKind.FWD) else self.cvt.producer[i]
            deps.append((port.peer, ui, self.last_spi(port.peer), Stream.SWAP_OUT, EventKind.Y))
        nb = self.xbytes(u, a)
        if self.pf:
            deps += self.prefetch_dep(t, i, left, left2)
        else:
            deps.append(chain if chain is not None else self.compute_key(t, i - 1, EventKind(nd["kind"].harmony)))
        e = self.add(t, i, 0, stream, EventKind.X, u, self.xfer(stream, nb), nb, deps)
        if stream is Stream.P2P_IN:
            self.peer_keys.append((e, (port.peer, i, self.last_spi(port.peer), Stream.P2P_OUT, EventKind.Y)))
        if self.pf and i == 0 and left is not None and wb_delayed:
            self.enqueue(wb)
        return e

    def fwd_task(self, t, left, left2) -> None:
        nd = self.nodes[t]
        prof = self.profile
        cuts = self.cuts(t)
        stash = {p.first: p.peer for p in nd["outputs"] if p.tensor is Tensor.SX}
        ypt = _port(nd["outputs"], Tensor.Y)
        b, last = nd["last"], len(cuts) - 2
        wb = self.in_wb(t, left, delay=not self.vpp)
        chain = wb
        y = None
        for i, u in enumerate(nd["ubatchszs"]):
            x = self.in_x(t, i, left, left2, wb, not self.vpp, chain)
            ft = prof.costs("FWD", u)
            comp = []
            for k in range(last + 1):
                deps = ([wb, x] if i == 0 else [x]) if k == 0 else []
                if cuts[k] in stash and not self.pf:
                    deps.append((t, i, k, Stream.SWAP_OUT, EventKind.SX))
                comp.append(self.add(t, i, k, Stream.COMPUTE, EventKind.FWD, u,
                                     float(ft.pack_time(cuts[k], cuts[k + 1] - 1)), 0, deps))
            for k in range(last + 1):
                l = cuts[k]
                if l not in stash:
                    continue
                if k == 0:
                    deps = [x]
                    if self.pf:
                        if i > 0:
                            deps.append(self.compute_key(t, i - 1, EventKind.FWD))
                        elif left is not None:
                            deps.append(self.del_key(left))
                else:
                    deps = [comp[k - 1]]
                nb = self.xbytes(u, l)
                sx = self.add(t, i, k, Stream.SWAP_OUT, EventKind.SX, u, nb / self.swap, nb, deps)
                dst_rank = self.nodes[stash[l]]["rank"]
                for ib, ub in self._targets(i, u):
                    m = self.xbytes(ub, l) if dst_rank != nd["rank"] else 0
                    self.add(t, ib, k, Stream.CPU, EventKind.MSG_SX, ub, 2.0 * m / self.msg, m, [sx])
            nb = self.xbytes(u, b + 1)
            if ypt.medium is Medium.P2P:
                y = self.add(t, i, last, Stream.P2P_OUT, EventKind.Y, u, nb / self.p2p, nb, [comp[-1]])
                self.peer_keys.append((y, (ypt.peer, i, 0, Stream.P2P_IN, EventKind.X)))
            else:
                y = self.add(t, i, last, Stream.SWAP_OUT, EventKind.Y, u, nb / self.swap, nb, [comp[-1]])
                if ypt.medium is Medium.MSG:
                    dst_rank = self.nodes[ypt.peer]["rank"]
                    for ib, ub in self._targets(i, u):
                        m = self.xbytes(ub, b + 1) if dst_rank != nd["rank"] else 0
                        self.add(t, ib, last, Stream.CPU, EventKind.MSG_Y, ub, 2.0 * m / self.msg, m, [y])
            chain = comp[-1] if self.vpp else y
        deps = [y] if (not self.vpp and not self.pf) else []
        self.add(t, 0, 0, Stream.COMPUTE, EventKind.DEL, None, self.time_del, 0, deps)

    def _targets(self, i, u):
        return ((i, u),) if self.cvt is None else self.cvt.targets[i]

    def bwd_task(self, t, left, left2) -> None:
        nd = self.nodes[t]
        prof = self.profile
        a, b = nd["first"], nd["last"]
        crit = nd["has_criterion"]
        delay = (not self.vpp) or not crit
        wb = self.in_wb(t, left, delay=delay)
        dxp = _port(nd["outputs"], Tensor.DX)
        dyp = _port(nd["inputs"], Tensor.DY)
        chain = wb
        bwd = dx = None
        for i, u in enumerate(nd["ubatchszs"]):
            if crit:
                xin = self.in_x(t, i, left, left2, wb, not self.vpp, chain)
                dy = None
            else:
                xin = self.in_sx(t, i, left, left2, chain)
                dy = self.in_dy(t, i, left, left2, wb, dyp, after_rec=not self.vpp)
            ft, bt = prof.costs("FWD", u), prof.costs("BWD", u)
            rec_t = float(ft.pack_time(a, b))
            self.add(t, i, 0, Stream.COMPUTE, EventKind.REC, u, rec_t, 0, [wb, xin] if i == 0 else [xin])
            bwd = self.add(t, i, 0, Stream.COMPUTE, EventKind.BWD, u, float(bt.pack_time(a, b)) - rec_t, 0,
                           [dy] if dy is not None else [])
            dx = None
            if dxp is not None:
                nb = self.xbytes(u, a)
                if dxp.medium is Medium.P2P:
                    dx = self.add(t, i, 0, Stream.P2P_OUT, EventKind.DX, u, nb / self.p2p, nb, [bwd])
                    self.peer_keys.append((dx, (dxp.peer, i, 0, Stream.P2P_IN, EventKind.DY)))
                else:
                    dx = self.add(t, i, 0, Stream.SWAP_OUT, EventKind.DX, u, nb / self.swap, nb, [bwd])
            chain = bwd if self.vpp else dx
        ard = None
        nb = self.wb_bytes(t)
        if not self.vpp and self.n > 1:
            deps = [dx] if (not self.pf and dx is not None) else []
            ard = self.add(t, 0, 0, Stream.COMPUTE, EventKind.ARD, None,
                           2.0 * (self.n - 1) / self.n * nb / self.p2p, nb, deps)
        deps = [bwd]
        if ard is not None:
            deps.append(ard)
        elif not self.vpp and not self.pf and dx is not None:
            deps.append(dx)
        dwb = self.add(t, 0, 0, Stream.SWAP_OUT, EventKind.DWB, None, nb / self.swap, nb, deps)
        self.add(t, 0, 0, Stream.COMPUTE, EventKind.DEL, None, self.time_del, 0, [dwb])

    def in_sx(self, t, i, left, left2, chain) -> int:
        """Stashed input of a non-loss BWD, fetched after the FWD's message to the CPU."""
        nd = self.nodes[t]
        u = nd["ubatchszs"][i]
        src = _port(nd["inputs"], Tensor.X).peer
        spi = self.cuts(src).index(nd["first"])
        deps: list = [(src, i, spi, Stream.CPU, EventKind.MSG_SX)]
        if self.pf:
            deps += self.prefetch_dep(t, i, left, left2)
        else:
            deps.append(chain if chain is not None else self.compute_key(t, i - 1, EventKind.BWD))
        nb = self.xbytes(u, nd["first"])
        return self.add(t, i, 0, Stream.SWAP_IN, EventKind.SX, u, nb / self.swap, nb, deps)

    def in_dy(self, t, i, left, left2, wb, port, after_rec) -> int:
        """Incoming gradient; without prefetch it is fetched only after this microbatch's REC."""
        nd = self.nodes[t]
        u = nd["ubatchszs"][i]
        nb = self.xbytes(u, nd["last"] + 1)
        deps: list = []
        if port.medium is Medium.P2P:
            stream = Stream.P2P_IN
        else:
            stream = Stream.SWAP_IN
            deps.append((left, i, 0, Stream.SWAP_OUT, EventKind.DX))
        delayed_wb = False
        if self.pf:
            if i == 0:
                if left is not None:
                    lk = self.nodes[left]
                    if after_rec or (lk["kind"] is TaskKind.BWD and not lk["has_criterion"]):
                        deps.append(self.compute_key(left, len(lk["ubatchszs"]) - 1, EventKind.REC))
                    else:
                        deps += self.prefetch_dep(t, 0, left, left2)
                    delayed_wb = True
            else:
                deps.append((t, i - 1, 0, Stream.COMPUTE, EventKind.REC))
        else:
            deps.append((t, i, 0, Stream.COMPUTE, EventKind.REC))
        e = self.add(t, i, 0, stream, EventKind.DY, u, self.xfer(stream, nb), nb, deps)
        if stream is Stream.P2P_IN:
            self.peer_keys.append((e, (port.peer, i, 0, Stream.P2P_OUT, EventKind.DX)))
        if delayed_wb:
            self.enqueue(wb)
        return e

    def upd_task(self, t, left) -> None:
        nd = self.nodes[t]
        dur = float(self.profile.cpu_update_time(nd["first"], nd["last"]))
        self.add(t, 0, 0, Stream.CPU, EventKind.UPDATE, None, dur, 0,
                 [(left, 0, 0, Stream.SWAP_OUT, EventKind.DWB)])

    # -- assembly -----------------------------------------------------------------------
    def expand(self) -> Events:
        G = self.G
        ranks = tuple(range(G.graph["gpus"])) if self.vpp else (0,)
        by_rank: dict[int, list[int]] = {r: [] for r in ranks}
        for t in sorted(G.nodes):
            r = self.nodes[t]["rank"]
            if r in by_rank:
                by_rank[r].append(t)
        for r in ranks:
            left = left2 = None
            for t in by_rank[r]:
                kind = self.nodes[t]["kind"]
                if kind is TaskKind.FWD:
                    self.fwd_task(t, left, left2)
                elif kind is TaskKind.BWD:
                    self.bwd_task(t, left, left2)
                else:
                    self.upd_task(t, left)
                    continue
                left2, left = left, t
        return self._resolve(ranks)

    def _resolve(self, ranks) -> Events:
        """Turn dependency and peer keys into event ids."""
        index = self.index

        def rid(d):
            if isinstance(d, int):
                return d
            try:
                return index[d]
            except KeyError:
                raise PlanError(f"Harmony event expansion refers to a missing event {_fmt_key(d)}") from None

        deps = [[rid(d) for d in ds] for ds in self.rawdeps]
        pairs = [(e, rid(k)) for e, k in self.peer_keys]
        return Events(self.key, self.rank, self.ubs, self.dur, self.nbytes, deps, self.queues, pairs, ranks, self.n)


def _fmt_key(k) -> str:
    t, ui, spi, stream, kind = k
    return f"{t}.{ui}.{spi}.{getattr(stream, 'value', stream)}.{getattr(kind, 'value', kind)}"


def expand_events(G: nx.DiGraph, profile: Profile, *, bw_swap: float = BW_SWAP, bw_p2p: float = BW_P2P,
                  bw_msg: float = BW_MSG, time_del: float = TIME_DEL, prefetch_offload: bool = False) -> Events:
    """Expand a task graph into events on per-rank FIFO streams (6.3), with durations (6.4).

    vPP with N > 1 expands every rank; otherwise only rank 0 ("single GPU" mode).
    """
    return _Sim(G, profile, bw_swap, bw_p2p, bw_msg, time_del, prefetch_offload).expand()


def merge_rendezvous(deps: Sequence[Sequence[int]], queues: Iterable[Sequence[int]],
                     peers: Iterable[tuple[int, int]]) -> list[list[int]]:
    """Dependencies with each P2P send and receive acting as one transfer (6.3).

    For every (event, peer) entry the event also waits for the peer's dependencies and
    the peer's predecessor in its queue; with both sides listed, the two start together.
    """
    prev = {}
    for q in queues:
        for j in range(1, len(q)):
            prev[q[j]] = q[j - 1]
    merged = [list(ds) for ds in deps]
    for e, p in peers:
        merged[e] += list(deps[p]) + ([prev[p]] if p in prev else [])
    return merged


def run_events(dur: Sequence[float], deps: Sequence[Sequence[int]], queues: Iterable[Sequence[int]],
               peers: Iterable[tuple[int, int]] = ()) -> list[float] | None:
    """Begin times of events, or None on a deadlock (6.5).

    An event begins at the latest end of its dependencies (rendezvous merged, see
    :func:`merge_rendezvous`) and of its predecessor in its FIFO queue. Resolved in
    topological order, which gives the times of Harmony's round-robin dispatcher; events
    left over lie on a cycle, where the dispatcher finds no runnable stream head.
    """
    queues = [list(q) for q in queues]
    n = len(dur)
    preds = merge_rendezvous(deps, queues, peers)
    for q in queues:
        for j in range(1, len(q)):
            preds[q[j]].append(q[j - 1])
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for e, ps in enumerate(preds):
        indeg[e] = len(ps)
        for p in ps:
            succ[p].append(e)
    begin = [0.0] * n
    end = [0.0] * n
    ready = [e for e in range(n) if indeg[e] == 0]
    done = 0
    while ready:
        e = ready.pop()
        ps = preds[e]
        b = max([end[p] for p in ps]) if ps else 0.0
        begin[e] = b
        end[e] = b + dur[e]
        done += 1
        for s in succ[e]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    return begin if done == n else None


# =====================================================================================
# Memory estimate (6.6) and one simulation
# =====================================================================================

def task_memory(G: nx.DiGraph, t: int, profile: Profile) -> int:
    """Harmony's reported memory of task t at its first microbatch (W and B not included).

    FWD: X_in + Cmem_F + Y + stashed X; BWD: 2 X_in + dY + Cmem_B + dX; UPD: 0.
    """
    nd = G.nodes[t]
    if nd["kind"] is TaskKind.UPD:
        return 0
    R = G.graph["num_layers"]
    a, b, u = nd["first"], nd["last"], nd["ubatchszs"][0]
    phase = nd["kind"].harmony
    c = profile.costs(phase, u)
    x = c.input
    xin = int(x[a])
    y = int(x[b + 1]) if b != R - 1 else 0
    cmem = int(c.pack_memory(a, b))
    if nd["kind"] is TaskKind.FWD:
        return xin + cmem + y + sum(int(x[p.first]) for p in nd["outputs"] if p.tensor is Tensor.SX)
    dx = xin if a != 0 else 0
    return 2 * xin + y + cmem + dx


class SimResult(NamedTuple):
    """What Harmony's simulator reports for one candidate."""

    global_endtime: float             # inf on a deadlock
    ranks: tuple[int, ...]            # simulated ranks
    per_rank_end: tuple[float, ...]
    per_rank_memory: tuple[int, ...]
    task_memory: dict[int, int]       # per task of the simulated ranks
    n_busy: int                       # N'
    events: Events | None
    begin: list[float] | None
    n_events: int = 0                 # events played (what the search's work is counted in)


def _simulate(G: nx.DiGraph, profile: Profile, sim: dict, keep_events: bool) -> SimResult:
    ev = _Sim(G, profile, sim["bw_swap"], sim["bw_p2p"], sim["bw_msg"], sim["time_del"],
              sim["prefetch_offload"]).expand()
    begin = run_events(ev.dur, ev.deps, ev.queues.values(), ev.peers)
    ranks = ev.ranks
    if begin is None:
        per_rank = tuple(float("inf") for _ in ranks)
    else:
        ends: dict[int, float] = {}
        for b, d, r in zip(begin, ev.dur, ev.rank):
            if b + d > ends.get(r, -1.0):
                ends[r] = b + d
        per_rank = tuple(ends.get(r, _EMPTY_RANK_END) for r in ranks)
    tmem = {t: task_memory(G, t, profile) for t in G.nodes if G.nodes[t]["rank"] in ranks}
    mem = tuple(max((m for t, m in tmem.items() if G.nodes[t]["rank"] == r), default=0) for r in ranks)
    return SimResult(max(per_rank), ranks, per_rank, mem, tmem, ev.n_busy,
                     ev if keep_events else None, begin if keep_events else None, len(ev.dur))


def _sim_settings(kw: dict) -> dict:
    unknown = set(kw) - set(_SIM_KEYS)
    if unknown:
        raise UsageError(f"unknown simulator option(s) {', '.join(sorted(unknown))}; valid: {', '.join(_SIM_KEYS)}")
    s = {"bw_swap": BW_SWAP, "bw_p2p": BW_P2P, "bw_msg": BW_MSG, "time_del": TIME_DEL, "prefetch_offload": False}
    s.update(kw)
    for k in ("bw_swap", "bw_p2p", "bw_msg"):
        if not s[k] > 0:
            raise UsageError(f"{k} must be a positive bandwidth in bytes/s, got {s[k]!r}")
    if not s["time_del"] >= 0:
        raise UsageError(f"time_del must be >= 0 seconds, got {s['time_del']!r}")
    s["prefetch_offload"] = bool(s["prefetch_offload"])
    return s


def simulate_harmony(plan: Plan, profile, *, bw_swap: float = BW_SWAP, bw_p2p: float = BW_P2P,
                     bw_msg: float = BW_MSG, time_del: float = TIME_DEL, prefetch_offload: bool = False,
                     with_timeline: bool = True) -> Timeline:
    """Score a plan with Harmony's simulator; ``iteration_time`` is Harmony's ``global_endtime``.

    The events table has one row per event: rank, stream (SwapIn, P2PIn, Compute, P2POut,
    SwapOut, CPU), kind (WB, X, FWD, sX, MSGsX, Y, MSGY, DEL, REC, BWD, dY, dX, ARD, dWB,
    Update), task index, pack "first-last" of the task, microbatch index (the BWD index for
    MSG events; -1 for task-level events: WB, DEL, ARD, dWB, Update), start, end and
    bytes moved (a message's bytes are those it copies, 0 on the same rank). The memory
    table is Harmony's per-task estimate (6.6) as a step function: on each rank, at any
    time, the largest estimate among its tasks running then (a task runs from its first
    event's start to its last event's end). ``meta`` holds the per-rank and global memory
    estimates, per-rank end times, N', the simulation mode and a deadlock flag; a deadlock
    gives ``iteration_time = inf``. In single-GPU mode (vDP, or vPP on one GPU) only rank 0
    is simulated. ``with_timeline=False`` skips building the tables.
    """
    profile = load_profile(profile)
    sim = _sim_settings(dict(bw_swap=bw_swap, bw_p2p=bw_p2p, bw_msg=bw_msg, time_del=time_del,
                             prefetch_offload=prefetch_offload))
    plan.check_against(profile)
    if any(not o.recompute or o.optimizer != "cpu" for o in plan.options):
        raise PlanError("Harmony's simulator models recompute with the optimizer on the CPU only; "
                        "this plan stashes activations or steps on the GPU")
    if plan.transfer_order is not None:
        raise PlanError("Harmony's simulator swaps in Harmony's order only; this plan carries its own "
                        "(transfer_order): simulate it with the default cost model")
    G = compose_task_graph(plan.mode, plan.gpus, plan.batch, plan.num_layers, plan.microbatch_fwd,
                           plan.packs_fwd, plan.microbatch_bwd, plan.packs_bwd)
    res = _simulate(G, profile, sim, keep_events=with_timeline)
    ranks = res.ranks
    meta = {
        "per_rank_memory": dict(zip(ranks, res.per_rank_memory)),
        "global_memory": max(res.per_rank_memory),
        "per_rank_end": dict(zip(ranks, res.per_rank_end)),
        "n_busy_gpus": res.n_busy,
        "sim_mode": "vPP" if plan.mode == "vPP" and plan.gpus > 1 else "single-GPU",
        "deadlock": res.global_endtime == float("inf"),
        "events": res.n_events,
        **sim,
    }
    if not with_timeline:
        return Timeline.from_records([], res.global_endtime, cost_model="harmony", ranks=len(ranks), meta=meta)
    records, mem = _timeline_tables(G, res)
    return Timeline.from_records(records, res.global_endtime, mem, cost_model="harmony", ranks=len(ranks),
                                 meta=meta)


_TASK_LEVEL = {EventKind.WB, EventKind.DEL, EventKind.ARD, EventKind.DWB, EventKind.UPDATE}


def _timeline_tables(G: nx.DiGraph, res: SimResult):
    """Event rows and the memory step function (largest estimate among the tasks running)."""
    ev, begin = res.events, res.begin
    if begin is None:
        return [], [(r, 0.0, 0) for r in ev.ranks]
    records = []
    span: dict[int, list[float]] = {}
    for e, (t, ui, _spi, stream, kind) in enumerate(ev.key):
        nd = G.nodes[t]
        start, end = begin[e], begin[e] + ev.dur[e]
        records.append((ev.rank[e], stream.value, kind.value, t, f"{nd['first']}-{nd['last']}",
                        -1 if kind in _TASK_LEVEL else ui, start, end, ev.nbytes[e]))
        s = span.setdefault(t, [start, end])
        s[0], s[1] = min(s[0], start), max(s[1], end)
    mem = []
    for r in ev.ranks:
        tasks = [(s[0], s[1], res.task_memory[t]) for t, s in span.items() if G.nodes[t]["rank"] == r]
        times = sorted({x for a, b, _ in tasks for x in (a, b)} | {0.0})
        mem += [(r, tm, max((m for a, b, m in tasks if a <= tm < b), default=0)) for tm in times]
    return records, mem


# =====================================================================================
# Search (section 4)
# =====================================================================================

class HarmonyCandidate(NamedTuple):
    """One configuration of Harmony's search and its score."""

    u_fwd: int
    packs_fwd: Packs
    u_bwd: int
    packs_bwd: Packs
    method_fwd: str        # "" when the whole model is one BWD pack
    method_bwd: str
    time: float            # simulated (or scored) iteration time; inf on a deadlock
    key: float             # ranking key: time, / 1000 for a one-pack fit unless rank_fit_normally
    memory: int | None     # Harmony's reported memory estimate (None when a custom score is used)


@dataclasses.dataclass(frozen=True)
class HarmonySearchResult:
    """Ranked Top-K candidates of Harmony's search, with what is needed to build a Plan.

    ``search_space`` is the size of the grid the enumeration walks: every (u_bwd, BWD
    method, u_fwd >= u_bwd (any u_fwd with smaller_ufwd), FWD method), valid or not;
    ``configs_evaluated`` counts the valid candidates scored (Harmony's "points").
    """

    candidates: list[HarmonyCandidate]
    configs_evaluated: int
    search_space: int
    search_time_s: float
    profile: dict
    num_layers: int
    batch: int
    gpus: int
    mode: str
    memory_cap: int
    methods: dict
    settings: dict
    events_simulated: int = 0         # by Harmony's simulator (0 when ``score`` judged the candidates)

    @property
    def best(self) -> HarmonyCandidate:
        return self.candidates[0]

    def best_plan(self, rank: int = 0) -> Plan:
        """The ``rank``-th ranked candidate (0 = Top-1) as a Plan of planner "harmony".

        ``prefetch`` keeps the Plan default (True, what Harmony's runtime does); the settings
        the candidate was scored with (prefetch_offload off by default) are in ``stats``.
        """
        if not 0 <= rank < len(self.candidates):
            raise UsageError(f"rank {rank} is out of range; the search kept {len(self.candidates)} candidate(s)")
        c = self.candidates[rank]
        plan = _candidate_plan(c.u_fwd, c.packs_fwd, c.u_bwd, c.packs_bwd, self.batch, self.gpus, self.mode,
                               self.num_layers, self.memory_cap, self.profile)
        return plan.replace(
            simulated_iteration_time_s=c.time, search_time_s=self.search_time_s,
            stats={"configs_evaluated": self.configs_evaluated, "search_space": self.search_space,
                   "method_fwd": c.method_fwd, "method_bwd": c.method_bwd, "rank": rank, "key": c.key,
                   "memory_estimate_bytes": c.memory, "packing_methods": self.methods,
                   "events_simulated": self.events_simulated, **self.settings})


def _candidate_plan(u_fwd, packs_fwd, u_bwd, packs_bwd, batch, gpus, mode, num_layers, memory_cap,
                    profile_info) -> Plan:
    shares = [batch] if mode == "vPP" else data_shares(batch, gpus)
    uneven = any(s % u for s in shares for u in (u_fwd, u_bwd))
    return Plan(planner="harmony", mode=mode, gpus=gpus, batch=batch, microbatch_fwd=u_fwd,
                microbatch_bwd=u_bwd, packs_fwd=packs_fwd, packs_bwd=packs_bwd, num_layers=num_layers,
                allow_uneven=uneven, cost_model="harmony", memory_cap=memory_cap, profile=profile_info)


class _Top:
    """Harmony's Top-K: append until K held, then replace the first worst only if strictly better."""

    def __init__(self, k: int, dedup: bool):
        self.k = k if k > 0 else float("inf")
        self.dedup = dedup
        self.ids: list = []
        self.items: list[HarmonyCandidate] = []
        self.cnt = 0

    def add(self, c: HarmonyCandidate) -> None:
        ident = (c.u_fwd, c.packs_fwd, c.u_bwd, c.packs_bwd) if self.dedup else self.cnt
        if self.cnt < self.k:
            if ident not in self.ids:
                self.ids.append(ident)
                self.items.append(c)
                self.cnt += 1
            return
        keys = [x.key for x in self.items]
        worst = keys.index(max(keys))
        if c.key < keys[worst] and ident not in self.ids:
            del self.ids[worst], self.items[worst]
            self.ids.append(ident)
            self.items.append(c)
            self.cnt += 1

    def ranked(self) -> list[HarmonyCandidate]:
        order = np.argsort([x.key for x in self.items])
        return [self.items[i] for i in order]


def _layer_lists(profile: Profile, phase: str, u: int, n: int):
    """m = M - X, x = X, t of the first n layers at u (1.4)."""
    c = profile.costs(phase, u)
    x = c.input[:n]
    return c.memory[:n] - x, x, c.time[:n]


def harmony_search(profile, batch: int, gpus: int, mode: str, memory_cap,
                   packing_fwd=PACKING_SETS["published"][0], packing_bwd=PACKING_SETS["published"][1],
                   topk: int = 1, rank_fit_normally: bool = False, dedup: bool = False, ubatchsize_step: int = 1,
                   inequal_ubatchsize: bool = False, smaller_ufwd: bool = False,
                   score: Callable[[Plan], float] | None = None,
                   score_many: Callable[[list[Plan]], list[float]] | None = None, **sim_kwargs) -> HarmonySearchResult:
    """Harmony's search (section 4): enumerate sizes x packers, score each, keep the Top-K.

    ``packing_fwd``/``packing_bwd``: method names, a comma list or a set name ("published",
    "defaults"/"all"). ``memory_cap`` in bytes (Harmony's cap times its scale). ``topk=-1``
    keeps every candidate. ``score(plan) -> seconds`` replaces Harmony's simulator (the
    ranking rule stays Harmony's); ``score_many(plans) -> seconds each``, all distinct candidates at
    once (e.g. in other processes). ``sim_kwargs``: bw_swap, bw_p2p, bw_msg, time_del,
    prefetch_offload. Raises InfeasibleError when no candidate is valid.
    """
    t0 = time.perf_counter()
    profile = load_profile(profile)
    sim = _sim_settings(sim_kwargs)
    mode = _check_args(batch, gpus, mode, memory_cap, topk, ubatchsize_step)
    cap = float(memory_cap)
    m_fwd, m_bwd = packing_methods(packing_fwd, "FWD"), packing_methods(packing_bwd, "BWD")
    R = profile.num_layers
    cand_f = candidate_sizes(profile.sizes("FWD"), batch, gpus, mode, ubatchsize_step, inequal_ubatchsize)
    cand_b = candidate_sizes(profile.sizes("BWD"), batch, gpus, mode, ubatchsize_step, inequal_ubatchsize)
    if not cand_f or not cand_b:
        raise InfeasibleError(_no_sizes_message(profile, batch, gpus, mode, cand_f, cand_b, inequal_ubatchsize))
    prof_info = profile_ident(profile)

    candidates: list[tuple] = []
    space = 0
    fwd_cache: dict[tuple, Packs | None] = {}
    for u_bwd in cand_b:
        mb, xb, tb = _layer_lists(profile, "BWD", u_bwd, R)
        ufs = cand_f if smaller_ufwd else cand_f[int(np.searchsorted(cand_f, u_bwd, side="left")):]
        space += len(m_bwd) * len(ufs) * len(m_fwd)
        for mth_b in m_bwd:
            pb = get_packer(mth_b)(mb, xb, tb, cap)
            if pb is None:
                continue
            if len(pb) == 1:
                candidates.append((u_bwd, (), u_bwd, pb, "", mth_b))
                continue
            lf = pb[-2][1] + 1
            for u_fwd in ufs:
                mf, xf, tf = _layer_lists(profile, "FWD", u_fwd, lf)
                for mth_f in m_fwd:
                    if mth_f == "reuse":
                        pf = get_packer(mth_f)(mf, xf, tf, cap, pb[:-1])
                    else:
                        ck = (u_fwd, lf, mth_f)
                        if ck not in fwd_cache:
                            fwd_cache[ck] = get_packer(mth_f)(mf, xf, tf, cap)
                        pf = fwd_cache[ck]
                    if pf is not None:
                        candidates.append((u_fwd, pf, u_bwd, pb, mth_f, mth_b))
    if not candidates:
        raise InfeasibleError(**_infeasible(profile, cand_f, cand_b, cap, m_fwd, m_bwd))

    top = _Top(topk, dedup)
    memo: dict[tuple, tuple[float, int | None]] = {}
    events = 0
    if score is not None or score_many is not None:
        plans = {k: _candidate_plan(*k, batch, gpus, mode, R, int(memory_cap), prof_info)
                 for k in dict.fromkeys(c[:4] for c in candidates)}      # each distinct one, in order
        times = score_many(list(plans.values())) if score_many is not None else map(score, plans.values())
        memo = {k: (float(t), None) for k, t in zip(plans, times)}
    for u_fwd, pf, u_bwd, pb, mth_f, mth_b in candidates:
        ident = (u_fwd, pf, u_bwd, pb)
        if ident not in memo:
            G = compose_task_graph(mode, gpus, batch, R, u_fwd, pf, u_bwd, pb)
            res = _simulate(G, profile, sim, keep_events=False)
            memo[ident] = (res.global_endtime, max(res.per_rank_memory))
            events += res.n_events
        t, mem = memo[ident]
        key = t / 1000.0 if (len(pb) == 1 and not rank_fit_normally) else t
        top.add(HarmonyCandidate(u_fwd, pf, u_bwd, pb, mth_f, mth_b, t, key, mem))
    settings = {**sim, "topk": topk, "rank_fit_normally": rank_fit_normally, "dedup": dedup,
                "ubatchsize_step": ubatchsize_step, "inequal_ubatchsize": inequal_ubatchsize,
                "smaller_ufwd": smaller_ufwd,
                "scored_by": "harmony" if score is None and score_many is None else "custom"}
    return HarmonySearchResult(top.ranked(), len(candidates), space, time.perf_counter() - t0, prof_info, R,
                               batch, gpus, mode, int(memory_cap), {"fwd": list(m_fwd), "bwd": list(m_bwd)},
                               settings, events)


def _check_args(batch, gpus, mode, memory_cap, topk, step) -> str:
    modes = {"vpp": "vPP", "vdp": "vDP"}
    if str(mode).lower() not in modes:
        raise UsageError(f"mode {mode!r} is not vPP or vDP")
    for name, v in (("batch", batch), ("gpus", gpus), ("ubatchsize_step", step)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise UsageError(f"{name} must be a whole number >= 1, got {v!r}")
    if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)) or topk == 0 or topk < -1:
        raise UsageError(f"topk must be >= 1, or -1 to keep every candidate; got {topk!r}")
    if not isinstance(memory_cap, (int, float, np.integer, np.floating)) or not memory_cap > 0:
        raise UsageError(f"memory_cap must be a positive number of bytes, got {memory_cap!r}")
    mode = modes[str(mode).lower()]
    if mode == "vDP" and batch < gpus:
        raise InfeasibleError(f"vDP needs at least one sample per GPU: batch {batch} < {gpus} GPUs; "
                              f"use vPP, fewer GPUs or a larger batch")
    return mode


def _no_sizes_message(profile, batch, gpus, mode, cand_f, cand_b, inequal) -> str:
    dcap = batch if mode == "vPP" else batch // gpus
    phase = "FWD" if not cand_f else "BWD"
    lo, hi = profile.size_range(phase)
    rule = "" if inequal else " that divide every GPU's share of the batch (inequal_ubatchsize allows others)"
    return (f"no {phase} microbatch size to search: {profile.name} is profiled for {phase} sizes {lo}..{hi}, "
            f"and sizes up to {dcap} samples per {'GPU' if mode == 'vDP' else 'iteration'}{rule} are allowed")


def _infeasible(profile, cand_f, cand_b, cap, m_fwd, m_bwd) -> dict:
    """Explain an empty search at the smallest BWD size: the layer that cannot fit, or the methods."""
    u = cand_b[0]
    need = profile.costs("BWD", u).memory
    layer = int(np.argmax(need))
    worst = int(need[layer])
    if worst >= cap:
        msg = (f"{profile.name}: layer {layer} needs {worst} bytes ({worst / GiB:.2f} GiB) for its backward at "
               f"microbatch {u}, the smallest searched size, but the memory cap is {int(cap)} bytes "
               f"({cap / GiB:.2f} GiB); no packing fits")
        return dict(message=msg, layer=layer, microbatch=u, needed_bytes=worst, cap_bytes=int(cap))
    uf = next((f for f in cand_f if f >= u), cand_f[-1])
    needf = profile.costs("FWD", uf).memory
    lf = int(np.argmax(needf))
    msg = (f"{profile.name}: Harmony's packing methods (FWD {', '.join(m_fwd)}; BWD {', '.join(m_bwd)}) found no "
           f"valid packs under the cap of {int(cap)} bytes ({cap / GiB:.2f} GiB) at any microbatch size, although "
           f"the largest layer alone fits (layer {layer}: {worst} bytes for BWD at microbatch {u}; layer {lf}: "
           f"{int(needf[lf])} bytes for FWD at {uf}); add greedy_reverse_addx, which packs whenever every layer fits")
    return dict(message=msg, layer=layer, microbatch=u, needed_bytes=worst, cap_bytes=int(cap))
