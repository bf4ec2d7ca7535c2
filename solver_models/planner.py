"""The CP-SAT planner: mode, GPU count, microbatch sizes, packs and per-pack options, with a bound.

Decomposition (DESIGN.md, performance rules), in four steps under one deterministic budget:

1. **Configurations.** Every (mode, GPUs, u_fwd, u_bwd) that can matter (of the sizes giving
   the same number of microbatches, the smallest). Each gets a cheap valid lower bound on the
   model's iteration time (``config_bound``: its least compute per GPU, the weights that must
   cross the host link, and in vPP the criterion pack's serial path) and they are visited in
   the order of that bound.
2. **A first solution per configuration** on the planner's model of the simulator (timing.py):
   the exact DP (dp.py) where one GPU runs the whole chain (vDP, one GPU), local search from
   balanced packs and the hint in vPP (search.py). A configuration whose cheap bound reaches
   the best model value found is pruned, and so is every later one.
3. **CP-SAT** on the most promising configurations, started from that solution as a complete
   hint: the segment model (chain.py) for one chain, the position model (pipeline.py) for vPP.
   They search per-pack options too (recompute or stash, CPU or GPU optimizer step) and give
   each configuration its proven bound.
4. **The simulator judges**: the best candidates (and Harmony's plan, the incumbent) are
   simulated and the fastest wins, so the result is never slower than Harmony's search. Where
   the winner is a chain that may keep gradients on the GPU, the DP also searches that model's own
   chains (``_handoff_chains``); then a descent judged by the simulator (``_polish``), and the
   timeline model (timeline.py) schedules the chosen plan's events. Where any other order of the
   transfers could gain (its bound says so) and budget is left, the timeline model also chooses
   the order of the swaps (``_transfer_order``), which the plan carries when the simulator plays
   it faster.

Reported in ``plan.solver``: the model's objective for the chosen plan and its agreement with
the simulator (``fidelity``), the bound over every configuration (CP-SAT's bound where CP-SAT
ran, the DP optimum, for vPP the serial path through the largest pack (``pipeline_path_bound``)
where it was computed, or the cheap bound elsewhere) and the gap to it, the chosen
configuration's CP-SAT status and bound, the timeline model's result, the physical lower bound
over all plans (harmony_opt.bound) and the speed-up over Harmony's search.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import heapq
import logging
import math
import multiprocessing
import sys
import time

import numpy as np

from harmony_opt.baselines import feasible_sizes, plan_harmony, played
from harmony_opt.bound import lower_bound
from harmony_opt.compiler import compile_plan
from harmony_opt.errors import HarmonyOptError, InfeasibleError, PlanError, UsageError
from harmony_opt.hardware import Hardware
from harmony_opt.host_memory import may_bind, model_host_memory, require_fits
from harmony_opt.memory import explain_infeasible, fit_to_program, max_pack_end
from harmony_opt.plan import PackOptions, Plan, data_shares, split_microbatches
from harmony_opt.profile import Profile
from harmony_opt.simulator import count_events

from . import chain, dp, pipeline, search
from .tasks import (MAX_ARCS_PER_START, MAX_LAYERS_WITH_STASH, MEM_UNIT, Config, Tasks, boundary_hops, build_tasks,
                    candidate_cuts, forward_costs, link_capacity, link_rates, stash_out_exposed, stashable_layers)
from .timeline import solve_timeline
from .timing import evaluate, pack_starts, packs_of, phase_parts, sequence_of_plan

log = logging.getLogger("harmony_opt.plan")

#: The vPP partitioned start (_every_boundary) packs at every layer boundary up to this many
#: (resnet1026's 516: 250,000 tasks), at this many candidate ones beyond.
FINE_CUTS = 641

#: The vPP position model is only built up to this many placement Booleans: beyond, it costs
#: more of the budget than CP-SAT's neighbourhood moves win over the local search.
MAX_PIPELINE_VARIABLES = 20_000

#: Candidates are simulated (beyond the best two) only while the model rates them within this
#: factor of the best: the model is within a few % of the simulator, rarely 10 %.
SIMULATE_WITHIN = 1.10

#: Prices of the binding link traffic (ticks per tick) in the DP over chains that keep gradients on the
#: GPU (_handoff_chains), tried in this order while the floor binds.
HANDOFF_PRICES = (0.0, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)

#: The timeline model stops within this gap of its bound: its report proves the plan's schedule to
#: within a few tenths of a percent, and closing them costs seconds of wall time on plans of
#: thousands of events (bert_96 D=64, 6,356 events: the simulator's schedule 0.18 % above the
#: floor, and CP-SAT took 4 s to improve nothing, against 0.2 s to stop at it).
TIMELINE_REL_GAP = 5e-3


@dataclasses.dataclass
class PlannerOptions:
    mode: str = "auto"              # auto | vPP | vDP
    gpus: int | None = None         # None: try 1 .. hardware.gpus
    time_limit: float = 10.0        # work seconds for the whole search (deterministic accounting, see Budget)
    wall_limit: float | None = None  # wall-clock seconds at most (None: none); plans depend on the machine
                                     # where it binds (plan.solver["stopped_by_wall"] says so)
    seed: int = 0
    workers: int = 1                # CP-SAT workers; >1 runs interleaved (deterministic) search
    processes: int = 1              # processes for Harmony's hint, the first solutions, the local search and
                                    # the simulator's descent: the same plan, sooner (_processes)
    rel_gap: float = 1e-3
    harmony_space: bool = False     # Harmony's space: its mode and GPUs, u_fwd >= u_bwd, sizes dividing the batch
    uneven: bool = False            # allow microbatch sizes that do not divide the batch
    hint: bool = True               # warm start from Harmony's search
    options: bool = True            # search per-pack recompute/stash and CPU/GPU optimizer (off in harmony_space)
    cost_model: str = "default"     # the simulator that judges candidates: default | harmony
    gpu_handoff: bool = True        # may keep gradients between single-microbatch backward packs on the GPU
                                    # (Plan.gpu_handoff; not in Harmony's space or under Harmony's cost model)


class Budget:
    """Work seconds, counted deterministically so that the same inputs give the same plan on a busy
    or an idle machine: CP-SAT's deterministic time plus fixed costs per unit of the other work,
    measured on a 2-core machine (benchmarks/results/planner.md); they track wall time within a
    small factor, which drifts with the machine's load (1.0-2.6x by stage in one session).

    With ``wall`` seconds, each step also stops where its share of them has passed (``left``) and
    CP-SAT at the wall seconds left (``wall_left``): the search ends in time on a slow machine,
    and ``stopped_by_wall`` records that the wall clock, not the work, decided where it stopped."""

    # Measured in session 29 on a 2-core machine in one of its slow hours, one process, over the 12
    # distinct benchmark searches (least squares of wall time on the units; docs/planner.md, section 4)
    PER_FLOOR = 2e-4        # a configuration's floor (compute_floor), which orders them all ...
    PER_BOUND = 2.7e-3      # ... and its cheap bound (config_bound), where the search reaches it
    PER_PATH_LAYER = 5e-4   # a vPP configuration's path bound (pipeline_path_bound), per layer
    PER_CONFIG = 6e-3       # building a configuration's candidate tasks: fixed part ...
    PER_ROW = 5e-7          # ... and per candidate task
    PER_DP = 5e-3           # the DP: fixed part ...
    PER_NODE = 4.5e-5       # ... per layer boundary ...
    PER_PAIR = 2e-8         # ... and per (predecessor, task) pair it weighs
    PER_START = 6e-6        # a balanced first solution, per task evaluated
    PER_PARTITION = 0.03    # the packings that minimise the largest pack (search.partitioned), besides
                            # PER_START per task they evaluate
    PER_STEP = 5.5e-5       # a local-search step: fixed part ...
    PER_TASK = 2.5e-6       # ... and per task of the evaluated sequence
    PER_SIMULATION = 3e-3   # the simulator judging a plan: fixed part (the task graph, the checks) ...
    PER_EVENT = 2.4e-5      # ... and per event
    PER_HARMONY_EVENT = 1.55e-5  # Harmony's simulator (--cost-model harmony), per event it plays besides
                                 # PER_SIMULATION (session 30: 1.8 ms + 8.9 us per event on 22 plans in a
                                 # hour 1.75x faster than the calibration's)
    PER_PACKING = 6.5e-6    # Harmony's search: its packing heuristics, per candidate and layer
    PER_MODEL_ROW = 9e-5    # building a CP-SAT model and completing its hint, per Boolean
    PER_SOLVE = 0.05        # CP-SAT's start-up, which its deterministic clock barely counts
    PER_TIMELINE_EVENT = 2.5e-4  # the timeline model, per event, besides its time limit

    @staticmethod
    def dp(tasks: Tasks) -> float:
        """One DP over ``tasks`` (dp.solve_chain)."""
        return Budget.PER_DP + Budget.PER_NODE * 2 * tasks.num_layers + Budget.PER_PAIR * dp.pairs(tasks)

    @staticmethod
    def simulation(events: int, cost_model: str = "default", runs: int = 1) -> float:
        """``runs`` simulations by the cost model's simulator that played ``events`` events in all."""
        per_event = Budget.PER_HARMONY_EVENT if cost_model == "harmony" else Budget.PER_EVENT
        return Budget.PER_SIMULATION * runs + per_event * events

    def __init__(self, total: float, wall: float | None = None):
        self.total, self.used = float(total), 0.0
        self.wall, self.started, self.stopped_by_wall = wall, time.perf_counter(), False

    def spend(self, seconds: float) -> None:
        self.used += seconds

    def left(self, share: float = 1.0, reserve: float = 0.0) -> float:
        """Work seconds left of ``share`` of the budget, less ``reserve`` (kept for a later step)."""
        work = share * self.total - self.used - reserve
        if self.wall is not None:
            wall = self.wall_left(share) - reserve
            if wall <= 0 < work:
                self.stopped_by_wall = True
                return wall
        return work

    def wall_left(self, share: float = 1.0) -> float | None:
        """Wall seconds left of ``share`` of the wall limit (None without one)."""
        return None if self.wall is None else share * self.wall - (time.perf_counter() - self.started)

    def cp_sat_limits(self, limit: float, share: float = 1.0) -> dict:
        """CP-SAT's limits for a solve of ``limit`` work seconds within ``share`` of the wall limit."""
        wall = self.wall_left(share)
        return {"time_limit": limit, "wall_limit": None if wall is None else max(0.05, wall)}

    def solved(self, status: str, wall_time: float, limits: dict) -> None:
        """Note a CP-SAT solve (``limits`` from cp_sat_limits) that its wall limit stopped unfinished."""
        if limits["wall_limit"] is not None and status != "OPTIMAL" and wall_time >= 0.95 * limits["wall_limit"]:
            self.stopped_by_wall = True


def _validate(opts: PlannerOptions, hw: Hardware, batch: int) -> None:
    if opts.mode not in ("auto", "vPP", "vDP"):
        raise UsageError(f"--mode must be auto, vPP or vDP, got {opts.mode!r}")
    if opts.gpus is not None and not 1 <= opts.gpus <= hw.gpus:
        raise UsageError(f"--gpus {opts.gpus}: hardware {hw.name!r} has {hw.gpus} GPU(s)")
    if batch < 1:
        raise UsageError(f"--batch must be >= 1, got {batch}")
    if not 0 < opts.time_limit < math.inf:
        raise UsageError(f"--time-limit must be > 0 seconds, got {opts.time_limit}")
    if opts.processes < 1:
        raise UsageError(f"--processes must be >= 1, got {opts.processes}")
    if opts.wall_limit is not None and not 0 < opts.wall_limit < math.inf:
        raise UsageError(f"--wall-limit must be > 0 seconds, got {opts.wall_limit}")
    if opts.cost_model not in ("default", "harmony"):
        raise UsageError(f"--cost-model must be default or harmony, got {opts.cost_model!r}")


