"""Baseline planners; each returns a Plan scored by the same simulator as ours.

* ``harmony``: Harmony's own search (every valid (u_fwd, u_bwd) pair x its packing
  heuristics, harmony_opt/harmony/), judged by the chosen cost model's simulator;
* ``naive-swap``: per-microbatch swapping as single-GPU memory virtualization does
  (vDNN, LMS): every microbatch sweeps every layer, weights come in every time, no
  input-batch grouping; each GPU trains on its data share (vDP);
* ``l2l``: layer-to-layer: one layer resident at a time, all microbatches through it,
  optimizer on the CPU (vDP);
* ``zero-offload``: all weights resident on the GPU, gradients and optimizer on the CPU;
  infeasible when the model does not fit.

Every baseline picks its microbatch size by simulation, skipping the sizes whose
lower bound (:func:`iteration_floor`) shows they cannot win. The registry (registry.py) names
them beside ours and holds their plans to the compiled program's memory.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from ..core.bundled import plan_ident
from ..core.errors import HarmonyOptError, InfeasibleError, PlanError, UsageError
from ..core.hardware import Hardware
from ..core.memory import check_layers_fit, max_pack_end
from ..core.plan import Plan, data_shares, split_microbatches
from ..core.profile import Profile
from ..core.units import fmt_bytes
from ..harmony import harmony_search, simulate_harmony
from ..sim.host_memory import require_fits
from ..sim.simulator import simulate


#: relative margin on the floor test: summing event durations in another order rounds differently
_FLOOR_SLACK = 1e-7


def score(plan: Plan, profile: Profile, hw: Hardware, cost_model: str = "default") -> float:
    """Simulated iteration time; inf for a plan the cost model rejects (e.g. over memory)."""
    return played(plan, profile, hw, cost_model)[0]


def played(plan: Plan, profile: Profile, hw: Hardware, cost_model: str = "default") -> tuple[float, int]:
    """(``score``, the events its simulation played: the work it took; 0 where the plan was rejected)."""
    try:
        if cost_model == "harmony":
            tl = simulate_harmony(plan, profile, with_timeline=False)
        else:
            tl = simulate(plan, profile, hw, with_timeline=False)
    except PlanError:
        return float("inf"), 0
    return tl.iteration_time, tl.meta["events"]


def feasible_sizes(profile: Profile, batch: int, mode: str, gpus: int, phase: str = "BWD",
                   divisors_only: bool = True) -> list[int]:
    """Microbatch sizes of ``phase`` to search: those up to one GPU's share whose every microbatch,
    the smaller last one of an uneven split included, is a profiled size (``divisors_only``: only
    sizes dividing every share)."""
    shares = data_shares(batch, gpus) if mode == "vDP" else [batch]
    lo, hi = profile.size_range(phase)
    return [u for u in range(lo, min(hi, min(shares)) + 1)
            if all(s % u == 0 if divisors_only else lo <= min(split_microbatches(s, u)) for s in shares)]


def iteration_floor(plan: Plan, profile: Profile, hw: Hardware) -> float:
    """Seconds that no simulation of ``plan`` can beat (0.0 where it does not apply).

    For the vDP, recompute, CPU-optimizer plans the baselines make, from the simulator's
    rules (docs/cost_model.md): each GPU runs its tasks (forward packs ascending, then
    backward packs descending; once, or once per microbatch sweep without input-batch
    grouping) on one compute stream; a task's weights come in on the weight stream, not
    before the previous task's first compute starts; a pack's output and its backward's
    input gradient go to host memory and come back for the next task; each pack's input
    is stashed to the host in the forward and brought back for its backward; weight
    gradients go to the host. Every stream runs one event at a time, and on a shared host
    link at most ``hw.link_slots`` transfers per direction run at once (per server). So the iteration
    lasts at least the longest of

    * each GPU's chain of tasks: task k starts no earlier than task k-1 started plus the
      longest of its compute, task k's weight swap-in, and task k-1's first microbatch
      plus the round trip of its output through host memory;
    * each GPU's busiest stream (compute, weight swap-ins, activation swap-ins, swap-outs);
    * each server's host link: its GPUs' transfer times over the transfers it carries at once.

    Kernel times count at the hardware's ``compute_scale``; its other execution terms only lengthen
    events or keep them apart (docs/cost_model.md), so the floor holds without them.

    Vectorized over packs. tests/test_fuzz_planners.py checks it against the simulator on
    random inputs, since the baselines skip every microbatch size whose floor exceeds the
    best time simulated so far.
    """
    if plan.mode != "vDP" or not all(o.recompute and o.optimizer == "cpu" for o in plan.options):
        return 0.0
    profile = profile.with_compute_scale(hw.compute_scale)
    try:
        floors = {k: _rank_floor(plan, profile, hw, share) for k, share in enumerate(data_shares(plan.batch, plan.gpus))
                  if share}
        ranks = list(floors.values())
    except HarmonyOptError:     # a microbatch the profile cannot cost: the simulator refuses the plan too
        return 0.0
    if not ranks:
        return 0.0
    floor = max(r[0] for r in ranks)
    if hw.shared_host_link:
        for s in range(hw.servers_used(len(ranks))):
            on = [r for k, r in floors.items() if hw.server_of(k) == s]
            floor = max(floor, sum(r[1] for r in on) / hw.link_slots, sum(r[2] for r in on) / hw.link_slots)
    return floor


def _rank_floor(plan: Plan, profile: Profile, hw: Hardware, share: int) -> tuple[float, float, float]:
    """(floor of one GPU with ``share`` samples, its host->GPU seconds, its GPU->host seconds)."""
    passes = [share] if plan.input_batch_grouping else split_microbatches(share, plan.microbatch_fwd)
    per_pass = {v: _pass_costs(plan, profile, hw, v) for v in set(passes)}
    w, c, c0, act = (np.concatenate([per_pass[v][k] for v in passes]) for k in range(4))
    h2d_w = float(np.sum(w))
    h2d_x = sum(per_pass[v][4] for v in passes)
    d2h = sum(per_pass[v][5] for v in passes)
    # task k starts >= task k-1's start + max(its compute, k's weights [prefetch: after k-1 starts;
    # without: after k-1 ends], k-1's first microbatch + its output's round trip through the host)
    wait_w = w[1:] if plan.prefetch else c[:-1] + w[1:]
    chain = float(w[0] + np.sum(np.maximum(np.maximum(c[:-1], wait_w), c0[:-1] + act[1:])) + c[-1])
    streams = max(float(np.sum(c)), h2d_w, h2d_x, d2h)
    floor = max(chain, streams) if hw.shared_host_link else max(chain, streams, h2d_w + h2d_x)
    return floor, h2d_w + h2d_x, d2h


def _pass_costs(plan: Plan, profile: Profile, hw: Hardware, v: int):
    """One pass of one GPU over ``v`` samples, per task in order (forward packs ascending, backward
    packs descending): weight swap-in s, compute s, first microbatch's compute s, round trip of
    the task's input from the previous task through the host s; and the pass's activation
    host->GPU s and GPU->host s (inputs, stashes, outputs, gradients)."""
    up, down = hw.h2d_bandwidth, hw.d2h_bandwidth
    uf, ub = split_microbatches(v, plan.microbatch_fwd), split_microbatches(v, plan.microbatch_bwd)
    fa, fb = (np.array([p[k] for p in plan.packs_fwd], dtype=np.int64) for k in (0, 1))
    ba, bb = (np.array([p[k] for p in plan.packs_bwd[::-1]], dtype=np.int64) for k in (0, 1))   # task order
    fwd = [profile.costs("FWD", u) for u in uf]
    bwd = [profile.costs("BWD", u) for u in ub]

    def weights(a, b):
        return (profile.param_bytes(a, b) + profile.buffer_bytes(a, b)).astype(np.float64) / up

    # forward tasks: input in, output out, and the inputs of the backward packs they hold stashed
    stash = np.array([p[0] for p in plan.packs_bwd[:-1]], dtype=np.int64)
    stash = stash[stash <= (fb.max() if len(fb) else -1)]
    c_f = np.sum([c.pack_time(fa, fb) for c in fwd], axis=0) if len(fa) else np.zeros(0)
    c0_f = fwd[0].pack_time(fa, fb) if len(fa) else np.zeros(0)
    act_f = fwd[0].input[fa] * (1 / down + 1 / up)
    if len(fa):
        act_f[0] = 0.0          # the first pack's input comes from the host, not from a previous task
    up_s = sum(float(np.sum(c.input[fa])) for c in fwd) / up
    down_s = sum(float(np.sum(c.input[fb + 1]) + np.sum(c.input[stash])) for c in fwd) / down
    # backward tasks: the loss pack takes the last forward output; the others their stashed input and
    # the gradient of the pack after them; each sends its input's gradient (a > 0) and its weights' out
    c_b = np.sum([c.pack_time(ba, bb) for c in bwd], axis=0)
    c0_b = bwd[0].pack_time(ba, bb)
    act_b = bwd[0].input[bb + 1] * (1 / down + 1 / up)
    act_b[0] = min(c.input[ba[0]] for c in fwd) / down + bwd[0].input[ba[0]] / up if ba[0] > 0 and len(fa) else 0.0
    up_s += sum(float(c.input[ba[0]] + np.sum(c.input[ba[1:]]) + np.sum(c.input[bb[1:] + 1])) for c in bwd) / up
    down_s += sum(float(np.sum(c.input[ba[ba > 0]])) for c in bwd) / down
    grads = profile.param_bytes(ba, bb)
    down_s += float(np.sum(grads // plan.gpus if plan.gpus > 1 else grads)) / down
    return (np.concatenate([weights(fa, fb), weights(ba, bb)]), np.concatenate([c_f, c_b]),
            np.concatenate([c0_f, c0_b]), np.concatenate([act_f, act_b]), up_s, down_s)


def _best_by_size(make: Callable[[int], Plan | None], sizes, profile, hw, name, cap) -> Plan:
    """The fastest size by simulation (ties go to the smaller size), simulating as few as possible:
    largest sizes first (their simulations are the shortest and usually the fastest plans),
    skipping a size whose :func:`iteration_floor` exceeds the best time so far, since its plan
    cannot win. Same result as simulating every size: small sizes of long models take minutes
    to simulate and are seldom the best."""
    t0 = time.perf_counter()
    best, best_t, best_u = None, float("inf"), None
    for u in sorted(sizes, reverse=True):
        plan = make(u)
        if plan is None or iteration_floor(plan, profile, hw) > best_t * (1 + _FLOOR_SLACK):
            continue
        t = score(plan, profile, hw)
        if t == float("inf"):       # the simulator refused the plan
            continue
        if t < best_t or (t == best_t and u < best_u):
            best, best_t, best_u = plan, t, u
    if best is None:
        raise _infeasible(profile, cap, sizes, name)
    return _fits_host(best.replace(simulated_iteration_time_s=best_t, search_time_s=time.perf_counter() - t0),
                      profile, hw)


def _fits_host(plan: Plan, profile: Profile, hw: Hardware) -> Plan:
    """``plan``, or InfeasibleError where it needs more host memory than ``hw`` has: the baselines search
    as their authors did, without that budget, so their best plan is checked afterwards."""
    require_fits(plan, profile, hw, f"{plan.planner}'s plan ({plan.mode} x{plan.gpus} "
                                    f"u={plan.microbatch_fwd}/{plan.microbatch_bwd})")
    return plan


def _gpus(hw: Hardware, gpus: int | None) -> int:
    """GPUs to plan for: all of the hardware's by default."""
    if gpus is None:
        return hw.gpus
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= hw.gpus:
        raise UsageError(f"gpus {gpus!r}: hardware {hw.name!r} has {hw.gpus} GPU(s); give 1 to {hw.gpus}")
    return gpus


