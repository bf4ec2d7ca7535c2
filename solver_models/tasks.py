"""Per-pack task costs for one configuration: what the pipeline model and its evaluator read.

A configuration (mode, GPUs, forward and backward microbatch sizes) fixes everything about
a pack's task except which pack it is, so every candidate pack gets constant costs, computed
with the Profile's prefix sums for all candidates at once. Each candidate is a row of
:class:`TaskTable` (``kind`` F: forward pack, C: the criterion pack ``[s, R-1]`` that holds
the loss, B: any other backward pack), one row per per-pack option variant of a backward pack.

The quantities follow the default simulator's rules (harmony_opt/sim/simulator.py, docs/cost_model.md):

* ``p_first`` / ``p_last``: compute of the task's first / last microbatch; ``load``: of all of them;
  ``p_pen``: of the last but one (timing.py: its chain binds where the last microbatch is smaller);
* ``hop_in``: latency of one microbatch's input handoff from the previous task (P2P between
  GPUs, through host memory on one GPU or when microbatches are re-batched); in vPP, less a
  recomputing backward pack's first recompute, which runs while its dY is on the way (timing.py);
* ``w_load``: bringing the pack's weights (and the optimizer state for a GPU step) in;
* ``mem`` / ``wb``: the bytes the task holds / those reserved when its weights start coming in;
* ``tail``: from the last compute to the moment the task frees its memory (last output
  transfer, all-reduce and gradient swap-out); ``upd``: the CPU optimizer step after that;
* ``h2d`` / ``d2h``: bytes over the host link, for the link's capacity; ``h2d_n`` / ``d2h_n``: how
  many transfers carry them (each pays the hardware's per-transfer latency on the link);
* ``host``: the activation buffers the task adds to host memory, all replicas together
  (harmony_opt/sim/host_memory.py): its output or gradient handed on through host memory, a backward
  pack's stashed input or saved activations, the data for the first task;
* ``issuing``: the host thread's time issuing the task (``simulator.host_floor``): its compute
  events' time plus ``host_instruction_s`` per event it issues (compute, transfers, sends); with that
  term set, the step lasts at least the sum over each rank's tasks (timing.py).

The hardware's execution terms (docs/cost_model.md) are charged as the simulator charges them:
kernel times at ``compute_scale`` (from ``Profile.with_compute_scale``) plus ``issue_overhead_s`` per
compute instruction, a transfer's latency on top of its bytes, ``cpu_optimizer_call_s`` per CPU step,
the all-reduce at ``collective_bandwidth``. Without ``copy_overlap`` a rank runs its transfers one
at a time with its compute, so a task's ``load`` also holds every transfer it makes on its rank (its
weights, inputs, outputs, all-reduce and gradients), a stashed microbatch waits for its saved
activations and then computes (the transfers at their full bandwidth: in vDP the other replicas
compute meanwhile, the link's capacity bounds each phase as with overlap), and ``w_load`` and
``tail`` are 0 (nothing of them overlaps the
rank's other work; a task's memory waits for the one before it cost no more than that rank's
serial work).

In vDP the replicas run in lockstep on one shared host link: their simultaneous transfers take
turns, and since the replicas meet at every backward pack's all-reduce, the one served last sets
the pace: every host transfer takes N times as long as alone, except the way back of an activation's
round trip through host memory, which the last replica makes alone once the others' are done (the
simulator serves the link first come, first served). The link's capacity bounds the sum of all
replicas' bytes (timing.py).

On several servers (Hardware.servers) each server's GPUs share its own host link: N above is the
replicas per server, the capacity that of every server's link together; a pipeline's handoffs run
at the mean of P2P and the network over its boundaries (round-robin crosses a server boundary at
one in every GPUs-per-server), the all-reduce is Hardware.allreduce_time, and the host budget is
every server's together (the simulator checks each server's own, host_memory.py).
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from harmony_opt.core.hardware import Hardware
from harmony_opt.sim.host_memory import may_bind, model_host_memory
from harmony_opt.core.memory import max_pack_end
from harmony_opt.core.plan import backward_instructions, data_shares, split_microbatches
from harmony_opt.core.profile import Profile

F, C, B = 0, 1, 2          # task kinds in TaskTable.kind
TICKS_PER_S = 10_000       # the models' integer time unit: 100 us (small coefficients keep CP-SAT's LP well scaled) ...
FINEST_TICKS_PER_S = 1_000_000  # ... down to 1 us for small models (tick_rate)
#: The least ticks a minibatch's compute spans in a model (tick_rate)
MIN_WORK_TICKS = 20_000
MEM_UNIT = 2**20           # the memory rules count MiB
TIME_COLUMNS = ("p_first", "p_last", "load", "hop_in", "w_load", "tail", "upd")

#: At most this many candidate packs per start boundary (the longest that fit), so models of
#: up to this many layers (or candidate boundaries) are searched without restriction.
MAX_ARCS_PER_START = 128

#: Stash (no-recompute) variants are offered up to this many layers: each couples a
#: backward pack to the forward packs holding its layers (their memory).
MAX_LAYERS_WITH_STASH = 200


@dataclasses.dataclass(frozen=True)
class Config:
    mode: str
    gpus: int
    u_fwd: int
    u_bwd: int

    def __str__(self):
        return f"{self.mode} x{self.gpus} u_fwd={self.u_fwd} u_bwd={self.u_bwd}"

    @classmethod
    def of(cls, plan) -> "Config":
        """The configuration a plan is in."""
        return cls(plan.mode, plan.gpus, plan.microbatch_fwd, plan.microbatch_bwd)

    @property
    def ranks(self) -> int:
        """GPUs one copy of the task chain is dealt over: N in vPP, 1 in vDP (each GPU runs it all)."""
        return self.gpus if self.mode == "vPP" else 1


@dataclasses.dataclass
class TaskTable:
    """Candidate tasks of one configuration: parallel arrays, one row per (pack, option variant)."""

    kind: np.ndarray          # F, C or B
    start: np.ndarray         # first layer
    end: np.ndarray           # last layer (inclusive)
    recompute: np.ndarray     # bool (backward: recompute the forward; False: stashed activations)
    gpu_opt: np.ndarray       # bool (backward: optimizer step on the GPU)
    p_first: np.ndarray       # s
    p_last: np.ndarray        # s
    load: np.ndarray          # s
    hop_in: np.ndarray        # s
    w_load: np.ndarray        # s
    mem: np.ndarray           # bytes
    wb: np.ndarray            # bytes
    tail: np.ndarray          # s
    upd: np.ndarray           # s
    h2d: np.ndarray           # bytes into the GPU (during the task's own phase)
    d2h: np.ndarray           # bytes out of the GPU ...
    d2h_fwd: np.ndarray       # ... of which during the forward phase (a backward pack's stashed input)
    host: np.ndarray          # bytes of activation buffers in host memory (all replicas)
    h2d_n: np.ndarray         # transfers into the GPU (each pays Hardware.h2d_latency_s)
    d2h_n: np.ndarray         # transfers out of the GPU (Hardware.d2h_latency_s)
    issuing: np.ndarray       # s: the host's issuing thread, its compute plus host_instruction_s per event
    p_pen: np.ndarray         # s: compute of the last microbatch but one (0 with one microbatch; timing.py)
    _index: dict | None = dataclasses.field(default=None, repr=False, compare=False)

    def __len__(self):
        return len(self.kind)

    def key(self, k: int) -> tuple:
        """(kind, first, last, recompute, gpu optimizer) of row k: what a plan records of it."""
        return (int(self.kind[k]), int(self.start[k]), int(self.end[k]), bool(self.recompute[k]),
                bool(self.gpu_opt[k]))

    def index(self) -> dict:
        """{key: row} (built once; the keys as ``key`` makes them, from whole columns at once)."""
        if self._index is None:
            keys = zip(self.kind.tolist(), self.start.tolist(), self.end.tolist(),
                       map(bool, self.recompute.tolist()), map(bool, self.gpu_opt.tolist()))
            self._index = {key: k for k, key in enumerate(keys)}
        return self._index

    @staticmethod
    def concat(parts: list["TaskTable"]) -> "TaskTable":
        return TaskTable(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(TaskTable)
                           if f.init and not f.name.startswith("_")))


@dataclasses.dataclass
class Tasks:
    """Everything the pipeline model reads for one configuration."""

    cfg: Config
    table: TaskTable
    num_layers: int
    cap: int
    link_bw: tuple[float, float]       # bytes/s through the shared host link per direction
    link_copies: int                   # copies of the chain that share the host link (vDP: N)
    saved_fwd: np.ndarray | None       # bytes per layer a stashed layer adds to its forward pack
    cuts: np.ndarray                   # boundaries where packs may start/end (all, unless coarsened)
    host_budget: int | None = None     # MiB of host memory left for the tasks' ``host`` (None: cannot bind)
    per_start: int = MAX_ARCS_PER_START   # candidate packs per start boundary (the longest), build_tasks'
    latency: tuple[float, float] = (0.0, 0.0)   # seconds per transfer in and out (Hardware.h2d/d2h_latency_s)
    host_bound: bool = False           # the step lasts at least each rank's ``issuing`` (Hardware.host_instruction_s)
    ticks_per_s: int = TICKS_PER_S     # the models' time unit (tick_rate)
    pen_chain: bool = False            # vPP with a smaller last microbatch: its last but one's chain binds (timing.py)
    _ticks: dict | None = dataclasses.field(default=None, repr=False)

    def ticks(self) -> dict:
        """The integer columns every model reads (built once): times in ticks of 1/ticks_per_s s,
        ``link_in``/``link_out``/``link_out_fwd`` (ticks of all chain copies' transfers on the shared
        link; the last: what leaves during the forward phase), ``backward`` (1 for backward packs), and
        ``mem``/``wb`` with ``cap`` in MiB for the memory rules (rounded up, the cap down, so two
        tasks the models let overlap really fit together), ``host`` in MiB (rounded up, against
        ``host_budget``)."""
        if self._ticks is None:
            t = self.table
            rate = self.ticks_per_s
            d = {f: np.round(getattr(t, f) * rate).astype(np.int64) for f in TIME_COLUMNS}
            lat_in, lat_out = self.latency
            busy_in = self.link_copies * t.h2d / self.link_bw[0]
            busy_out = self.link_copies * t.d2h / self.link_bw[1]
            if lat_in:          # a transfer holds the link for its latency too
                busy_in = busy_in + self.link_copies * t.h2d_n * lat_in
            if lat_out:
                busy_out = busy_out + self.link_copies * t.d2h_n * lat_out
            d["link_in"] = np.round(busy_in * rate).astype(np.int64)
            d["link_out"] = np.round(busy_out * rate).astype(np.int64)
            d["link_out_fwd"] = np.round(self.link_copies * t.d2h_fwd / self.link_bw[1] * rate).astype(np.int64)
            # what timing.forward_queue counts: outputs and checkpoints (a stashed pack's saved activations
            # leave as the forward computes them, during later forward packs too)
            d["link_out_queued"] = np.where((t.kind != B) | t.recompute, d["link_out_fwd"], 0)
            d["backward"] = (t.kind == B).astype(np.int64)
            d["mem"] = np.ceil(t.mem / MEM_UNIT).astype(np.int64)
            d["wb"] = np.ceil(t.wb / MEM_UNIT).astype(np.int64)
            d["cap"] = int(self.cap // MEM_UNIT)
            d["host"] = np.ceil(t.host / MEM_UNIT).astype(np.int64)
            d["issuing"] = np.round(t.issuing * rate).astype(np.int64)
            d["p_pen"] = np.round(t.p_pen * rate).astype(np.int64)
            # rows for timing.evaluate's single gather: times, exact memory (the cap check), mem, wb, link,
            # phase, host, first and last layer, queued traffic out
            d["stacked"] = np.stack([d[f] for f in TIME_COLUMNS] + [np.ceil(t.mem).astype(np.int64), d["mem"], d["wb"],
                                                                    d["link_in"], d["link_out"], d["link_out_fwd"],
                                                                    d["backward"], d["host"],
                                                                    t.start.astype(np.int64), t.end.astype(np.int64),
                                                                    d["link_out_queued"], d["p_pen"]])
            d["cap_exact"] = int(self.cap)
            self._ticks = d
        return self._ticks


def min_packs(tasks: "Tasks", kind: int) -> np.ndarray:
    """Fewest packs of ``kind`` (F or B candidates) covering layers 0..v-1, per boundary v."""
    t, R = tasks.table, tasks.num_layers
    sel = np.flatnonzero(t.kind == kind)
    best = np.full(R + 1, 10**9)
    best[0] = 0
    starts, ends = t.start[sel], t.end[sel] + 1
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    bounds = np.flatnonzero(np.diff(starts)) + 1
    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(starts)]):     # best[start] is final by then
        if lo < hi:
            np.minimum.at(best, ends[lo:hi], best[starts[lo]] + 1)
    return best


def candidate_cuts(profile: Profile, u_bwd: int, max_cuts: int = 129, keep=()) -> np.ndarray:
    """Layer boundaries where packs may start and end: all of them for models of up to
    ``max_cuts - 1`` layers; for longer models the boundaries that split the backward compute
    time into equal parts (a pack is then a run of these blocks), plus the ``keep`` ones."""
    R = profile.num_layers
    if R + 1 <= max_cuts:
        return np.arange(R + 1)
    cum = np.concatenate([[0.0], np.cumsum(profile.costs("BWD", u_bwd).time)])
    targets = np.linspace(0.0, cum[-1], max_cuts)
    cuts = np.searchsorted(cum, targets, side="left")
    return np.unique(np.concatenate([[0, R - 1, R], np.clip(cuts, 0, R), np.asarray(list(keep), int)]))


def enumerate_packs(max_end: np.ndarray, lo: int, hi: int, cuts: np.ndarray,
                    per_start: int = MAX_ARCS_PER_START) -> tuple[np.ndarray, np.ndarray]:
    """All packs [i, j] with i, j + 1 in ``cuts``, lo <= i <= j <= min(max_end[i], hi), the
    ``per_start`` longest per start."""
    is_cut = np.zeros(len(max_end) + 2, bool)
    is_cut[cuts] = True
    starts, ends = [], []
    for i in cuts:
        i = int(i)
        if not lo <= i <= hi:
            continue
        top = min(int(max_end[i]), hi)
        if top < i:
            continue
        js = np.arange(i, top + 1)
        js = js[is_cut[js + 1]][-per_start:]
        starts.append(np.full(len(js), i))
        ends.append(js)
    if not starts:
        return np.zeros(0, int), np.zeros(0, int)
    return np.concatenate(starts), np.concatenate(ends)


def link_rates(hw: Hardware, cfg: Config) -> tuple[int, float, float, float]:
    """(copies, host->GPU and GPU->host bytes/s of one transfer, P2P bytes/s or 0) of ``cfg``'s
    transfers: in vDP the replicas share the host link, each transfer taking ``copies`` times as long
    as alone (the module docstring); P2P only between the GPUs of a pipeline."""
    copies = min(cfg.gpus, hw.gpus_per_server) if cfg.mode == "vDP" and cfg.gpus > 1 and hw.shared_host_link else 1
    return copies, hw.h2d_bandwidth / copies, hw.d2h_bandwidth / copies, pipeline_p2p(hw, cfg.ranks)


def pipeline_p2p(hw: Hardware, ranks: int) -> float:
    """Bytes/s of a pipeline's handoff between GPUs, 0 where it goes through host memory: P2P on one
    server; on several, where the servers' GPUs have P2P or each holds one rank, the rate of the mean
    handoff over the ring's boundaries (``servers`` of the ``ranks`` cross the network)."""
    if ranks < 2:
        return 0.0
    servers = hw.servers_used(ranks)
    if servers == 1:
        return hw.p2p_bandwidth if hw.p2p_bandwidth > 0 else 0.0
    if not (hw.p2p_bandwidth > 0 or hw.gpus_per_server == 1):
        return 0.0
    cross = servers / ranks
    return 1.0 / ((1 - cross) / hw.p2p_bandwidth + cross / hw.network_bandwidth) if cross < 1 else hw.network_bandwidth