def _sizes(sizes: list[int], share: int) -> list[int]:
    """Of the sizes giving the same number of microbatches, the smallest (= the most even split):
    a larger one only adds memory and makes the last microbatch smaller."""
    best = {}
    for u in sorted(sizes):
        best.setdefault(-(-share // u), u)
    return sorted(best.values())


def configurations(profile: Profile, hw: Hardware, batch: int, opts: PlannerOptions) -> list[Config]:
    modes = ("vPP", "vDP") if opts.mode == "auto" else (opts.mode,)
    if opts.harmony_space:
        gpu_counts = [opts.gpus or hw.gpus]
    else:
        gpu_counts = [opts.gpus] if opts.gpus else list(range(1, hw.gpus + 1))
    out = []
    for mode in modes:
        for n in gpu_counts:
            if mode == "vDP" and n > batch:
                continue
            if mode == "vDP" and n == 1 and "vPP" in modes:
                continue        # identical to vPP on one GPU
            share = batch if mode == "vPP" else min(data_shares(batch, n))
            div = not opts.uneven or opts.harmony_space
            ub = _sizes(feasible_sizes(profile, batch, mode, n, "BWD", divisors_only=div), share)
            uf = _sizes(feasible_sizes(profile, batch, mode, n, "FWD", divisors_only=div), share)
            out += [Config(mode, n, f, b) for b in ub for f in uf if not (opts.harmony_space and f < b)]
    return out


def config_bound(profile: Profile, hw: Hardware, batch: int, cfg: Config, cap: int, stash: bool,
                 stash_layers: np.ndarray | None = None) -> float:
    """A valid lower bound on the model's iteration time of any plan of ``cfg`` (seconds), with stash
    variants (``stash``) for the layers build_tasks offers them (``stash_layers``, the same default).

    Every plan has a criterion pack [s, R-1] (one that fits); for each such s, and the least
    over s is taken:

    * ``T >= one``: the first microbatch passes every task in turn (what a pipeline of few
      microbatches cannot hide). In vPP, more: it is handed from task to task (``_pipeline_hops``)
      and the last task runs its other microbatches after it; and the first microbatch's trip
      through the forward layers before s, every microbatch of the criterion pack, the last
      microbatch's trip back, handed on the same way: the criterion pack is
      one serial piece of work; and the forward compute per GPU, then the last microbatch's trip
      back from the criterion pack on (``_after_forward``); and the first microbatch's trip to the
      criterion pack, then the work from its start on (``_from_criterion``). Where stash may
      replace a layer's recompute, these paths count the lesser of its recompute and a mix of
      what a stashed layer costs (``_backward_timer``), with two mixes tried.
    * ``T >= C / ranks`` (compute per GPU) and ``T >= L`` (bytes into the GPUs over the shared
      host link), so ``T >= mu * C / ranks + (1 - mu) * L`` for every mu in [0, 1]. C counts
      every layer's backward on every microbatch and the forward of the layers before s; L the
      weights that must come in (every backward pack's and those forward layers', from every
      replica). Where stash may replace a layer's recompute, its microbatch takes
      max(backward without recompute, saved activations / link) (tasks.py) >= lam * first +
      (1 - lam) * second, its pack carries what the forward compute does not hide of their
      way out (tasks.py), and they cross the link: with mu and lam fixed the bound is a sum over
      layers of the cheaper choice, and the best (mu, lam) of a small grid is taken.
    * In vPP the compute per GPU rises by what the GPUs wait at the pipeline's two ends
      (``_pipeline_ends``), except for the plans whose backward runs in at most N - 2 tasks.

    Small criterion packs leave much forward compute; large ones a long serial piece: taking
    the least over s of the larger of the two is what makes the bound of a vPP configuration
    with few microbatches worth having."""
    R = profile.num_layers
    share = batch if cfg.mode == "vPP" else max(data_shares(batch, cfg.gpus))
    cb = profile.costs("BWD", cfg.u_bwd)
    fits = np.flatnonzero(cb.pack_memory(np.arange(R), np.full(R, R - 1)) <= cap)
    if len(fits) == 0:
        return float("inf")
    before = fits - 1                   # the layers before each criterion start: [0, s - 1]
    uf, ub = split_microbatches(share, cfg.u_fwd), split_microbatches(share, cfg.u_bwd)
    # the layers whose stash variants exist (tasks.stashable_layers); elsewhere only the recompute
    ok = np.zeros(R, bool) if not stash else stashable_layers(profile, hw, cfg, uf, ub) if stash_layers is None \
        else np.asarray(stash_layers, bool)
    stash = bool(ok.any())
    copies = cfg.gpus if cfg.mode == "vDP" else 1
    # seconds per byte over the host link, all copies' traffic counted (tasks.Tasks.ticks)
    link_in, link_out = link_capacity(hw, cfg.gpus)
    per_in, per_out = copies / link_in, copies / link_out
    bwd, no_rec, moved, saved = _backward_work(profile, hw, cfg, ub)
    # per criterion start s in ``fits``: the forward compute and the weights of the layers before it
    forward = _forward_before(profile, uf, fits)
    w_all = profile.param_bytes(0, R - 1) + profile.buffer_bytes(0, R - 1)
    w_before = profile.param_bytes(0, before) + profile.buffer_bytes(0, before)
    w_in = (w_all + w_before) * per_in
    n = cfg.ranks
    _, bw_in, bw_out, _ = link_rates(hw, cfg)
    # a stashed layer's pack also carries what the forward compute does not hide of its
    # activations leaving (tasks.py: the same per-layer sum over the forward microbatches)
    exposed = stash_out_exposed(profile, uf, bw_out)
    fwd_first = profile.costs("FWD", uf[0]).pack_time(0, before)
    # stashed layers in the serial paths: at least their backward without the forward (lam = 1),
    # or at least their saved activations coming in (lam = 0), whichever bounds higher
    timers = [_backward_timer(profile, lam, bw_in, ok) for lam in ((1.0, 0.0) if stash else (None,))]
    if n > 1:
        fwd_hops, back_hops, back_rests = _pipeline_hops(profile, hw, cfg, uf, ub, cap, fits, timers)
        last = _last_step(profile, hw, bw_out)
        # every microbatch of the criterion pack [s, R-1]
        crit = sum(k * profile.costs("BWD", u).pack_time(fits, np.full(len(fits), R - 1))
                   for u, k in collections.Counter(ub).items())
        after = _after_forward(profile, hw, cfg, uf, ub, fits, forward, back_hops, last)
        # from the criterion pack's start on (at least the forward's first-microbatch path)
        links = (saved * per_in, [lam * no_rec + (1 - lam) * moved + exposed for lam in (0.0, 0.5, 1.0)], ok) \
            if stash else None
        from_crit = fwd_first + fwd_hops + _from_criterion(profile, cfg, ub, fits, bwd, links, w_before * per_in,
                                                          crit, last)

    def serial(k):
        """(the serial paths, the pipeline ends, the few-backward-packs bound) with ``timers[k]``."""
        bt = timers[k]
        # every microbatch passes every task in turn: the first one alone takes its forward and backward
        one = bt(ub[0], 0, R - 1) + fwd_first
        if n == 1:
            return one, np.zeros(len(fits)), np.full(len(fits), np.inf)
        # the criterion pack's path: the first microbatch's trip through the forward layers before s,
        # every microbatch of the criterion pack, the last microbatch's trip back (in timing.py's
        # recurrence the S chain up to the criterion task, its load, the E chain after it); a pack's
        # compute is the sum of its layers', so this holds for every packing of the other layers
        path = fwd_first + crit + bt(ub[-1], 0, fits - 1) + fwd_hops + back_hops
        one = np.maximum.reduce([one + fwd_hops + back_rests[k], path, after + bt(ub[-1], 0, fits - 1), from_crit])
        return (one, *_pipeline_ends(profile, hw, cfg, uf, ub, cap, fits, bt, last))
    if not stash:
        one, ends, few = serial(0)
        base = np.maximum(w_in, one)
        spans = (float(bwd.sum()) + forward) / n
        return float(np.min(np.maximum(base, np.maximum(spans, np.minimum(spans + ends / n, few)))))
    # the link: every phase takes at least its own traffic (timing.py), so T >= in_F + in_B (the
    # weights of the forward layers and of every layer, stashed activations coming back) and
    # T >= out_F + in_B (stashed activations leaving in the forward, the backward packs' weights,
    # the stashed activations coming back): either may be the link term. The criterion pack's
    # weights come in during the forward phase (timing.py: it ends the phase), so in_B holds only
    # those of the layers before it: with every layer's it counted them twice where out_F is the
    # forward's link term (a last layer of large buffers: 13.6 ms over a plan of 10.5 ms)
    back = saved * per_in
    out = sum(profile.costs("FWD", u).saved for u in uf) * per_out
    best, totals = np.zeros(len(fits)), []
    rec = bwd / n
    for link_s, link_w in ((back, w_in), (back + out, w_before * per_in)):
        for lam in (0.0, 0.25, 0.5, 0.75, 1.0):
            st = (lam * no_rec + (1 - lam) * moved + exposed) / n
            # the bound is concave and piecewise linear in mu: its maximum is at a layer's breakpoint
            # (where recompute and stash cost the same) or an end of [0, 1]
            with np.errstate(divide="ignore", invalid="ignore"):
                knees = np.where(rec - st + link_s > 0, link_s / (rec - st + link_s), 0.0)
            mus = np.clip(np.concatenate([[0.0, 1.0], knees]), 0.0, 1.0)[:, None]
            per_layer = np.where(ok, np.minimum(mus * rec, mus * st + (1 - mus) * link_s), mus * rec).sum(axis=1)
            total = per_layer[:, None] + mus * forward[None, :] / n + (1 - mus) * link_w[None, :]
            best = np.maximum(best, total.max(axis=0))
            totals.append((total, mus))
    bound = 0.0
    for k in range(len(timers)):
        one, ends, few = serial(k)
        with np.errstate(invalid="ignore"):     # a start no packing reaches: its ends are inf, weighed 0 at mu = 0
            best_ends = np.max([(total + np.where(mus > 0, mus * ends[None, :], 0.0) / n).max(axis=0)
                                for total, mus in totals], axis=0)
        bound = max(bound, float(np.min(np.maximum.reduce([best, np.broadcast_to(one, best.shape),
                                                            np.minimum(best_ends, few)]))))
    return bound


def _backward_work(profile: Profile, hw: Hardware, cfg: Config, ub: list[int]):
    """Per layer, summed over the backward microbatches ``ub``: (backward with its recompute, without
    it, the time its saved activations take to come in over the link, their bytes).

    Without the recompute: the backward less the forward, as measured, negative where a layer's
    backward took less than its forward (a CPU profile's tiny or noisy layers). A stashed pack skips
    its forward as a whole (tasks.py: its backward less the lesser of its forward and its backward),
    which is at least the sum of its layers' differences but less than the sum of each clipped at 0
    where the pack holds layers of both signs: that sum put the bound above the best plan, on one GPU
    as on several (tests/test_bounds.py)."""
    R = profile.num_layers
    wait = (cfg.gpus if cfg.mode == "vDP" else 1) if hw.shared_host_link else 1   # a vDP transfer (tasks.py)
    bwd, no_rec, moved, saved = np.zeros(R), np.zeros(R), np.zeros(R), np.zeros(R)
    for u, k in collections.Counter(ub).items():        # at most two sizes (split_microbatches)
        c = profile.costs("BWD", u)
        bwd += k * c.time
        no_rec += k * (c.time - forward_costs(profile, u).time)
        moved += k * c.saved * wait / hw.h2d_bandwidth
        saved += k * c.saved
    return bwd, no_rec, moved, saved


def compute_floor(profile: Profile, hw: Hardware, batch: int, cfg: Config, cap: int, stash: bool) -> float:
    """At most config_bound (same arguments), a hundred times cheaper: the backward work per GPU,
    every layer on every microbatch (a layer with a stash variant at least the least of its
    recompute, its backward without it and its saved activations' way in, each of which
    config_bound's mixes count at least); inf where no criterion pack fits, as config_bound. Rounded
    down by a billionth: where the two are equal, their float sums may differ in the last bit, and a
    floor above the bound would let in_bound_order visit tied configurations out of order."""
    R = profile.num_layers
    if not (profile.costs("BWD", cfg.u_bwd).pack_memory(np.arange(R), np.full(R, R - 1)) <= cap).any():
        return float("inf")
    share = batch if cfg.mode == "vPP" else max(data_shares(batch, cfg.gpus))
    ub = split_microbatches(share, cfg.u_bwd)
    ok = stash and stashable_layers(profile, hw, cfg, split_microbatches(share, cfg.u_fwd), ub)
    bwd, no_rec, moved, _ = _backward_work(profile, hw, cfg, ub)
    # each term of a stashed layer at most its saved activations' way in, which its pack's microbatches
    # take at least (tasks.py), whatever the sign of the layers' backward less forward
    work = float(np.where(ok, np.minimum.reduce([bwd, np.maximum(no_rec, 0.0), moved]), bwd).sum())
    return work / cfg.ranks * (1 - 1e-9)


def in_bound_order(configs: list[Config], floor: dict, bound, first: Config | None = None):
    """``(configuration, bound(configuration))`` in the order of (bound, name), ``first`` first,
    computing ``bound`` only for the configurations reached: each waits in the queue at its
    ``floor`` (a lower bound on ``bound``) until it is the least, then at its bound. Where the
    caller stops once the bound reaches its best plan, most are never computed."""
    if first is not None and first in floor:
        b = bound(first)
        if np.isfinite(b):
            yield first, b
    heap = [(floor[c], str(c), False, c) for c in configs if c != first]
    heapq.heapify(heap)
    while heap:
        key, name, exact, c = heapq.heappop(heap)
        if exact:
            yield c, key
        else:
            heapq.heappush(heap, (bound(c), name, True, c))


def _pipeline_hops(profile: Profile, hw: Hardware, cfg: Config, uf: list[int], ub: list[int], cap: int,
                   fits: np.ndarray, timers: list) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """vPP, per criterion start s in ``fits``, the least over every packing of [0, s - 1] into packs
    that fit of: the handoffs into the forward packs and into the criterion pack; the handoffs into
    the backward packs; the same plus the other microbatches of the last backward pack (the one
    holding layer 0), timed by each of ``timers`` (``_backward_timer``). In timing.py's recurrence a
    task's first microbatch starts after the previous task's, plus the handoff into it (``S_j >=
    S_{j-1} + p_first_{j-1} + hop_j``), its last one after the previous task's last, plus the
    handoff (``E_j``), and the last task ends after all its microbatches; so these add to the first
    and the last microbatch's trips. Shortest paths over the layer boundaries, every boundary a
    candidate (the planner's candidates are a subset)."""
    hf, hc, hb = boundary_hops(profile, hw, cfg, uf, ub)
    R = profile.num_layers
    zero = np.zeros(R)
    fwd = _least_packing(max_pack_end(profile.costs("FWD", cfg.u_fwd), cap), hf, zero, zero)
    end_b = max_pack_end(profile.costs("BWD", cfg.u_bwd), cap)
    back = _least_packing(end_b, zero, hb, zero)
    # the last backward pack [0, b - 1]: its microbatches after the first
    sizes = collections.Counter(ub[1:]).items()
    rests = [sum((k * bt(u, 0, np.arange(R) - 1) for u, k in sizes), zero) for bt in timers]
    return fwd[fits] + hc[fits], back[fits], [_least_packing(end_b, zero, hb, rest)[fits] for rest in rests]


def _after_forward(profile: Profile, hw: Hardware, cfg: Config, uf: list[int], ub: list[int], fits: np.ndarray,
                   forward: np.ndarray, back_hops: np.ndarray, last: float) -> np.ndarray:
    """vPP, per criterion start s in ``fits``: the forward compute per GPU, then the last
    microbatch's trip back but its backward compute through the layers before s (which the caller
    adds, as the stash variants may shorten it). In timing.py's recurrence every forward task runs
    on its GPU between 0 and its end, the tasks of one GPU one after another, and the ends rise
    along the chain, so the last forward task ends no earlier than the forward compute / N; then
    the E chain: the criterion pack's last microbatch and every backward pack's, each after its
    handoff, and the last pack's gradients leave and step (as in ``_pipeline_ends``). ``forward``:
    the forward compute of the layers before s; ``back_hops`` from ``_pipeline_hops``; ``last``:
    ``_last_step``."""
    R, n = profile.num_layers, cfg.ranks
    _, hc, _ = boundary_hops(profile, hw, cfg, uf, ub)
    crit_last = profile.costs("BWD", ub[-1]).pack_time(fits, np.full(len(fits), R - 1))
    return forward / n + hc[fits] + crit_last + back_hops + last


def _from_criterion(profile: Profile, cfg: Config, ub: list[int], fits: np.ndarray, bwd: np.ndarray, links,
                    weights_in: np.ndarray, crit: np.ndarray, last: float) -> np.ndarray:
    """vPP, per criterion start s in ``fits``: at least the time from the criterion pack's start to
    the end. In timing.py's recurrence every backward task starts after the criterion pack's first
    microbatch, the tasks of one GPU one after another, the criterion pack's GPU runs its backward
    tasks after it, and the last task's gradients leave and step after its end; so N x (T - S_crit)
    >= the criterion pack's compute + (N - 1) x its first microbatch + every backward compute +
    ``_last_step`` (``work``). And the backward phase takes at least its traffic (timing.py) after
    the criterion pack ends: T - S_crit >= the criterion pack's compute + the weights of the layers
    before s + the stashed activations coming back (``link``). So T - S_crit >= mu work + (1 - mu)
    link for every mu in [0, 1], a sum over the layers before s where each takes the cheaper of
    recompute and stash. ``links``: None without stash variants, else (each layer's stashed
    activations over the link, the stashed layer's compute at a few mixes (``config_bound``), the
    layers that have stash variants); ``crit``: the criterion pack's compute, every microbatch."""
    R, n = profile.num_layers, cfg.ranks
    fixed = crit + (n - 1) * profile.costs("BWD", ub[0]).pack_time(fits, np.full(len(fits), R - 1)) + last
    cum = np.concatenate([[0.0], np.cumsum(bwd)])[fits]
    work = (fixed + cum) / n
    if links is None:
        return work
    back, stashed, ok = links
    best = np.zeros(len(fits))
    for st in stashed:
        for mu in (0.0, 0.25, 0.5, 0.75, 1.0):
            per = np.where(ok, np.minimum(mu * bwd / n, mu * st / n + (1 - mu) * back), mu * bwd / n)
            cum = np.concatenate([[0.0], np.cumsum(per)])[fits]
            best = np.maximum(best, mu * fixed / n + (1 - mu) * (crit + weights_in) + cum)
    return best


def _pipeline_ends(profile: Profile, hw: Hardware, cfg: Config, uf: list[int], ub: list[int], cap: int,
                   fits: np.ndarray, bt, last: float) -> tuple[np.ndarray, np.ndarray]:
    """vPP, per criterion start s in ``fits``: (what every GPU waits before its first task and after
    its last one, summed over the GPUs; a bound for the plans where that sum does not hold).

    In timing.py's recurrence the task at position j runs on GPU j mod n after the task n positions
    earlier, so GPU g is busy from its first start S_g to its last end, and ``n T >= compute +
    sum_g S_g + sum_g (T - last end on g)``. GPU g starts after the first microbatch of each task
    before it, plus the handoffs (``S_g >= S_{g-1} + p_first + hop``); the last n - 1 tasks' last
    microbatches come after the last task on the other GPUs (``E_j >= E_{j-1} + hop + p_last``),
    and the last task's gradients leave and step after that (``tail + upd``). Which packs sit at
    those positions is open, so the least over packings is taken: one layer per pack, each pack
    starting past the one before (a forward pack at position i starts at layer >= i). Where the
    first n positions cannot all be forward packs (fewer forward packs cover [0, s - 1]), the
    criterion pack and backward packs may sit there. The last n - 1 positions are backward packs
    unless at most n - 2 tasks do the whole backward, on as many GPUs: for those plans the second
    array, that backward compute per GPU (inf where no packs that fit are so few). ``last``:
    ``_last_step``."""
    R, n = profile.num_layers, cfg.ranks
    _, bw_in, _, _ = link_rates(hw, cfg)
    hf, _, _ = boundary_hops(profile, hw, cfg, uf, ub)
    layers = np.arange(R)
    f1 = profile.costs("FWD", uf[0]).time
    b1 = bt(ub[0], layers, layers)
    bl = bt(ub[-1], layers, layers)

    # heads: positions 0 .. n - 1, a forward pack at i starting at layer a weighs (n-1-i) p_first
    # + (n-i) hop (every later GPU waits for it); S_0 >= its hop and its weights, n times
    w0 = (profile.param_bytes(0, 0) + profile.buffer_bytes(0, 0)) / bw_in
    run = np.full(R, np.inf)
    run[0] = (n - 1) * f1[0] + n * max(float(hf[0]), float(w0))
    heads_f = [float(run[0])]           # heads_f[k]: forward packs at positions 0 .. k
    for i in range(1, n):
        run = _least_before(run) + (n - 1 - i) * f1 + (n - i) * hf
        run[R - 1:] = np.inf            # forward packs end before the criterion layer
        heads_f.append(float(run.min()))
    # forward packs at positions 0 .. k - 1, the criterion pack at k, backward packs after it
    crit_first = profile.costs("BWD", ub[0]).pack_time(fits, np.full(len(fits), R - 1))
    b1_min = float(b1[1:].min()) if R > 1 else 0.0
    fewest_f = _fewest_packs(max_pack_end(profile.costs("FWD", cfg.u_fwd), cap))[fits]
    heads = np.full(len(fits), heads_f[n - 1])
    for k in range(1, n):
        after = sum((n - 1 - i) * b1_min for i in range(k + 1, n))
        alt = heads_f[k - 1] + (n - 1 - k) * crit_first + after
        heads = np.where(fewest_f <= k, np.minimum(heads, alt), heads)

    # tails: the backward task at position J-1-m (m < n-1) starts at layer a_m, a_0 = 0 < a_1 < ...
    run = np.full(R, np.inf)
    run[0] = (n - 1) * bl[0]
    for m in range(1, n - 1):
        run = _least_before(run) + (n - 1 - m) * bl
    tails = float(run.min()) + n * last

    ends = np.where(fits > 0, heads + tails, 0.0)         # s = 0: one task, its serial path bounds it
    few = np.full(len(fits), np.inf)
    if n > 2:
        fewest_b = 1 + _fewest_packs(max_pack_end(profile.costs("BWD", cfg.u_bwd), cap))[fits]
        backward = sum(bt(u, 0, R - 1) for u in ub)
        few = np.where(fewest_b <= n - 2, backward / (n - 2), np.inf)
    return ends, few


def pipeline_path_bound(profile: Profile, hw: Hardware, batch: int, cfg: Config, cap: int, stash: bool,
                        stash_layers: np.ndarray | None = None, upto: float = math.inf, ratio: float = 1.03) -> float:
    """A lower bound on the model's iteration time of every plan of a vPP configuration (seconds; 0
    where stash variants are offered, as in ``config_bound``: a stashed pack's microbatch is not a
    sum over its layers), tighter than ``config_bound`` where a pipeline has few
    microbatches: there a plan's largest pack and its number of handoffs set the time.

    In timing.py's recurrence, for every task k of the chain, the first microbatch runs through
    the tasks before k (``S_j >= S_{j-1} + p_first_{j-1} + hop_j``), k runs all its microbatches,
    and the last microbatch then runs through the tasks after it (``E_j >= E_{j-1} + hop_j +
    p_last_j``): T >= sum_j min(p_first_j, p_last_j) + (load_k - min(p_first_k, p_last_k)) + every
    hop + the last step. The first sum is one microbatch through every layer, the same for every
    packing; the second grows with the largest pack, the hops with the number of packs. Per
    threshold L of a geometric grid (``ratio``, up to where the bound passes ``upto``), the
    packings whose largest pack (but the criterion pack, counted apart) is at most L have at
    least the least hops of packings under L (shortest paths over the layer boundaries, every
    boundary a candidate), and those above the previous threshold a largest pack above it
    (resnet1026 D=64 vPP x4 u=16/16: 3.58 -> 3.7 s; the best plan found 3.75 s). Per criterion
    start, the larger of that and each GPU's path through its whole forward work
    (``_per_gpu_paths``)."""
    if cfg.mode != "vPP" or cfg.ranks < 2:
        return 0.0
    R = profile.num_layers
    uf, ub = split_microbatches(batch, cfg.u_fwd), split_microbatches(batch, cfg.u_bwd)
    ok = stashable_layers(profile, hw, cfg, uf, ub) if stash_layers is None else np.asarray(stash_layers, bool)
    if stash and ok.any():
        return 0.0
    end_f = max_pack_end(profile.costs("FWD", cfg.u_fwd), cap)
    end_b = max_pack_end(profile.costs("BWD", cfg.u_bwd), cap)
    fits = np.flatnonzero(end_b >= R - 1)          # the criterion starts: [s, R-1] fits
    if len(fits) == 0:
        return math.inf

    def split(phase, sizes):
        """Per layer: one microbatch's compute (the lesser of the first and the last), and the rest."""
        times = [profile.costs(phase, u).time for u in sizes]
        one = np.minimum(times[0], times[-1])
        return one, sum(times) - one
    one_f, rest_f = split("FWD", uf)
    one_b, rest_b = split("BWD", ub)
    pre_f, pre_b = (np.concatenate([[0.0], np.cumsum(r)]) for r in (rest_f, rest_b))
    _, bw_in, bw_out, _ = link_rates(hw, cfg)
    hf, hc, hb = boundary_hops(profile, hw, cfg, uf, ub)
    last = _last_step(profile, hw, bw_out)
    base = np.concatenate([[0.0], np.cumsum(one_f)])[fits] + one_b.sum() + hc[fits] + last
    crit = pre_b[R] - pre_b[fits]
    zero = np.zeros(R)

    best = np.full(len(fits), math.inf)
    hi = min(upto - float(base.min()), max(pre_f[-1], pre_b[-1]))     # above: every packing
    # any first threshold above 0 gives a valid bound (the first band is every packing under it); at
    # least 1e-4 of the range, so a first layer that takes no time cannot stall the grid at 0
    prev, L = 0.0, max(float(max(rest_f[0], rest_b[0])), 1e-4 * hi)
    while True:
        final = L >= hi
        if final:                   # every packing above the previous threshold
            fwd = _least_packing(end_f, hf, zero, zero)
            back = _least_packing(end_b, zero, hb, zero)
        else:
            fwd = _least_packing(_reach(end_f, pre_f, L), hf, zero, zero)
            back = _least_packing(_reach(end_b, pre_b, L), zero, hb, zero)
        best = np.minimum(best, np.maximum(prev, crit) + fwd[fits] + back[fits])
        if final:
            break
        prev, L = L, L * ratio
    path = base + best
    per_gpu = _per_gpu_paths(profile, cfg, uf, end_b, fits, one_b, rest_b, hb, last, upto, path)
    return float(np.min(np.maximum(path, per_gpu)))


def _per_gpu_paths(profile: Profile, cfg: Config, uf: list[int], end_b: np.ndarray, fits: np.ndarray,
                   one: np.ndarray, rest: np.ndarray, hb: np.ndarray, last: float, upto: float,
                   path: np.ndarray, ratio: float = 1.03, most: int = 40) -> np.ndarray:
    """vPP, per criterion start s in ``fits``: a bound on the plans whose backward (the criterion
    pack included) runs in at least N tasks, 0 where fewer can do it. Where a pipeline has more
    forward microbatches than GPUs the forward keeps every GPU busy, and one microbatch's trip
    through it (``pipeline_path_bound``) undercounts it; here each GPU's forward work counts whole
    (resnet1026 D=64 vPP x4 u=13/16: 3.64 -> 3.69 s; its best plan found 3.83 s).

    In timing.py's recurrence GPU g runs its forward tasks before its first backward task, at
    position f_g (``S_j >= E_{j-N} >= S_{j-N} + load_{j-N}``), so ``S_{f_g} >= F_g``, its forward
    work; from there the first microbatch passes every backward task after f_g (``S_j >= S_{j-1} +
    p_first_{j-1} + hop_j``) up to a task k, which runs all its microbatches, and the last
    microbatch passes the rest (``E_j >= E_{j-1} + hop_j + p_last_j``), then the last step. So
    ``T >= F_g + sum_{j >= f_g} (one_j + hop_{j+1}) + rest_k + last`` for every k >= f_g (one: a
    microbatch's compute, the lesser of the first and the last; rest: the other microbatches).
    With N or more backward tasks f_g takes the positions c .. c + N - 1 after the criterion
    pack's c, one per GPU; averaged over the GPUs, sum_g F_g is the forward compute of the layers
    before s, and the task at position c + p counts its one with weight min(p + 1, N) / N, the
    handoff into it min(p, N) / N, and its rest min(p + 1, N) / N, for the largest such.

    The least over packings: the packings whose largest weighted rest lies in a band (P, L] take
    at least P plus the least of the rest with every weighted rest at most L: a shortest path over
    the layer boundaries for the tasks at positions N - 1 and on (weight 1), then the N - 2 tasks
    before them, each a window minimum over where it may start. Any partition into bands gives a
    valid bound, and splitting a band only raises it: bands double from the largest layer's rest
    up to where every plan is above ``upto``, and the one binding the bound (beside ``path``, the
    other bound per s) is halved geometrically, at most ``most`` times, until it is within
    ``ratio``."""
    n, R = cfg.ranks, profile.num_layers
    pre_one, pre_rest = (np.concatenate([[0.0], np.cumsum(r)]) for r in (one, rest))
    forward = _forward_before(profile, uf, fits)
    crit_rest = (pre_rest[R] - pre_rest[fits]) / n
    base = forward / n + (pre_one[R] - pre_one[fits]) / n + last
    bounds = np.arange(R + 1)
    hop = np.concatenate([hb, [0.0]])           # per boundary: the handoff into the pack ending below it

    def least(L):
        """Per s, the least of the weighted ones and handoffs over the packings whose weighted rests
        are at most L."""
        # positions N - 1 on: packings of [0, x - 1] into at least one pack, the top one's handoff
        # counting (N - 1) / N
        v = np.concatenate([_least_packing(_reach(end_b, pre_rest, L), -pre_one[:R], pre_one[:R] + hb, np.zeros(R)),
                            [np.inf]]) - hop / n
        v[0] = np.inf
        for p in range(n - 2, 0, -1):           # position p: a pack [x, m - 1] on top of v's packing
            w = (p + 1) / n
            # the lowest start of a pack [x, m - 1] whose weighted rest is at most L (x >= 1: v's packing holds a pack)
            lo = np.searchsorted(_reach(end_b, pre_rest, L / w), np.maximum(bounds - 1, 0))
            lo = np.maximum(np.minimum(lo, bounds), 1)
            v = w * pre_one + (p / n) * hop + _window_min(v - w * pre_one, lo, bounds - 1)
        return v[fits]

    every = least(math.inf)
    hi = min(upto - float(np.min(base + crit_rest + every)), pre_rest[-1])   # above: every plan is above upto
    tops = [float(rest.max())]                  # the bands (P, L] with least(L); the first from 0
    while tops[-1] < hi:
        tops.append(2 * tops[-1])
    bands = [(P, L, least(L)) for P, L in zip([0.0] + tops, tops)] + [(tops[-1], math.inf, every)]
    for _ in range(most + len(bands)):
        values = np.array([np.maximum(P, crit_rest) + v for P, _, v in bands])
        per_s = base + values.min(axis=0)
        i = int(np.argmin(np.maximum(path, per_s)))
        j = int(np.argmin(values[:, i]))
        P, L, v = bands[j]
        if P == 0.0 or L == math.inf or L <= P * ratio:
            break
        mid = math.sqrt(P * L)
        bands[j: j + 1] = [(P, mid, least(mid)), (mid, L, v)]
    return np.where(_fewest_packs(end_b)[fits] >= n - 1, per_s, 0.0)


def _forward_before(profile: Profile, uf: list[int], starts: np.ndarray) -> np.ndarray:
    """Per criterion start s, the forward compute of the layers before it, every forward microbatch."""
    return sum(k * profile.costs("FWD", u).pack_time(0, starts - 1) for u, k in collections.Counter(uf).items())


def _reach(end: np.ndarray, pre: np.ndarray, L: float) -> np.ndarray:
    """Per start a, the last layer a pack [a, e] may end at: it fits (``end``), and its prefix-summed
    ``pre`` (the microbatches' compute beyond one) is at most L."""
    if L == math.inf:
        return end
    top = np.searchsorted(pre, pre[:-1] + L * (1 + 1e-12), side="right") - 2
    return np.minimum(end, np.maximum(top, np.arange(len(end)) - 1))


def _window_min(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per i, ``min(values[lo[i]: hi[i] + 1])`` (inf where empty): a sparse table, O(R log R)."""
    levels = [np.asarray(values, float)]
    while 2 ** len(levels) <= len(values):
        k = 2 ** (len(levels) - 1)
        levels.append(np.minimum(levels[-1][:-k], levels[-1][k:]))
    out = np.full(len(lo), np.inf)
    ok = hi >= lo
    lo, hi = lo[ok], hi[ok]
    level = np.floor(np.log2(hi - lo + 1)).astype(int)
    res = np.empty(len(lo))
    for j in np.unique(level):
        m = level == j
        res[m] = np.minimum(levels[j][lo[m]], levels[j][hi[m] - 2 ** j + 1])
    out[ok] = res
    return out


def _last_step(profile: Profile, hw: Hardware, bw_out: float) -> float:
    """At least what follows the last backward task's compute: layer 0's gradients leave and step
    (on the CPU, or its state too leaves after a GPU step, whichever is less)."""
    w, k_opt = profile.param_bytes(0, 0), profile.optimizer_bytes(0, 0)
    return float(min(w / bw_out + profile.cpu_update_time(0, 0) * hw.cpu_optimizer_scale,
                     (w + k_opt) / bw_out + (3 * w + 2 * k_opt) / hw.gpu_optimizer_bandwidth))


def _least_before(run: np.ndarray) -> np.ndarray:
    """Per layer a, the least of ``run`` over the layers before a (inf at 0): the cheapest way to the
    previous position when each position's pack starts past the one before."""
    return np.concatenate([[np.inf], np.minimum.accumulate(run)[:-1]])


def _fewest_packs(max_end: np.ndarray) -> np.ndarray:
    """Per boundary b, at most the fewest packs that fit (``c - 1 <= max_end[a]``) covering layers
    [0, b - 1]: greedy, each pack reaching as far as any pack starting at or before its start could
    (a relaxation where a later start may reach less far), so never more than the fewest."""
    reach = np.maximum.accumulate(np.maximum(max_end, np.arange(len(max_end)) - 1)) + 1
    ends = [0]
    while ends[-1] < len(max_end) and reach[ends[-1]] > ends[-1]:
        ends.append(int(reach[ends[-1]]))
    b = np.arange(len(max_end) + 1)
    return np.where(b <= ends[-1], np.searchsorted(np.asarray(ends), b), 10**9)


def _least_packing(max_end: np.ndarray, at_start: np.ndarray, at_top: np.ndarray, first: np.ndarray) -> np.ndarray:
    """``least[b]``: the least total cost of packing layers [0, b - 1] into packs [a, c - 1] that fit
    (``c - 1 <= max_end[a]``), a pack costing ``at_start[a] + at_top[c]``, plus ``first[c]`` for the
    one starting at layer 0 (inf where no packing exists). O(R log R): each pack start waits in a
    heap until the boundaries it reaches are passed."""
    R = len(max_end)
    reach, start, top, first = (max_end + 1).tolist(), at_start.tolist(), at_top.tolist(), first.tolist()
    least = [0.0] * R
    heap: list[tuple[float, int]] = []       # (least[a] + at_start[a], last boundary a reaches)
    for c in range(1, R):
        a = c - 1
        if a >= 1 and least[a] < math.inf:
            heapq.heappush(heap, (least[a] + start[a], reach[a]))
        while heap and heap[0][1] < c:
            heapq.heappop(heap)
        best = heap[0][0] if heap else math.inf
        if reach[0] >= c:
            best = min(best, start[0] + first[c])
        least[c] = best + top[c]
    return np.asarray(least)


def _backward_timer(profile: Profile, lam: float | None, bw_in: float, ok: np.ndarray | None = None):
    """``time(u, a, b)``: at least the backward compute of one microbatch of ``u`` samples over packs
    [a, b] (0 where empty), whatever the pack's option. Where stash may replace the recompute
    (``lam`` not None), a stashed pack's microbatch takes max(backward - forward, saved / link)
    (tasks.py) >= lam * first + (1 - lam) * second, a sum over its layers: each layer counts the
    lesser of that and its recompute (only the recompute where ``ok``, tasks.stashable_layers, says
    it has no stash variant). Every lam in [0, 1] gives a valid bound; 1 leaves out the link, 0 the
    compute saved."""
    if lam is None:
        return lambda u, a, b: profile.costs("BWD", u).pack_time(a, b)
    sums = {}

    def time(u, a, b):
        if u not in sums:
            c = profile.costs("BWD", u)
            per = np.minimum(c.time, lam * (c.time - forward_costs(profile, u).time) + (1 - lam) * c.saved / bw_in)
            per = per if ok is None else np.where(ok, per, c.time)
            sums[u] = np.concatenate([[0.0], np.cumsum(per)])
        a, b = np.asarray(a), np.asarray(b)
        return np.where(b >= a, sums[u][b + 1] - sums[u][a], 0.0)
    return time


@dataclasses.dataclass
class _Candidate:
    cfg: Config
    tasks: Tasks
    seq: list
    value: float                    # the model's iteration time (s)
    bound: float                    # a valid lower bound on the model's optimum for cfg
    floor: float                    # ... on the optimum of every variant of the model (stash, handoff)
    how: str                        # "dp", "balanced", "search", "cp-sat": what found the sequence
    solve: object = None            # cpsat.SolveResult where CP-SAT ran
    proof: str | None = None        # "dp" where the DP proved the sequence optimal for the model
    handoff: bool = False           # its plans keep gradients on the GPU (Plan.gpu_handoff)
    tight: bool = True              # ``bound`` already holds the DP's with the stash variants (_tighten)
    tight_floor: bool = True        # ``floor`` already holds the DP's on every variant (_tighten)
    pathed: bool = False            # vPP: ``bound`` already holds pipeline_path_bound's (_tighten)


@dataclasses.dataclass
class _Search:
    """What every phase of one ``plan()`` call reads: the inputs, the options, the budget."""

    profile: Profile
    hw: Hardware
    batch: int
    cap: int
    opts: PlannerOptions
    budget: Budget
    say: object
    ident: dict
    host_check: bool = False        # some plan could exceed the host's memory budgets (host_memory.may_bind)
    host_error: InfeasibleError | None = None   # the least host memory overrun of a plan judged
    host_blocked: list = dataclasses.field(default_factory=list)   # configurations without a plan that fits
    pool: concurrent.futures.Executor | None = None    # other processes (_processes), or None
    events: dict = dataclasses.field(default_factory=dict)    # plan decisions -> events its simulation played

    @property
    def options(self) -> bool:          # per-pack options searched at all
        return self.opts.options and not self.opts.harmony_space

    def handoff(self, cfg: Config) -> bool:
        """Whether plans of ``cfg`` may keep gradients on the GPU (Plan.gpu_handoff): one GPU runs
        the whole chain and a backward pack holds one microbatch (not in Harmony's space or under
        Harmony's cost model, which has no such rule)."""
        if not self.opts.gpu_handoff or self.opts.harmony_space or self.opts.cost_model != "default":
            return False
        shares = [self.batch] if cfg.mode == "vPP" else data_shares(self.batch, cfg.gpus)
        return cfg.ranks == 1 and any(len(split_microbatches(n, cfg.u_bwd)) == 1 for n in shares)

    def stash(self, cfg: Config) -> bool:
        """Whether stash variants are searched for ``cfg``: coupled memory limits them to small
        models, and in vPP to the layers whose saved activations the shared link moves faster than
        they are recomputed (tasks.stashable_layers)."""
        if not (self.options and self.profile.num_layers <= MAX_LAYERS_WITH_STASH):
            return False
        if cfg.u_fwd != cfg.u_bwd:     # a stashed autograd graph cannot be re-batched: the runtime would run
            return False                # the pack's backward at the forward's microbatch, as no model here does
        uf, ub = (split_microbatches(self.batch, u) for u in (cfg.u_fwd, cfg.u_bwd))
        return cfg.ranks == 1 or bool(stashable_layers(self.profile, self.hw, cfg, uf, ub).any())

    @property
    def timeline_share(self) -> float:  # of the budget, kept for the timeline model
        return 0.15 if self.opts.cost_model == "default" else 0.0

    def timeline_reserve(self, plan_: Plan) -> float:
        """Work seconds to keep for the timeline model of ``plan_``: its size, plus a short search."""
        if self.timeline_share <= 0:
            return 0.0
        events = self.events_of(plan_)
        short = max(0.3, 0.1 * timeline_slowness(events))
        return min(0.3 * self.budget.total, Budget.PER_TIMELINE_EVENT * events + short)

    def events_of(self, plan_: Plan) -> int:
        """The events the simulator plays for ``plan_``: remembered from its judging, else counted (the
        simulator's expansion, without playing it)."""
        key = _decisions(plan_)
        if key not in self.events:
            self.events[key] = count_events(plan_, self.profile, self.hw)
        return self.events[key]

    def tasks(self, cfg: Config, stash: bool = False, cuts=None, keep=(), per_start: int = MAX_ARCS_PER_START,
              gpu_handoff: bool = False) -> Tasks:
        tasks = build_tasks(self.profile, self.hw, self.batch, cfg, self.cap, gpu_opt=self.options, stash=stash,
                            cuts=candidate_cuts(self.profile, cfg.u_bwd, keep=keep) if cuts is None else cuts,
                            per_start=per_start, gpu_handoff=gpu_handoff)
        self.budget.spend(Budget.PER_CONFIG + Budget.PER_ROW * len(tasks.table))
        return tasks

    def plan_of(self, c: _Candidate, seq) -> Plan:
        f, b, o = packs_of(c.tasks, seq)
        return Plan("cp-sat", c.cfg.mode, c.cfg.gpus, self.batch, c.cfg.u_fwd, c.cfg.u_bwd, f, b,
                    c.tasks.num_layers, options=tuple(PackOptions(r, "gpu" if g else "cpu") for r, g in o),
                    allow_uneven=self.opts.uneven, gpu_handoff=c.handoff, memory_cap=self.cap,
                    cost_model=self.opts.cost_model, **self.ident)

    def judge(self, plan_: Plan, result: tuple[float, int] | None = None) -> float:
        """Simulated iteration time (inf if the simulator rejects the plan), charged to the budget by
        the events the simulator played; ``result``: ``played``'s, where another process simulated."""
        t, events = played(plan_, self.profile, self.hw, self.opts.cost_model) if result is None else result
        self.budget.spend(Budget.simulation(events, self.opts.cost_model))
        if events and self.opts.cost_model == "default":
            self.events[_decisions(plan_)] = events
        return t if math.isinf(t) or self.fits_host(plan_) else float("inf")

    def fits_host(self, plan_: Plan) -> bool:
        """Whether ``plan_``'s host memory fits the host's budgets; keeps the least overrun for the
        explanation where no plan fits."""
        if not self.host_check:
            return True
        try:
            require_fits(plan_, self.profile, self.hw, f"plan {plan_.mode} x{plan_.gpus} u={plan_.microbatch_fwd}/"
                                                       f"{plan_.microbatch_bwd} of {self.profile.name} at minibatch "
                                                       f"{self.batch}")
        except InfeasibleError as e:
            if self.host_error is None or e.needed_bytes < self.host_error.needed_bytes:
                self.host_error = e
            return False
        return True

    @staticmethod
    def shown(t: float) -> str:
        return f"{t:.4f} s" if math.isfinite(t) else "not playable (over the GPU or host memory)"

    def infeasible(self) -> InfeasibleError:
        if self.host_error is not None:
            return self.host_error
        # where the host memory may be why: the least any configuration searched needs (dp.least_host)
        least = min((m for m in (dp.least_host(self.tasks(c)) for c in self.host_blocked) if m is not None),
                    default=None)
        if least is not None:
            need = dataclasses.replace(model_host_memory(self.profile), activations=least * MEM_UNIT)
            try:
                need.check(self.hw, f"every plan of {self.profile.name} at minibatch {self.batch} searched")
            except InfeasibleError as e:
                return e
        return explain_infeasible(self.profile, self.cap,
                                  feasible_sizes(self.profile, self.batch, "vDP", self.hw.gpus, "FWD"),
                                  feasible_sizes(self.profile, self.batch, "vDP", self.hw.gpus, "BWD"))


_FORKED: _Search | None = None      # in a process of _processes: the search it was forked from


def _decisions(p: Plan) -> tuple:
    """What the simulator plays of a plan."""
    return (p.mode, p.gpus, p.microbatch_fwd, p.microbatch_bwd, p.packs_fwd, p.packs_bwd, p.options, p.gpu_handoff)


def _forked(S: _Search) -> None:
    global _FORKED
    _FORKED = S


def _play(plan_: Plan) -> tuple[float, int]:
    """``played`` of ``plan_`` in a process of _processes."""
    return played(plan_, _FORKED.profile, _FORKED.hw, _FORKED.opts.cost_model)


@contextlib.contextmanager
def _processes(S: _Search):
    """``S.opts.processes`` processes for Harmony's hint, the first solutions, the local search and the
    simulator's descent, forked from this one (so they start in milliseconds and hold the profile without
    unpickling it), as ``S.pool``; None for one process. The search is pure Python: only processes
    run two parts of it at once. Each step takes their results in the order one process would
    compute them, so the plan does not depend on ``processes``. Linux only (forking a process with
    threads is unsafe on macOS): elsewhere one process does it all, to the same plan."""
    if S.opts.processes <= 1 or not sys.platform.startswith("linux"):
        yield
        return
    S.pool = concurrent.futures.ProcessPoolExecutor(S.opts.processes, mp_context=multiprocessing.get_context("fork"),
                                                    initializer=_forked, initargs=(S,))
    try:
        yield
    finally:
        S.pool.shutdown(wait=False, cancel_futures=True)   # a step that stopped early leaves no wait
        S.pool = None


def _harmony(S: _Search) -> Plan | None:
    """Harmony's search in the modes asked for, the best by the simulator (published packing
    heuristics; all of them in Harmony's space): the incumbent and the hint."""
    best = None
    for mode in (("vPP", "vDP") if S.opts.mode == "auto" else (S.opts.mode,)):
        try:
            packing = "all" if S.opts.harmony_space else "published"
            hp = plan_harmony(S.profile, S.hw, S.batch, S.cap, mode=mode, gpus=S.opts.gpus or S.hw.gpus,
                              packing_fwd=packing, packing_bwd=packing, cost_model=S.opts.cost_model,
                              play_many=None if S.pool is None else functools.partial(S.pool.map, _play))
        except HarmonyOptError:
            continue
        # its candidates' simulations, by the cost model's simulator, and its packing work
        runs = hp.stats["configs_evaluated"]
        S.budget.spend(Budget.simulation(hp.stats["events_simulated"], S.opts.cost_model, runs)
                       + runs * Budget.PER_PACKING * S.profile.num_layers)
        if hp.simulated_iteration_time_s is not None and (
                best is None or hp.simulated_iteration_time_s < best.simulated_iteration_time_s):
            best = hp
    if best is not None:
        S.say(f"hint: Harmony's search, {best.mode} x{best.gpus} u={best.microbatch_fwd}/{best.microbatch_bwd}: "
              f"{best.simulated_iteration_time_s:.4f} s simulated")
    return best


def _first_solutions(S: _Search, ordered, total: int, incumbent: Plan | None, stats: dict):
    """Step 2: a first solution per configuration in bound order (``ordered``: (configuration,
    bound, bounds computed so far) triples, ``total`` of them), until the bound reaches the best model
    value (the rest is pruned) or the budget share runs out. Returns (candidates, the least bound of
    the configurations not reached).

    With other processes (S.pool), the next configurations' first solutions are computed ahead,
    one per process, as in ``_first_ahead``; each is charged and checked here in order as if it
    were computed here, and those the search does not reach are dropped."""
    hint_cfg = None if incumbent is None else Config.of(incumbent)
    found, best_value = [], float("inf")
    stream, queued, ahead = iter(ordered), collections.deque(), {}
    charged = 0
    for i in range(total):
        while S.pool is not None and len(queued) <= S.opts.processes:      # the next ones, ahead
            item = next(stream, None)
            if item is None:
                break
            queued.append(item)
            if item[1] < best_value:        # not where the bound prunes it already
                ahead[item[0]] = S.pool.submit(_first_ahead, item[0], incumbent, hint_cfg)
        item = queued.popleft() if queued else next(stream, None)
        if item is None:
            break
        cfg, cfg_bound, computed = item
        S.budget.spend(Budget.PER_BOUND * (computed - charged))     # where it is taken, not read ahead
        charged = computed
        if cfg_bound >= best_value:
            stats["pruned"] += total - i
            break
        if S.budget.left(0.45) <= 0 and found:     # at least one, where the hint took the share
            stats["out_of_budget"] += total - i
            _drop(ahead)
            return found, cfg_bound
        r = ahead.pop(cfg).result() if cfg in ahead else None
        if r is None:
            tasks, first = _first_of(S, cfg, incumbent, hint_cfg)
            rows, host = len(tasks.table), tasks.host_budget is not None
        else:
            spent, first, rows, host = r
            for seconds in spent:
                S.budget.spend(seconds)
            tasks = None
        if first is None or not np.isfinite(first[0]):
            stats["infeasible"] += 1
            if host and rows:
                S.host_blocked.append(cfg)      # for the explanation, should nothing fit
            continue
        if tasks is None:       # built in the other process, charged with it: the same table again
            tasks = _first_tasks(dataclasses.replace(S, budget=Budget(S.budget.total)), cfg, incumbent, hint_cfg)
        stats["evaluated"] += 1
        value, seq, dp_bound = first
        # the DP's optimum bounds the configuration where no stash variant could beat it, and every
        # variant of the model where plans cannot keep gradients on the GPU either (_tighten)
        chain_ = cfg.ranks == 1
        bound = max(cfg_bound, dp_bound if dp_bound is not None and not S.stash(cfg) else 0.0)
        kept = chain_ and S.handoff(cfg)
        found.append(_Candidate(cfg, tasks, seq, value, bound, cfg_bound if kept else bound,
                                "dp" if dp_bound is not None else "balanced",
                                tight=not (chain_ and S.stash(cfg)), tight_floor=not kept))
        if value < best_value:
            best_value = value
            S.say(f"[{i + 1}/{total}] {cfg}: model {value:.4f} s  <- best so far")
    _drop(ahead)
    return found, float("inf")


def _first_tasks(S: _Search, cfg: Config, incumbent: Plan | None, hint_cfg: Config | None) -> Tasks:
    """The candidate tasks of ``cfg``, charged to ``S.budget``; the hint's configuration keeps the
    hint's pack boundaries."""
    return S.tasks(cfg, keep=pack_starts(incumbent) if cfg == hint_cfg else ())


def _first_of(S: _Search, cfg: Config, incumbent: Plan | None, hint_cfg: Config | None):
    """(``_first_tasks``, the first solution or None), charged to ``S.budget``; the hint's
    configuration starts from the hint."""
    tasks = _first_tasks(S, cfg, incumbent, hint_cfg)
    hint = None
    if cfg == hint_cfg:
        try:
            hint = sequence_of_plan(tasks, incumbent)
        except KeyError:
            pass
    return tasks, (_first_solution(S, tasks, hint) if len(tasks.table) else None)


class _NeedsBudget(Exception):
    """A step that reads the budget (what is left), which a process computing ahead cannot know."""


class _Tally(Budget):
    """A budget that lists what is spent (to be spent again, one by one, in the planner's own
    process: the same float sums) and cannot say what is left."""

    def __init__(self, total: float):
        super().__init__(total)
        self.spent = []

    def spend(self, seconds: float) -> None:
        super().spend(seconds)
        self.spent.append(seconds)

    def left(self, share: float = 1.0, reserve: float = 0.0) -> float:
        raise _NeedsBudget


def _first_ahead(cfg: Config, incumbent: Plan | None, hint_cfg: Config | None):
    """In a process of _processes: (work seconds spent, first solution, task rows, whether the host
    budget may bind) of ``cfg``; None where the first solution reads the budget (a DP priced into
    the host memory, dp.within_host), left to the planner's own process."""
    S = dataclasses.replace(_FORKED, budget=_Tally(_FORKED.budget.total), pool=None)
    try:
        tasks, first = _first_of(S, cfg, incumbent, hint_cfg)
    except _NeedsBudget:
        return None
    return S.budget.spent, first, len(tasks.table), tasks.host_budget is not None


def _drop(ahead: dict) -> None:
    """Cancel the work computed ahead that the search did not reach."""
    for f in ahead.values():
        f.cancel()


def _first_solution(S: _Search, tasks: Tasks, hint):
    """(model value, sequence, bound or None) of a first solution: the DP's optimum for a chain,
    which also bounds the model's optimum over the plans without stash variants or kept
    gradients (the DP leaves out the link floors, the forward queue and the waits for the task two
    back, which can only add); the best of the hint
    and balanced packs in vPP (search.py), improved later."""
    if tasks.cfg.ranks == 1:
        S.budget.spend(Budget.dp(tasks))
        r = dp.solve_chain(tasks)
        if r is None:
            return None
        value = evaluate(tasks, r[1])
        if math.isinf(value) and tasks.host_budget is not None:     # its activation buffers overflow the host
            return dp.within_host(tasks, r, lambda: _afford_dp(S, tasks))
        return value, r[1], r[0]
    starts, work = search.starts(tasks, S.profile, hint)
    S.budget.spend(Budget.PER_START * work)
    return (starts[0][0], starts[0][1], None) if starts else None


def _afford_dp(S: _Search, tasks: Tasks) -> bool:
    """Charge one more DP over ``tasks``; whether the budget has some left."""
    S.budget.spend(Budget.dp(tasks))
    return S.budget.left() > 0


def _tighten(S: _Search, c: _Candidate, floor: bool = False) -> None:
    """A vPP configuration's bound from its serial paths (``pipeline_path_bound``). A chain
    configuration's bounds from the DP: with the stash variants, their memory coupling left
    out (dp.py), the DP's optimum bounds every plan of the model searched (``bound``); with gradients
    kept on the GPU too, whose every cost is at most the plain model's, every plan of every variant
    (``floor``, with ``floor=True``). Milliseconds per configuration; run where it can matter: the
    CP-SAT candidates (is the DP solution already optimal?) and the configuration holding the bound
    over all of them down."""
    if c.cfg.ranks > 1:
        if not c.pathed:
            c.pathed = True
            value = pipeline_path_bound(S.profile, S.hw, S.batch, c.cfg, S.cap, S.stash(c.cfg), upto=c.value)
            S.budget.spend(Budget.PER_PATH_LAYER * S.profile.num_layers)
            # at most the value in ticks (timing.py rounds each task's times to 100 us)
            c.bound = c.floor = max(c.bound, min(value, c.value))
        return
    for kept in [k for k, todo in ((False, not c.tight), (True, floor and not c.tight_floor)) if todo]:
        tasks = build_tasks(S.profile, S.hw, S.batch, c.cfg, S.cap, gpu_opt=S.options, stash=S.stash(c.cfg),
                            cuts=c.tasks.cuts, gpu_handoff=kept)
        S.budget.spend(Budget.PER_ROW * len(tasks.table) + Budget.dp(tasks))
        r = dp.solve_chain(tasks, relax_stash=True)
        if r is not None and tasks.host_budget is not None:     # the Lagrangian bound of the host budget
            r = dp.within_host(tasks, r, lambda: _afford_dp(S, tasks), steps=3, relax_stash=True)
            r = None if r is None else (r[2], r[1])
        value = r[0] if r is not None else float("inf")
        if kept:
            c.tight_floor, c.floor = True, max(c.floor, value)
        else:
            c.tight, c.bound = True, max(c.bound, value)
            if c.tight_floor:           # no variant with kept gradients: the same bound
                c.floor = max(c.floor, value)


def _local_search(S: _Search, found: list[_Candidate]) -> None:
    """Local search on the three most promising vPP configurations (a chain's DP solution is optimal),
    after the one of lowest bound if it is not among them: a first solution rates a configuration
    of few microbatches far above what its packs can reach (resnet1026 D=64 vPP x4 u=16/16: first
    4.0 s, fourth of the vPP configurations, 3.75 s after the search; its bound is the lowest, and
    the space's gap rests on it)."""
    vpp = sorted((c for c in found if c.cfg.ranks > 1), key=lambda c: (c.value, str(c.cfg)))
    steps = 2000 if S.opts.time_limit >= 5 else 600
    lowest = min(vpp, key=lambda c: (c.bound, str(c.cfg)), default=None)
    extra = [lowest] if lowest is not None and all(lowest is not c for c in vpp[:3]) else []
    todo = extra + vpp[:3]      # the lowest bound first: the budget may not reach the fourth
    # and from the packs that minimise the largest pack (search.partitioned): where the model rates
    # that better, the first solution stays a candidate too, and the simulator judges both. Not
    # under Harmony's cost model, whose simulator the model does not describe: it plays such
    # many-pack plans far slower than rated (resnet1026 D=64 vPP x4: 5.88 s, model 3.81 s)
    partition = S.opts.cost_model == "default"
    ahead = [S.pool.submit(_searched_in_process, c, steps, S.opts.seed + k, partition) for k, c in enumerate(todo)] \
        if S.pool is not None else None
    for k, c in enumerate(todo):
        if S.budget.left(0.6) <= 0:
            return
        # its parts, each computed only where taken (one process) or all at once (another process),
        # taken as one process does: the same charges, the same checks between them
        parts = iter(ahead[k].result()) if ahead is not None else _searched(S, c, steps, S.opts.seed + k, partition)
        value, seq, spent = next(parts)
        S.budget.spend(spent)
        if value < c.value:
            c.value, c.seq, c.how = value, seq, "search"
        if partition and S.budget.left(0.6) > 0:
            spent, start = next(parts)
            for seconds in spent:
                S.budget.spend(seconds)
            if start < c.value and S.budget.left(0.6) > 0:  # only where it starts ahead: the descent
                value, seq, spent, tasks = next(parts)       # rarely overtakes a better start
                S.budget.spend(spent)
                if value < c.value:
                    if tasks is None:   # built and charged in the other process, which did not send it
                        tasks = _every_boundary(dataclasses.replace(S, budget=_Tally(S.budget.total), pool=None), c)[0]
                    found.append(dataclasses.replace(c))
                    c.tasks, c.value, c.seq, c.how = tasks, value, seq, "search"
        S.say(f"local search {c.cfg}: model {c.value:.4f} s (bound {c.bound:.4f})")


def _searched(S: _Search, c: _Candidate, steps: int, seed: int, partition: bool):
    """The parts of one candidate's local search, each with what it costs the budget, touching
    neither (_local_search charges and applies them), computed as they are asked for: the descent
    from ``c``'s sequence; the packings that minimise the largest pack, at every layer boundary (a
    model of more layers than candidate boundaries, tasks.candidate_cuts, is otherwise packed in
    blocks, and with as few microbatches as GPUs a pipeline idles by most of the difference between
    consecutive packs: resnet1026 D=64 vPP x4 u=16/16, 3.813 s at the 129 candidate boundaries,
    3.746 s at all 516); and the descent from the best of them, where it starts ahead."""
    value, seq, work = search.improve(c.tasks, c.seq, steps, seed=seed)
    yield value, seq, Budget.PER_STEP * steps + Budget.PER_TASK * work
    if not partition:
        return
    if value < c.value:
        c = dataclasses.replace(c, value=value, seq=seq)
    scratch = dataclasses.replace(S, budget=_Tally(S.budget.total), pool=None)     # lists _every_boundary's
    tasks, seq = _every_boundary(scratch, c)
    part, work = search.partitioned(tasks, S.profile, *search.partition_grid(tasks, seq))
    start = min(part, key=lambda o: o[0], default=(float("inf"), None))
    yield scratch.budget.spent + [Budget.PER_PARTITION + Budget.PER_START * work], start[0]
    if start[0] < c.value:
        value, seq, work = search.improve(tasks, start[1], steps, seed=seed)
        yield value, seq, Budget.PER_STEP * steps + Budget.PER_TASK * work, tasks


def _searched_in_process(c: _Candidate, steps: int, seed: int, partition: bool) -> list:
    """Every part of ``_searched``, in a process of _processes, but the table of every boundary, which
    the planner's process builds again where it takes the descent's result: sending it back costs
    more (resnet1026: 250,000 tasks, 35 MB)."""
    parts = list(_searched(_FORKED, c, steps, seed, partition))
    if len(parts) == 3:
        parts[2] = (*parts[2][:3], None)
    return parts


def _every_boundary(S: _Search, c: _Candidate) -> tuple[Tasks, list]:
    """``c``'s tasks with every layer boundary a candidate and every pack that fits (not only the
    longest per start, tasks.MAX_ARCS_PER_START), and ``c``'s sequence in them."""
    R = S.profile.num_layers
    if len(c.tasks.cuts) == R + 1:      # all of them already, and at most R packs per start
        return c.tasks, c.seq
    # beyond FINE_CUTS boundaries, that many (the table grows with their square)
    cuts = candidate_cuts(S.profile, c.cfg.u_bwd, max_cuts=FINE_CUTS, keep=c.tasks.cuts)
    tasks = build_tasks(S.profile, S.hw, S.batch, c.cfg, S.cap, gpu_opt=S.options,
                        stash=bool((~c.tasks.table.recompute).any()), cuts=cuts, per_start=R)
    S.budget.spend(Budget.PER_CONFIG + 2 * Budget.PER_ROW * len(tasks.table))     # and its index
    return tasks, _carried(c, tasks)


def _carried(c: _Candidate, tasks: Tasks) -> list:
    """``c``'s sequence as rows of ``tasks``, another task table of its configuration."""
    idx = tasks.table.index()
    return [idx[c.tasks.table.key(k)] for k in c.seq]


def _cp_sat(S: _Search, found: list[_Candidate]) -> None:
    """Step 3: CP-SAT on the four most promising configurations, with the stash variants, from the
    first solution as a complete hint. A chain whose DP optimum already meets the link floors is
    skipped (proven optimal by the DP where the forward queue and the waits two back, which neither
    counts, do not bind); a vPP model too large for the budget is left to the local search."""
    best = {}
    for c in sorted(found, key=lambda c: (c.value, str(c.cfg))):
        best.setdefault(c.cfg, c)          # one solve per configuration, from its best solution
    for c in list(best.values())[:4]:
        left = S.budget.left(0.85 - S.timeline_share)
        if left <= 0.1:
            return
        _tighten(S, c)
        if c.cfg.ranks == 1 and c.how == "dp" and evaluate(c.tasks, c.seq, pairwise=True) <= c.bound + 1e-9:
            # the DP's optimum with every variant meets what the chain model counts: nothing for CP-SAT
            # to improve (it leaves out the forward queue and the waits two back, too)
            if c.value <= c.bound + 1e-9:
                c.proof = "dp"
            continue
        tasks, seq = c.tasks, c.seq
        if S.stash(c.cfg):
            # the same candidate packs as ``c``'s (its packs at every layer boundary, _every_boundary,
            # are not all among the longest per start)
            tasks = S.tasks(c.cfg, stash=True, cuts=c.tasks.cuts, per_start=c.tasks.per_start)
            seq = _carried(c, tasks)
        lay, size = None, len(tasks.table)
        if c.cfg.ranks > 1:
            nf = sum(1 for k in seq if tasks.table.kind[k] == 0)
            lay = pipeline.layout(tasks, nf + 2 * c.cfg.ranks, len(seq) - nf + 2 * c.cfg.ranks,
                                  most=MAX_PIPELINE_VARIABLES)
            if lay is None:
                continue
            size = sum(len(r) for r in lay.rows)
        build_cost = Budget.PER_MODEL_ROW * size + Budget.PER_SOLVE
        limit = min(left - build_cost, 0.4 * S.budget.total)
        if limit < 0.2:
            continue
        S.budget.spend(build_cost)
        limits = S.budget.cp_sat_limits(limit, 0.85 - S.timeline_share)
        common = dict(**limits, seed=S.opts.seed, workers=S.opts.workers, rel_gap=S.opts.rel_gap, hint=seq,
                      report=S.say, label=str(c.cfg))
        res = chain.solve(tasks, **common) if lay is None else pipeline.solve(tasks, layout_=lay, **common)
        S.budget.spend(res.deterministic_time)
        S.budget.solved(res.status, res.wall_time, limits)
        c.solve = res
        if res.objective is not None:
            v = evaluate(tasks, res.sequence)
            if v < c.value and c.cfg.ranks > 1:
                # the vPP model can be far off where CP-SAT exploits it: the simulator sees both
                found.append(dataclasses.replace(c, solve=None))
            if v < c.value or (v == c.value and c.cfg.ranks == 1):
                # credited to CP-SAT where it improved the solution (or proved a chain's optimum)
                c.tasks, c.seq, c.value, c.how = tasks, res.sequence, v, "cp-sat"
            if c.cfg.ranks == 1:
                # a bound on every plan of the configuration (vPP: only on plans with at most the
                # positions the model was given, so it is not used)
                c.bound = max(c.bound, res.bound)
        shown = "no solution" if res.objective is None else f"{res.objective:.4f} s"
        S.say(f"CP-SAT {c.cfg}: {res.status.lower()}, {shown}, bound {res.bound:.4f} s")


def _judge_candidates(S: _Search, found: list[_Candidate], incumbent: Plan | None):
    """Step 4: simulate the best candidates (at least two, then while the model rates them within
    SIMULATE_WITHIN of the best); the fastest wins, Harmony's plan being the incumbent. Returns
    (plan, simulated time, its candidate or None when Harmony's plan stayed the best)."""
    best_plan, best_c = incumbent, None
    best_t = incumbent.simulated_iteration_time_s if incumbent is not None else float("inf")
    found.sort(key=lambda c: (c.value, str(c.cfg)))
    for k, c in enumerate(found[:12]):
        if k >= 2 and (S.budget.left(1.0 - S.timeline_share) <= 0 or c.value > SIMULATE_WITHIN * found[0].value):
            break
        cand = S.plan_of(c, c.seq)
        t = S.judge(cand)
        S.say(f"simulated {c.cfg} ({c.how}): {S.shown(t)} (model {c.value:.4f} s)"
              + ("  <- best" if t < best_t else ""))
        if t < best_t:
            best_plan, best_t, best_c = cand, t, c
        if S.handoff(c.cfg):
            kept = cand.replace(gpu_handoff=True)
            t = S.judge(kept)
            S.say(f"simulated {c.cfg} ({c.how}), gradients kept on the GPU: {S.shown(t)}"
                  + ("  <- best" if t < best_t else ""))
            if t < best_t:
                best_plan, best_t, best_c = kept, t, c
    if best_plan is None:
        raise S.infeasible()
    if best_c is not None:
        best_c.handoff = best_plan.gpu_handoff
    return best_plan, best_t, best_c


def _handoff_chains(S: _Search, c: _Candidate, plan_: Plan, t_best: float) -> tuple[Plan, float]:
    """Step 4b, where the winner ``c`` is a chain whose plans may keep gradients on the GPU: the
    chains of that model itself. The search ran on the model without (where the handoffs cost link
    time, so it favours few backward packs) and only judged its chains with the gradients kept;
    with them many small backward packs are cheap, until the checkpoints they stash during the
    forward fill the shared link: a phase floor, which the DP leaves out. So the DP runs on that
    model with the binding link traffic priced (``theta`` ticks per tick of it, a Lagrangian term),
    theta doubling until the floor no longer binds, and the simulator judges each distinct chain
    (vgg416, D=64, vDP on 4 GPUs, u=8/16: 8.109 s found before; these chains play in 8.08-8.24 s, and
    the simulator's descent from the fastest reaches 8.011 s within the budget). Updates ``c`` where
    one is faster."""
    tasks = S.tasks(c.cfg, cuts=c.tasks.cuts, gpu_handoff=True)
    d = tasks.ticks()
    bwd = d["backward"].astype(bool)
    terms = {"forward in": np.where(bwd, 0, d["link_in"]), "forward out": d["link_out_fwd"],
             "backward in": np.where(bwd, d["link_in"], 0), "backward out": d["link_out"] - d["link_out_fwd"]}

    def binding(seq) -> np.ndarray | None:
        """The link traffic of the phases whose floor ``seq`` reaches (pairwise), or None: of each such
        phase, the direction its floor (the larger of the two) counts. None too where ``seq`` does not
        fit the host's memory (the DP does not count it), which ends the pricing there."""
        parts = phase_parts(tasks, seq, pairwise=True)
        if parts is None:
            return None
        fwd_part, fwd_link, bwd_part, bwd_link = parts
        cols = [max(pair, key=lambda k: int(terms[k][seq].sum())) for pair, part, link in
                ((("forward in", "forward out"), fwd_part, fwd_link), (("backward in", "backward out"), bwd_part,
                                                                        bwd_link)) if link > part]
        return sum(terms[k] for k in cols) if cols else None
    chains, priced = [], None
    for theta in HANDOFF_PRICES:
        if not _afford_dp(S, tasks):
            break
        r = dp.solve_chain(tasks, price=None if theta == 0 else np.floor(theta * priced).astype(np.int64))
        if r is None:
            break
        seq = r[1]
        value = evaluate(tasks, seq)
        S.budget.spend(Budget.PER_TASK * len(seq))
        if np.isfinite(value) and seq not in [s for s, _ in chains]:
            chains.append((seq, value))
        cols = binding(seq)
        if cols is None:            # no floor binds: a higher price only trades time for traffic
            break
        if theta == 0:
            priced = cols
    if not chains:
        return plan_, t_best
    chains.sort(key=lambda sv: sv[1])       # the best rated first (stable: in the order of their price)
    kept = dataclasses.replace(c, tasks=tasks, handoff=True)
    cands = [S.plan_of(kept, seq) for seq, _ in chains]
    # kept for the timeline model of whichever plan wins: the one of most packs has the most events
    reserve = max(S.timeline_reserve(p) for p in (plan_, max(cands, key=lambda p: len(p.packs_fwd) + len(p.packs_bwd))))
    if S.budget.left(reserve=reserve) <= 0:
        return plan_, t_best
    results = list(S.pool.map(_play, cands)) if S.pool is not None else [None] * len(cands)
    for j, ((seq, value), cand, result) in enumerate(zip(chains, cands, results)):
        if j and S.budget.left(reserve=reserve) <= 0:
            break
        t = S.judge(cand, result)
        S.say(f"simulated {c.cfg} (dp with gradients kept on the GPU, link priced): {S.shown(t)} (model {value:.4f} s)"
              + ("  <- best" if t < t_best * (1 - 1e-9) else ""))
        if t < t_best * (1 - 1e-9):
            plan_, t_best = cand, t
            c.tasks, c.seq, c.value, c.how, c.proof, c.solve, c.handoff = tasks, seq, value, "dp, link priced", None, \
                None, True
    return plan_, t_best


def _with_handoff(S: _Search, c: _Candidate) -> None:
    """The model of ``c``'s configuration with gradients kept on the GPU (tasks.py), for a candidate
    whose plan keeps them: its value there, and a bound valid for that model (``c.floor``: the DP's
    optimum of that model with every stash variant, or the cheap bound). The search itself ran on
    the model without (it describes the simulator more closely where many backward packs stash
    inputs during the forward, which the kept handoffs would otherwise make cheap; docs/planner.md)."""
    stash = bool((~c.tasks.table.recompute).any())
    tasks = build_tasks(S.profile, S.hw, S.batch, c.cfg, S.cap, gpu_opt=S.options, stash=stash, cuts=c.tasks.cuts,
                        gpu_handoff=True)
    seq = _carried(c, tasks)
    _tighten(S, c, floor=True)
    c.tasks, c.seq, c.value, c.bound, c.proof, c.solve = tasks, seq, evaluate(tasks, seq), c.floor, None, None
    c.how = f"{c.how}, gradients kept on the GPU"
    if c.value <= c.bound + 1e-9:
        c.proof = "dp"


def _polish(S: _Search, c: _Candidate, plan_: Plan, t_best: float, found: list[_Candidate]) -> tuple[Plan, float]:
    """Step 5: first-improvement descent judged by the simulator (the model is a few % off in
    places): move one pack boundary by one candidate boundary, or toggle one pack's optimizer
    placement (search.neighbours, a fixed order); stop at a local optimum or when the budget share
    is spent. The scan goes on from the neighbour that improved (the same move often improves
    again) instead of starting over, and a plan simulated once is not simulated again: it was
    slower than the best then, and the best only gets faster. Updates ``c``.

    With ``processes`` > 1 the next neighbours in the scan are simulated at once, one per process,
    and their results taken in scan order as one process would take them: a result after an
    improving neighbour is dropped, not charged, so the plan does not depend on ``processes``."""
    # kept: the timeline model's share, and the vPP path bounds the report may need (_tighten)
    loose = sum(1 for f in found if f.cfg.ranks > 1 and not f.pathed and f.bound < c.value)
    reserve = S.timeline_reserve(plan_) + Budget.PER_PATH_LAYER * S.profile.num_layers * min(loose, 4)
    judged = {tuple(c.seq)}
    at = 0              # where the scan goes on: the position of the last improving move
    pool = S.pool
    width = S.opts.processes if pool is not None else 1
    improved = True
    while improved:
        improved = False
        moves = list(search.neighbours(c.tasks, c.seq))
        keys = [tuple(m) for m in moves]
        scan, seen = [], set(judged)
        for k in range(len(moves)):         # the neighbours not simulated yet, in scan order
            i = (at + k) % len(moves)
            if keys[i] not in seen:
                seen.add(keys[i])
                scan.append(i)
        for first in range(0, len(scan), width):
            batch = scan[first:first + width]
            if S.budget.left(reserve=reserve) <= 0:
                return plan_, t_best
            cands = [S.plan_of(c, moves[i]) for i in batch]
            results = list(pool.map(_play, cands)) if pool is not None else [None] * len(cands)
            for j, (i, cand, result) in enumerate(zip(batch, cands, results)):
                if j and S.budget.left(reserve=reserve) <= 0:
                    return plan_, t_best
                seq = moves[i]
                judged.add(keys[i])
                t = S.judge(cand, result)
                S.budget.spend(Budget.PER_TASK * len(seq))
                if t < t_best * (1 - 1e-9):
                    S.say(f"simulated neighbour of {c.cfg}: {t:.4f} s  <- best")
                    plan_, t_best, at = cand, t, i
                    c.seq, c.value, c.how, c.proof = seq, evaluate(c.tasks, seq), "polish", None
                    improved = True
                    break
            if improved:
                break
    return plan_, t_best


def timeline_slowness(events: int) -> float:
    """Wall seconds per deterministic second of CP-SAT on the timeline model of ``events`` events, as
    the budget counts them: measured 0.4-1.3 at 500-1,500 events, 3.8 at 9,900 (vPP on 4 GPUs) and
    11 at 7,900 (vDP on 8) in session 22; 2.5-3.0 at 174-2,092 events in a slow hour of session 29."""
    return max(2.5, events / 1000)


def _timeline(S: _Search, plan_: Plan) -> tuple[dict | None, object]:
    """Step 6: the timeline model of the plan's events, with what is left of the budget, at most a
    tenth of the time limit: its deterministic second costs 0.4-6 wall seconds depending on the plan
    (gpt2_xl D=7 on 4 GPUs, 387 events: 6), so a short limit is not overrun by a model that only
    reports on the plan. Returns its report and result."""
    tr = _solve_timeline(S, plan_)
    if tr is None:
        return None, None
    return {"status": tr.status, "objective": tr.makespan_s, "bound": tr.bound_s, "gap": tr.gap,
            "order_bound": tr.order_bound_s, "order_gap": tr.order_gap, "events": tr.events,
            "wall_time_s": tr.wall_time}, tr


def _solve_timeline(S: _Search, plan_: Plan, **kw):
    """solve_timeline under the budget (see _timeline); None where too little of it is left, or under
    Harmony's cost model (the model schedules the default simulator's events)."""
    if S.timeline_share <= 0:
        return None
    events = S.events_of(plan_)
    slow = timeline_slowness(events)
    limit = min(1.0, 0.1 * S.opts.time_limit, (S.budget.left() - Budget.PER_TIMELINE_EVENT * events) / slow)
    if limit < 0.05:
        return None
    S.budget.spend(Budget.PER_TIMELINE_EVENT * events + limit * slow)
    limits = S.budget.cp_sat_limits(limit)
    if limits["wall_limit"] is not None:        # the model's building counts against the wall too
        limits["wall_limit"] = max(0.05, limits["wall_limit"] - Budget.PER_TIMELINE_EVENT * events)
    tr = solve_timeline(plan_, S.profile, S.hw, **limits, seed=S.opts.seed, workers=S.opts.workers, report=S.say,
                        rel_gap=TIMELINE_REL_GAP, **kw)
    S.budget.solved(tr.status, tr.wall_time, limits)
    return tr


def _transfer_order(S: _Search, plan_: Plan, t: float, fixed) -> tuple[Plan, float, dict | None]:
    """Step 7: the order of the swaps. Where the bound over every order of the transfers leaves more
    than TIMELINE_REL_GAP below the simulated time and budget is left, the timeline model also
    chooses the order of the streams a plan carries (``order="carried"``), from its schedule in the
    rule's order; the plan carries that order (Plan.transfer_order) where the simulator, the judge,
    plays it faster. On the benchmark's plans the search mostly spends the budget first, so this
    runs where it finished early (resnet1026 D=32 on 2 GPUs: 3.5512 -> 3.5396 s)."""
    if fixed is None or not fixed.starts or not math.isfinite(t) or 1 - fixed.order_bound_s / t <= TIMELINE_REL_GAP:
        return plan_, t, None
    tr = _solve_timeline(S, plan_, order="carried", hint=fixed.starts)
    if tr is None or not tr.starts:
        return plan_, t, None
    report = {"status": tr.status, "objective": tr.makespan_s, "bound": tr.bound_s, "wall_time_s": tr.wall_time,
              "streams": 0, "simulated": None, "rule_simulated": t, "kept": False}
    order = tr.order if tr.makespan_s < t else None
    if order is not None and not _issuable(plan_.replace(transfer_order=order)):
        S.say("transfer order of the timeline model: the compiler cannot issue it (a transfer would come "
              "before what it moves is made): kept the rule's")
        report["not_issuable"] = True
        order = None
    if order is not None:
        ordered = plan_.replace(transfer_order=order)
        t_ordered = S.judge(ordered)
        report.update(streams=len(order), simulated=t_ordered, kept=t_ordered < t)
        S.say(f"transfer order of the timeline model: {len(order)} stream(s) reordered, simulated "
              f"{S.shown(t_ordered)} against {S.shown(t)} in the rule's order"
              + ("" if t_ordered < t else ": kept the rule's"))
        if t_ordered < t:
            return ordered, t_ordered, report
    return plan_, t, report


def _issuable(plan_: Plan) -> bool:
    """Whether the compiler can issue ``plan_``'s transfer order (the simulator's events and the
    program's instructions differ in what they may start before: P2P, host parking)."""
    try:
        compile_plan(plan_)
    except PlanError:
        return False
    return True


def _space_bound(S: _Search, found: list[_Candidate], open_bound: float, most: int = 64) -> float:
    """The bound over the searched space: every evaluated configuration's own bound and the cheap
    bound of those not reached. A configuration whose plans may keep gradients on the GPU was
    searched on the model without, so for it only the bound of every variant of the model holds.
    While the lowest is one that ``_tighten`` could raise, it does (at most ``most`` times)."""
    on_floor = {id(c): not c.handoff and S.handoff(c.cfg) for c in found}

    def held(c):
        return c.floor if on_floor[id(c)] else c.bound

    def loose(c):
        if c.cfg.ranks > 1:
            return not c.pathed
        return not c.tight_floor if on_floor[id(c)] else not c.tight
    for _ in range(most):
        low = min(found, key=lambda c: (held(c), str(c.cfg)), default=None)
        if low is None or not loose(low) or held(low) >= open_bound or S.budget.left() <= 0:
            break
        _tighten(S, low, floor=on_floor[id(low)])
    return min([held(c) for c in found] + [open_bound])


def _configuration_report(S: _Search, c: _Candidate | None) -> dict | None:
    """What was proven about the chosen configuration (plan.solver["configuration"])."""
    if c is None:
        return None
    r = c.solve if c.solve is not None and c.solve.objective is not None else None
    if c.proof == "dp":
        status, proof = "OPTIMAL", "dp"
    elif (r is not None and r.status == "OPTIMAL" and c.cfg.ranks == 1 and c.how == "cp-sat"
          and c.value <= r.objective + 1e-9):       # not where what it leaves out binds (timing.py)
        status, proof = "OPTIMAL", "cp-sat"
    else:
        status, proof = "FEASIBLE", None
    conf = {"configuration": str(c.cfg), "status": status, "proof": proof, "found_by": c.how,
            "objective": c.value, "bound": c.bound, "gap": max(0.0, (c.value - c.bound) / c.value),
            "cp_sat": None if c.solve is None else {"status": c.solve.status, "wall_time_s": c.solve.wall_time}}
    if S.opts.cost_model != "default":
        # the model describes the default simulator: its proofs and bounds say nothing about another
        conf.update(status="FEASIBLE", proof=None, bound=None, gap=None)
    return conf


def plan(profile: Profile, hw: Hardware, batch: int, options: PlannerOptions | None = None, *,
         memory_cap: int | None = None, report=None) -> Plan:
    """The best plan found, with the solver's statistics in ``plan.solver``.

    Deterministic: configurations are visited in a fixed order, the heuristics use seeded
    generators and fixed step counts, CP-SAT runs under a deterministic time limit, so the same
    inputs, seed and workers give the same plan. The plan's compiled program fits the cap
    (harmony_opt.memory.fit_to_program): where the search's pack memory let through a plan whose
    program would not, it searches again under a lower cap, and refuses with the figures where
    that fails too."""
    cap = int(memory_cap or hw.gpu_memory_bytes)
    return fit_to_program(lambda c: _plan(profile, hw, batch, options, memory_cap=c, report=report), cap, profile,
                          who=f"the best plan of {profile.name}")


def _plan(profile: Profile, hw: Hardware, batch: int, options: PlannerOptions | None = None, *,
          memory_cap: int | None = None, report=None) -> Plan:
    opts = options or PlannerOptions()
    _validate(opts, hw, batch)
    # weights, gradients and optimizer state: the same in every plan
    model_host_memory(profile).check(hw, f"every plan of {profile.name}")
    t_start = time.perf_counter()
    S = _Search(profile, hw, batch, int(memory_cap or hw.gpu_memory_bytes), opts,
                # the rest: the report, and what the charges miss
                Budget(0.9 * opts.time_limit, None if opts.wall_limit is None else 0.9 * opts.wall_limit),
                report or (lambda s: None),
                {"profile": {"name": profile.name, "identity": profile.identity}, "hardware": hw.to_dict()},
                host_check=may_bind(profile, hw, batch))
    with _processes(S):
        incumbent = _harmony(S) if opts.hint else None
        harmony_t = incumbent.simulated_iteration_time_s if incumbent is not None else None
        hint_work = S.budget.used

        # 1. configurations in the order of their cheap bound, the hint's first (its value prunes early);
        # the bound is computed for those the search reaches (in_bound_order), each with the number of
        # bounds computed up to it, which _first_solutions charges as it takes them
        configs = configurations(profile, hw, batch, opts)
        S.budget.spend(Budget.PER_FLOOR * len(configs))
        floor = {c: compute_floor(profile, hw, batch, c, S.cap, S.stash(c)) for c in configs}
        configs = [c for c in configs if np.isfinite(floor[c])]
        computed = [0]

        def bound(c: Config) -> float:
            computed[0] += 1
            return config_bound(profile, hw, batch, c, S.cap, S.stash(c))
        ordered = ((c, b, computed[0]) for c, b in in_bound_order(configs, floor, bound,
                                                                  None if incumbent is None else Config.of(incumbent)))
        S.say(f"{len(configs)} configurations (mode x GPUs x microbatch sizes), visited in the order of their bound")
        stats = {"configurations": len(configs), "evaluated": 0, "pruned": 0, "infeasible": 0, "out_of_budget": 0}

        found, open_bound = _first_solutions(S, ordered, len(configs), incumbent, stats)   # 2
        if not found and incumbent is None:
            raise S.infeasible()
        _local_search(S, found)
        _cp_sat(S, found)                                                                 # 3
        best_plan, best_t, best_c = _judge_candidates(S, found, incumbent)                # 4
        if best_c is not None and best_c.cfg.ranks == 1 and S.handoff(best_c.cfg):
            best_plan, best_t = _handoff_chains(S, best_c, best_plan, best_t)
        if best_c is not None:
            best_plan, best_t = _polish(S, best_c, best_plan, best_t, found)               # 5
            if best_c.handoff:
                _with_handoff(S, best_c)
    if best_c is not None and best_c.cfg.ranks > 1:
        _tighten(S, best_c)             # the chosen configuration's proof, also where it is not the lowest
    space_bound = _space_bound(S, found, open_bound) if opts.cost_model == "default" else None
    timeline, fixed = _timeline(S, best_plan)                                              # 6
    best_plan, best_t, order = _transfer_order(S, best_plan, best_t, fixed)                # 7
    if timeline is not None:
        timeline["transfer_order"] = order

    conf = _configuration_report(S, best_c)
    if best_c is not None:
        model_value = best_c.value
    else:                                  # Harmony's plan won: its value on our model, if representable
        model_value = _model_value_of(incumbent, profile, hw, batch, S.cap)
    lb = lower_bound(profile, hw, batch, S.cap)
    solver = {
        "status": conf["status"] if conf else "NOT_SOLVED",
        "model": None if best_c is None else ("chain" if best_c.cfg.ranks == 1 else "pipeline"),
        "objective": model_value,
        "bound": space_bound,
        "gap": (model_value - space_bound) / model_value if model_value and space_bound is not None else None,
        "fidelity": abs(model_value - best_t) / best_t if model_value else None,
        "source": "harmony-hint" if best_c is None else best_c.how,
        "configuration": conf,
        "timeline": timeline,
        "wall_time_s": time.perf_counter() - t_start,
        "work_s": S.budget.used,
        "work_budget_s": S.budget.total,
        "hint_work_s": hint_work,       # of work_s: Harmony's search for the warm start
        "stopped_by_wall": S.budget.stopped_by_wall,
        "lower_bound_s": lb["bound_s"],
        "gap_to_lower_bound": (best_t - lb["bound_s"]) / best_t,
        "harmony_time_s": harmony_t,
        "speedup_over_harmony": (harmony_t / best_t) if harmony_t else None,
        **stats,
    }
    return best_plan.replace(planner="cp-sat", simulated_iteration_time_s=best_t,
                             search_time_s=time.perf_counter() - t_start, solver=solver,
                             stats={"efficiency": lb["bound_s"] / best_t})


def _model_value_of(p: Plan, profile, hw, batch, cap) -> float | None:
    """The model's iteration time of a given plan (None if one of its packs is not a candidate)."""
    cfg = Config.of(p)
    try:        # a plan without forward packs may name a forward size that is not profiled
        tasks = build_tasks(profile, hw, batch, cfg, cap, gpu_opt=True, stash=False,
                            cuts=candidate_cuts(profile, cfg.u_bwd, keep=pack_starts(p)), gpu_handoff=p.gpu_handoff)
        seq = sequence_of_plan(tasks, p)
    except (KeyError, HarmonyOptError):
        return None
    v = evaluate(tasks, seq)
    return v if np.isfinite(v) else None