def _infeasible(profile, cap, sizes, name) -> InfeasibleError:
    if not sizes:
        return _no_sizes(profile, name)
    u = min(sizes)
    try:
        check_layers_fit(profile, "BWD", u, cap)
    except InfeasibleError as e:
        return e
    return InfeasibleError(f"{name}: no feasible plan of {profile.name} under a cap of {fmt_bytes(cap)} "
                           f"({cap} bytes) at microbatch sizes {sizes[:3]}...; try another planner or a larger cap",
                           cap_bytes=cap)


def _no_sizes(profile: Profile, name: str) -> InfeasibleError:
    (fl, fh), (bl, bh) = profile.size_range("FWD"), profile.size_range("BWD")
    return InfeasibleError(f"{name}: no microbatch size to try: it must be profiled for both phases ({profile.name}: "
                           f"FWD {fl}..{fh}, BWD {bl}..{bh}) and divide every GPU's share of the batch; "
                           f"change --batch or --gpus")


def same_sizes(profile: Profile, batch: int, gpus: int) -> list[int]:
    """Sizes a planner that uses one microbatch size for both phases may pick (vDP, dividing every share):
    both phases must be profiled there, or the plan cannot be simulated."""
    (fl, fh), (bl, bh) = profile.size_range("FWD"), profile.size_range("BWD")
    return [u for u in feasible_sizes(profile, batch, "vDP", gpus) if max(fl, bl) <= u <= min(fh, bh)]


