"""Harmony's event simulator (HARMONY_REFERENCE.md 5): the task graph as events on per-rank FIFO
streams, their durations and rendezvous, begin and end times (or a deadlock), and the per-task
memory it reports; ``simulate_harmony`` plays a Plan with it."""
from __future__ import annotations

from enum import Enum
from typing import Iterable, NamedTuple, Sequence

import networkx as nx

from ..core.bundled import load_profile
from ..core.errors import PlanError, UsageError
from ..core.kinds import Medium, TaskKind, Tensor
from ..core.plan import Plan
from ..core.profile import Profile
from ..sim.timeline import Timeline
from .graph import _port, compose_task_graph, rebatch


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