def link_capacity(hw: Hardware, gpus: int) -> tuple[float, float]:
    """Host->GPU and GPU->host bytes/s through the host link, all ``gpus`` together: one shared
    link per server, or one link per GPU (``Tasks.link_bw``; the planner's bound counts the same)."""
    links = hw.servers_used(gpus) if hw.shared_host_link else gpus
    return (hw.link_bandwidth or hw.h2d_bandwidth) * links, (hw.link_bandwidth or hw.d2h_bandwidth) * links


def stash_out_exposed(profile: Profile, uf_list: list[int], bw_out: float) -> np.ndarray:
    """Per layer, what the forward compute does not hide of its saved activations leaving the GPU
    over every forward microbatch, at ``bw_out`` bytes/s: what stashing the layer costs its
    backward pack (``build_tasks``) and the stash bound (planner.config_bound)."""
    return np.maximum(sum(profile.costs("FWD", u).saved / bw_out - profile.costs("FWD", u).time for u in uf_list),
                      0.0)


def stashable_layers(profile: Profile, hw: Hardware, cfg: Config, uf_list: list[int], ub_list: list[int]) -> np.ndarray:
    """Per layer, whether a backward pack holding it may stash instead of recompute: in a chain
    every layer; in vPP only where its saved activations leave in the forward and come back in the
    backward in less time than its recompute takes, the pipeline's N GPUs taking turns on a shared
    host link. Elsewhere stash traffic fills the link and the GPUs wait for it in ways the
    model does not time: it rated such vPP plans up to 28 % faster than the simulator plays them
    (benchmarks/results/stash_fidelity.md, docs/planner.md section 5)."""
    R = profile.num_layers
    if cfg.ranks == 1:
        return np.ones(R, bool)
    _, bw_in, bw_out, _ = link_rates(hw, cfg)
    share = min(cfg.ranks, hw.gpus_per_server) if hw.shared_host_link else 1
    # sums over the microbatches, once per distinct size (at most two: split_microbatches)
    uf, ub = collections.Counter(uf_list).items(), collections.Counter(ub_list).items()
    move = share * (sum(k * profile.costs("FWD", u).saved for u, k in uf) / bw_out
                    + sum(k * profile.costs("BWD", u).saved for u, k in ub) / bw_in)
    # what stashing saves: the recompute, less what the stash path's forward costs beyond the plain one
    saves = sum(k * (profile.costs("BWD", u).time - profile.stashed_backward(u)) for u, k in ub) - \
        sum(k * profile.stash_forward_extra(u) for u, k in uf)
    return np.asarray(move[:R] <= saves[:R], bool)