def plan_layerwise(profile: Profile, hw: Hardware, batch: int, cap: int, *, grouping: bool, name: str,
                   gpus: int | None = None) -> Plan:
    """One layer per pack (naive-swap and l2l), vDP over the GPUs."""
    n = _gpus(hw, gpus)
    R = profile.num_layers

    def make(u):
        if any(profile.costs(ph, u).memory.max() > cap for ph in ("FWD", "BWD")):
            return None
        bwd = [(l, l) for l in range(R)]
        return Plan(name, "vDP", n, batch, u, u, bwd[:-1], bwd, R, input_batch_grouping=grouping,
                    memory_cap=cap, **plan_ident(profile, hw))
    return _best_by_size(make, same_sizes(profile, batch, n), profile, hw, name, cap)


def plan_naive_swap(profile, hw, batch, cap, gpus=None, **_):
    return plan_layerwise(profile, hw, batch, cap, grouping=False, name="naive-swap", gpus=gpus)


def plan_l2l(profile, hw, batch, cap, gpus=None, **_):
    return plan_layerwise(profile, hw, batch, cap, grouping=True, name="l2l", gpus=gpus)


def plan_zero_offload(profile, hw, batch, cap, gpus=None, **_):
    """All weights resident: the whole model is one backward pack (vDP)."""
    n = _gpus(hw, gpus)
    R = profile.num_layers
    need_w = int(profile.param_bytes(0, R - 1) + profile.buffer_bytes(0, R - 1))
    sizes = same_sizes(profile, batch, n)
    if not sizes:
        raise _no_sizes(profile, "zero-offload")
    u0 = min(sizes)
    need = int(profile.costs("BWD", u0).pack_memory(0, R - 1))
    if need > cap:
        raise InfeasibleError(
            f"zero-offload: {profile.name} needs {fmt_bytes(need)} ({need} bytes) on each GPU with all weights "
            f"({fmt_bytes(need_w)}) resident at microbatch {u0}, more than the cap of {fmt_bytes(cap)} ({cap} bytes)",
            microbatch=u0, needed_bytes=need, cap_bytes=cap)

    def make(u):
        if profile.costs("BWD", u).pack_memory(0, R - 1) > cap:
            return None
        return Plan("zero-offload", "vDP", n, batch, u, u, [], [(0, R - 1)], R, memory_cap=cap, **plan_ident(profile, hw))
    return _best_by_size(make, sizes, profile, hw, "zero-offload", cap)


def plan_harmony(profile, hw, batch, cap, *, mode="vPP", gpus=None, packing_fwd=("balanced_time", "reuse"),
                 packing_bwd=("balanced_time",), cost_model="default", play_many=None, **kw):
    """Harmony's search; under the default cost model its candidates are judged by our simulator.
    ``play_many(plans)``: ``played`` of each plan (default: one after the other here), e.g. in other
    processes: the same plan, sooner."""
    n = _gpus(hw, gpus)
    if mode == "vDP" and n > 1 and hw.servers_used(n) > 1 and not hw.can_allreduce(n):
        raise InfeasibleError(f"vDP on {n} GPUs of several servers all-reduces on GPU links, and hardware "
                              f"{hw.name!r} has no p2p_bandwidth inside a server; use vPP")
    events = [0]

    def score_many(plans):
        plans = [p.replace(cost_model="default", **plan_ident(profile, hw)) for p in plans]
        results = list(play_many(plans)) if play_many is not None else [played(p, profile, hw) for p in plans]
        events[0] += sum(n_events for _, n_events in results)
        return [t for t, _ in results]
    res = harmony_search(profile, batch, n, mode, cap, packing_fwd=packing_fwd, packing_bwd=packing_bwd,
                         rank_fit_normally=True, score_many=score_many if cost_model == "default" else None, **kw)
    plan = res.best_plan()
    # the work the search did, in events played (the planner charges it to its budget)
    plan = plan.replace(stats={**plan.stats, "events_simulated": res.events_simulated + events[0]})
    return _fits_host(plan.replace(cost_model=cost_model, **plan_ident(profile, hw)), profile, hw)


__all__ = ["score", "played", "iteration_floor", "plan_harmony", "plan_naive_swap", "plan_l2l",
           "plan_zero_offload", "max_pack_end"]