def boundary_hops(profile: Profile, hw: Hardware, cfg: Config, uf_list: list[int], ub_list: list[int],
                  pin_b: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per layer boundary b (0..R-1), the ``hop_in`` of a task whose input crosses it (the module
    docstring): a forward pack starting at b, the criterion pack [b, R-1], a backward pack ending at
    b - 1 (its dY; the task of a stashed pack adds its saved activations' first transfer)."""
    copies, bw_in, bw_out, p2p = link_rates(hw, cfg)
    lat_in, lat_out, lat_p2p = hw.h2d_latency_s, hw.d2h_latency_s, hw.p2p_latency_s
    # a round trip through host memory: the replica served last waits for every replica's way out,
    # but by then the others' ways back are done, so its own way back runs alone
    bw_back = bw_in * copies

    def handoff(x):
        """Latency of moving one microbatch's activation to the next task (on another GPU if p2p)."""
        return x / p2p + lat_p2p if p2p > 0 else x / bw_out + lat_out + x / bw_back + lat_in
    R = profile.num_layers
    b = np.arange(R)
    x_f = profile.costs("FWD", uf_list[0]).input[:R]
    x_b = profile.costs("BWD", ub_list[0]).input[:R]
    y_src = profile.costs("FWD", uf_list[-1]).input[:R]
    rebatch = cfg.u_fwd != cfg.u_bwd
    hf = np.where(b == 0, x_f / bw_in + lat_in, handoff(x_f))
    hc = np.where(b == 0, x_b / bw_in + lat_in,
                  y_src / bw_out + lat_out + x_b / bw_back + lat_in if (rebatch or p2p == 0) else y_src / p2p + lat_p2p)
    hb = np.zeros(R) if pin_b else handoff(x_b)
    return hf, hc, hb


def tick_rate(profile: Profile, batch: int) -> int:
    """Ticks per second of the models of ``profile`` (at its compute scale) at minibatch ``batch``:
    TICKS_PER_S where the minibatch's compute, forward and backward at the smallest profiled size,
    spans at least MIN_WORK_TICKS of them (every bundled profile), else ten or a hundred times finer.
    Each time is rounded to its nearest tick, so a plan's value is off by up to half a tick per
    term: with 100 us ticks a CPU-measured ResNet of 11 layers (a 9 ms step, 90 ticks) was rated
    15 % from its simulated time, and the bounds, computed on the unrounded times, lay up to 3 ticks
    above the rounded value of the plan they bound."""
    work = sum(batch / int(profile.sizes(ph)[0]) * float(profile.costs(ph, int(profile.sizes(ph)[0])).time.sum())
               for ph in ("FWD", "BWD"))
    rate = TICKS_PER_S
    while rate < FINEST_TICKS_PER_S and work * rate < MIN_WORK_TICKS:
        rate *= 10
    return rate


def build_tasks(profile: Profile, hw: Hardware, batch: int, cfg: Config, cap: int, *,
                gpu_opt: bool = True, stash: bool = True, cuts: np.ndarray | None = None,
                gpu_handoff: bool = False, stash_layers: np.ndarray | None = None,
                per_start: int = MAX_ARCS_PER_START) -> Tasks:
    """Every candidate task of ``cfg`` with its costs (see the module docstring): backward packs
    with the optimizer step on the GPU where ``gpu_opt``, with stashed activations where ``stash``
    (and the model has at most MAX_LAYERS_WITH_STASH layers), for packs whose every layer is in
    ``stash_layers`` (a mask, default ``stashable_layers``); with ``gpu_handoff`` (Plan.gpu_handoff)
    a chain's gradient handoffs between single-microbatch backward tasks take no time and no link
    (memory rules unchanged: a task's working set already holds the one tensor kept); at most
    ``per_start`` packs per start boundary, the longest."""
    R = profile.num_layers
    profile = profile.with_compute_scale(hw.compute_scale)
    issue, lat_in, lat_out, lat_p2p = hw.issue_overhead_s, hw.h2d_latency_s, hw.d2h_latency_s, hw.p2p_latency_s
    per_event = hw.host_instruction_s
    serial = not hw.copy_overlap
    cuts = np.arange(R + 1) if cuts is None else np.asarray(cuts, int)
    shares = [batch] if cfg.mode == "vPP" else data_shares(batch, cfg.gpus)
    uf_list, ub_list = split_microbatches(shares[0], cfg.u_fwd), split_microbatches(shares[0], cfg.u_bwd)
    # every replica's microbatches: what the activation buffers in host memory hold
    every_f = [u for n in shares for u in split_microbatches(n, cfg.u_fwd)]
    every_b = [u for n in shares for u in split_microbatches(n, cfg.u_bwd)]
    n = cfg.gpus
    chain = cfg.ranks == 1
    copies, bw_in, bw_out, p2p = link_rates(hw, cfg)
    # activation gradients kept on the GPU between backward packs (Plan.keeps_on_gpu)
    pin_b = gpu_handoff and chain and len(ub_list) == 1
    replicas = n if cfg.mode == "vDP" and hw.can_allreduce(n) else 1
    cf, cb = profile.costs("FWD", cfg.u_fwd), profile.costs("BWD", cfg.u_bwd)
    cf_first, cf_last = profile.costs("FWD", uf_list[0]), profile.costs("FWD", uf_list[-1])
    cb_first, cb_last = profile.costs("BWD", ub_list[0]), profile.costs("BWD", ub_list[-1])
    # the last microbatch but one: where the last is smaller, its chain through the pipeline is the longer
    cf_pen = profile.costs("FWD", uf_list[-2]) if len(uf_list) > 1 else None
    cb_pen = profile.costs("BWD", ub_list[-2]) if len(ub_list) > 1 else None

    def total(phase, us, fn):
        return sum(fn(profile.costs(phase, u)) for u in us)

    def send(x):
        """Time until the sender is rid of an output: P2P, or its swap-out to host."""
        return x / p2p + lat_p2p if p2p > 0 else x / bw_out + lat_out

    def moves(h2d, d2h, h2d_n, d2h_n, p2p_bytes, p2p_n, ard=0.0):
        """Without copy/compute overlap: the time a task's transfers take on its rank, each at its full
        bandwidth (the module docstring)."""
        return h2d / hw.h2d_bandwidth + d2h / hw.d2h_bandwidth + h2d_n * lat_in + d2h_n * lat_out + \
            (p2p_bytes / p2p + p2p_n * lat_p2p if p2p > 0 else 0.0) + ard

    parts = []
    # ---- forward packs over 0 .. R-2 (the criterion pack holds R-1)
    fs, fe = enumerate_packs(max_pack_end(cf, cap), 0, R - 2, cuts, per_start)
    wb = profile.param_bytes(fs, fe) + profile.buffer_bytes(fs, fe)
    hf, hc, hb = boundary_hops(profile, hw, cfg, uf_list, ub_list, pin_b)
    y_last = cf_last.input[fe + 1]
    x_all = total("FWD", uf_list, lambda c: c.input[fs])
    y_all = total("FWD", uf_list, lambda c: c.input[fe + 1])
    via_host = p2p == 0
    fwd_mem = np.asarray(cf.pack_memory(fs, fe), np.float64)
    mf, mb = len(uf_list), len(ub_list)
    f_h2d = wb + np.where((fs == 0) | via_host, x_all, 0)
    f_d2h = np.where(via_host, y_all, 0)
    f_h2d_n = 1 + mf * ((fs == 0) | via_host)
    f_d2h_n = np.full(len(fs), mf * via_host)
    f_load = total("FWD", uf_list, lambda c: c.pack_time(fs, fe)) + mf * issue
    # the host issues every microbatch's compute, transfer and send (to the next GPU)
    f_issuing = f_load + per_event * (f_h2d_n + f_d2h_n + mf + mf * (not via_host))
    if serial:
        f_load = f_load + moves(f_h2d, f_d2h, f_h2d_n, f_d2h_n, np.where(via_host, 0, y_all), mf)

    def buffers(phase, at):
        """Bytes of the activations at layer boundaries ``at`` of every sample (host buffers)."""
        return total(phase, every_f if phase == "FWD" else every_b, lambda c: c.input[at])
    parts.append(_table(
        F, fs, fe, True, False,
        p_first=cf_first.pack_time(fs, fe) + issue, p_last=cf_last.pack_time(fs, fe) + issue,
        load=f_load,
        hop_in=hf[fs],
        w_load=0.0 if serial else wb / bw_in + lat_in, mem=fwd_mem, wb=wb, tail=0.0 if serial else send(y_last),
        upd=0.0,
        h2d=f_h2d, d2h=f_d2h, d2h_fwd=f_d2h,
        host=np.where(fs == 0, buffers("FWD", 0), 0) + np.where(via_host, buffers("FWD", fe + 1), 0),
        h2d_n=f_h2d_n, d2h_n=f_d2h_n, issuing=f_issuing,
        p_pen=cf_pen.pack_time(fs, fe) + issue if cf_pen is not None else 0.0))

    # ---- backward packs (variants) and the criterion pack
    rebatch = cfg.u_fwd != cfg.u_bwd
    exposed = np.concatenate([[0.0], np.cumsum(stash_out_exposed(profile, uf_list, bw_out))])
    stash_extra = np.concatenate([[0.0], np.cumsum(sum(profile.stash_forward_extra(u) for u in uf_list))])

    def backward(kind, s, e, recompute, gpu_opt):
        w = profile.param_bytes(s, e)
        k_opt = profile.optimizer_bytes(s, e)
        wbb = w + profile.buffer_bytes(s, e)
        issues = backward_instructions(recompute) * issue
        p_first, p_last = cb_first.pack_time(s, e) + issues, cb_last.pack_time(s, e) + issues
        p_pen = cb_pen.pack_time(s, e) + issues if cb_pen is not None else 0.0
        load = total("BWD", ub_list, lambda c: c.pack_time(s, e)) + mb * issues
        compute = load if recompute else \
            total("BWD", ub_list, lambda c: profile.stashed_backward_time(c.u, s, e)) + mb * issues
        hop_extra = 0.0
        if not recompute:     # the backward skips the forward it would recompute ...
            def step(c):      # ... but each microbatch waits for its saved activations to come in
                own = profile.stashed_backward_time(c.u, s, e)
                if serial:    # (then computes; the transfer at its full bandwidth, on the rank's one engine)
                    return own + c.pack_saved(s, e) / hw.h2d_bandwidth + lat_in + issues
                return np.maximum(own, c.pack_saved(s, e) / bw_in + lat_in) + issues
            p_first, p_last = step(cb_first), step(cb_last)
            p_pen = step(cb_pen) if cb_pen is not None else 0.0
            # the forward packs run its layers on the stash path, keeping their graphs
            load = total("BWD", ub_list, step) + stash_extra[e + 1] - stash_extra[s]
            hop_extra = cb_first.pack_saved(s, e) / bw_in + lat_in
            if not serial:    # the forward packs send them out: what the forward compute does not hide
                load = load + exposed[e + 1] - exposed[s]
        mem = np.asarray(cb.pack_memory(s, e), np.float64)
        # input: the loss pack's from the last forward pack (re-batched through host when the sizes
        # differ), a backward pack's dY from the previous backward pack; the first pack's from host
        hop = hc[s] if kind == C else hb[e + 1] + hop_extra
        # in a pipeline a recomputing pack's microbatch recomputes while its dY is on the way from the
        # GPU before (the simulator): its first microbatch's handoff counts from the end of its recompute
        # (S_j is then when that recompute would start to end as dY comes in), and its later ones' only
        # their backward after it
        early = kind == B and recompute and cfg.ranks > 1
        if early:
            def rec(c):
                return profile.recompute_split(c.u, s, e)[0] + issue
            r1 = rec(cb_first)
            hop = hop - r1
            p_last = p_last - rec(cb_last) + r1
            if cb_pen is not None:
                p_pen = p_pen - rec(cb_pen) + r1
        # outputs: dX of the last microbatch to the next backward pack; weight gradients
        dx = np.where(s > 0, 0.0 if pin_b else send(cb_last.input[s]), 0.0)
        ard = hw.allreduce_time(w, n) if replicas > 1 else np.zeros(len(s))
        if gpu_opt:
            step = hw.gpu_step_time(w, k_opt, profile.param_tensor_count(s, e)) + issue
            p_last, load, compute = p_last + step, load + step, compute + step
            grads = (w + k_opt) / replicas
            upd = np.zeros(len(s))
        else:
            grads = w / replicas
            upd = profile.cpu_update_time(s, e) * hw.cpu_optimizer_scale / replicas
            if cfg.mode == "vDP" and n > 1 and replicas == 1:
                upd = upd + (n - 1) * w / hw.host_copy_bandwidth / n
            upd = upd + hw.cpu_optimizer_call_s
        grad_out = ard + grads / bw_out + lat_out
        tail = dx + grad_out if chain else np.maximum(dx, grad_out)
        # bytes over the host link: weights (+ state), stashed input or activations, dY/dX via host
        stash_in = total("BWD", ub_list, (lambda c: c.input[s]) if recompute else (lambda c: c.pack_saved(s, e)))
        stash_out = total("FWD", uf_list, (lambda c: c.input[s]) if recompute else (lambda c: c.pack_saved(s, e)))
        if kind == C:
            stash_in = np.where((s == 0) | via_host | rebatch, total("BWD", ub_list, lambda c: c.input[s]), 0)
            stash_out = np.zeros(len(s))
        dy_all = total("BWD", ub_list, lambda c: c.input[e + 1]) if kind == B and not pin_b else 0
        dx_all = np.where(s > 0, total("BWD", ub_list, lambda c: c.input[s]), 0) if not pin_b else 0
        h2d = wbb + (k_opt if gpu_opt else 0) + stash_in + (dy_all if via_host else 0)
        d2h = grads + stash_out + np.where(via_host, dx_all, 0)
        # how many transfers: the weights (and state), per microbatch the stashed input or activations
        # (one per forward microbatch out), dY in and dX out through host memory; the gradients out
        h2d_n = 1 + int(gpu_opt) + mb * (1 if kind == B else ((s == 0) | via_host | rebatch)) + \
            (mb if kind == B and not pin_b and via_host else 0)
        d2h_n = 1 + (mf if kind == B else 0) + np.where((s > 0) & via_host & (not pin_b), mb, 0)
        # the host issues each microbatch's compute, every transfer, dX sent to the next GPU, the GPU
        # step and the all-reduce
        events = h2d_n + d2h_n + mb + int(gpu_opt) + np.where((s > 0) & (not via_host) & (not pin_b), mb, 0) + \
            (replicas > 1) + (mb if early else 0)     # (the recompute an event of its own)
        issuing = compute + per_event * events
        if serial:            # (a stashed pack's saved activations coming in are in its steps already)
            p2p_dx = (s > 0) & (not via_host) & (not pin_b)
            stepped = 0 if recompute else stash_in
            load = load + moves(h2d - stepped, d2h, h2d_n - (0 if recompute else mb), d2h_n,
                                np.where(p2p_dx, dx_all, 0), np.where(p2p_dx, mb, 0), ard)
        # host buffers: dX handed on through host memory; the stashed input (layer 0's is the data) or
        # saved activations; the loss pack's: the data, or its input re-batched through host memory
        host = np.where((s > 0) & via_host & (not pin_b), buffers("BWD", s), 0)
        if kind == C:
            host = host + np.where(s == 0, buffers("BWD", 0), np.where(rebatch and not via_host, buffers("FWD", s), 0))
        elif recompute:
            host = host + np.where(s > 0, buffers("BWD", s), 0)
        else:
            host = host + total("BWD", every_b, lambda c: c.pack_saved(s, e))
        w_load = (wbb + (k_opt if gpu_opt else 0)) / bw_in + (1 + int(gpu_opt)) * lat_in
        if serial:
            w_load, tail = 0.0, 0.0
        return _table(kind, s, e, recompute, gpu_opt, p_first=p_first, p_last=p_last, load=load, hop_in=hop,
                      w_load=w_load, mem=mem + (k_opt if gpu_opt else 0), wb=wbb, tail=tail, upd=upd, h2d=h2d, d2h=d2h,
                      d2h_fwd=stash_out, host=host, h2d_n=h2d_n, d2h_n=d2h_n, issuing=issuing, p_pen=p_pen)

    stash_ok = stash and R <= MAX_LAYERS_WITH_STASH
    # packs whose every layer may stash (stashable_layers): a prefix count of those that may not
    if stash_ok:
        ok = stashable_layers(profile, hw, cfg, uf_list, ub_list) if stash_layers is None else stash_layers
        not_ok = np.concatenate([[0], np.cumsum(~np.asarray(ok, bool))])
    bs, be = enumerate_packs(max_pack_end(cb, cap), 0, R - 2, cuts, per_start)
    cs = np.array([s for s in cuts if s <= R - 1 and cb.pack_memory(int(s), R - 1) <= cap], int)
    ce = np.full(len(cs), R - 1)
    # a GPU optimizer step in vDP needs the all-reduce over a GPU link (Plan.check_against)
    gpu_opt = gpu_opt and not (cfg.mode == "vDP" and n > 1 and not hw.can_allreduce(n))
    variants = [(True, False)] + ([(True, True)] if gpu_opt else []) + \
        ([(False, False)] + ([(False, True)] if gpu_opt else []) if stash_ok else [])
    for kind, s0, e0 in ((B, bs, be), (C, cs, ce)):
        for recompute, on_gpu in variants:
            if kind == C and not recompute:
                continue          # the loss pack runs its forward and backward together: nothing to stash
            keep = np.ones(len(s0), bool) if recompute else not_ok[e0 + 1] == not_ok[s0]
            if on_gpu:            # the state must fit beside the working set
                keep &= cb.pack_memory(s0, e0) + profile.optimizer_bytes(s0, e0) <= cap
            s, e = s0[keep], e0[keep]
            if len(s):
                parts.append(backward(kind, s, e, recompute, on_gpu))
    table = TaskTable.concat(parts)
    saved = np.asarray(cf.saved, np.float64) if stash_ok else None
    # every replica's bytes over the links' capacity (link_capacity: every server's link together)
    return Tasks(cfg, table, R, int(cap), link_capacity(hw, n),
                 n if cfg.mode == "vDP" and n > 1 and hw.shared_host_link else 1,
                 saved, cuts, host_budget(profile, hw, batch), per_start, (lat_in, lat_out), per_event > 0,
                 tick_rate(profile, batch),
                 cfg.ranks > 1 and any(len(u) > 1 and u[-1] < u[-2] for u in (uf_list, ub_list)))


def host_budget(profile: Profile, hw: Hardware, batch: int) -> int | None:
    """MiB of host memory left for a plan's activation buffers once the weights, gradients and
    optimizer state are in (harmony_opt/sim/host_memory.py; all of them pinned, so the lesser of what
    is left of either budget; on several servers, of every server's budget together, the model held
    once: a relaxation, each plan is then checked against each server's own); None where no plan of
    ``batch`` samples could exceed it."""
    if not may_bind(profile, hw, batch):
        return None
    model = model_host_memory(profile)
    left = min(hw.servers * hw.host_memory_bytes - model.total, hw.servers * hw.pinned_memory_bytes - model.pinned)
    return max(left, -1) // MEM_UNIT


def _table(kind, s, e, recompute, gpu_opt, **cols) -> TaskTable:
    n = len(s)
    arr = {k: np.broadcast_to(np.asarray(v, np.float64), (n,)).copy() for k, v in cols.items()}
    return TaskTable(np.full(n, kind, np.int8), np.asarray(s, int), np.asarray(e, int), np.full(n, bool(recompute)),
                     np.full(n, bool(gpu_opt)), **arr)
