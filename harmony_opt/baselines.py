"""Baseline planners; each returns a Plan scored by the same simulator as ours.

* ``harmony``: Harmony's own search (every valid (u_fwd, u_bwd) pair x its packing
  heuristics, harmony_compat.py), judged by the chosen cost model's simulator;
* ``naive-swap``: per-microbatch swapping as single-GPU memory virtualization does
  (vDNN, LMS): every microbatch sweeps every layer, weights come in every time, no
  input-batch grouping; each GPU trains on its data share (vDP);
* ``l2l``: layer-to-layer: one layer resident at a time, all microbatches through it,
  optimizer on the CPU (vDP);
* ``zero-offload``: all weights resident on the GPU, gradients and optimizer on the CPU;
  infeasible when the model does not fit.

Every baseline picks its microbatch size by simulating each feasible size.
"""
from __future__ import annotations

import time
from typing import Callable

from .errors import InfeasibleError, PlanError, UsageError
from .hardware import Hardware
from .memory import check_layers_fit, max_pack_end
from .plan import Plan, data_shares, split_microbatches
from .profile import Profile
from .units import fmt_bytes


def _ident(profile: Profile, hw: Hardware) -> dict:
    return {"profile": {"name": profile.name, "identity": profile.identity}, "hardware": hw.to_dict()}


def score(plan: Plan, profile: Profile, hw: Hardware, cost_model: str = "default") -> float:
    """Simulated iteration time; inf for a plan the cost model rejects (e.g. over memory)."""
    try:
        if cost_model == "harmony":
            from .harmony_compat import simulate_harmony
            return simulate_harmony(plan, profile, with_timeline=False).iteration_time
        from .simulator import simulate
        return simulate(plan, profile, hw, with_timeline=False).iteration_time
    except PlanError:
        return float("inf")


def feasible_sizes(profile: Profile, batch: int, mode: str, gpus: int, phase: str = "BWD",
                   divisors_only: bool = True) -> list[int]:
    share = batch if mode == "vPP" else min(data_shares(batch, gpus))
    lo, hi = profile.size_range(phase)
    return [u for u in range(lo, min(hi, share) + 1)
            if not divisors_only or all(s % u == 0 for s in (data_shares(batch, gpus) if mode == "vDP" else [batch]))]


def _compute_floor(plan: Plan, profile: Profile) -> float:
    """Seconds the busiest GPU computes (every sample's recompute + backward of every layer):
    no simulation of the plan can be shorter, since a GPU's compute stream runs one event at a time."""
    if not all(o.recompute for o in plan.options):
        return 0.0
    share = max(data_shares(plan.batch, plan.gpus)) if plan.mode == "vDP" else plan.batch
    R = profile.num_layers
    return float(sum(profile.costs("BWD", m).pack_time(0, R - 1)
                     for m in split_microbatches(share, plan.microbatch_bwd)))


def _best_by_size(make: Callable[[int], Plan | None], sizes, profile, hw, name, cap) -> Plan:
    """The fastest size by simulation; largest sizes first, skipping a size whose compute floor
    exceeds the best time so far (same result as simulating all: small sizes of long models take
    minutes to simulate and are never the best); ties go to the smaller size."""
    t0 = time.perf_counter()
    best, best_t, best_u = None, float("inf"), None
    for u in sorted(sizes, reverse=True):
        plan = make(u)
        if plan is None or _compute_floor(plan, profile) > best_t * (1 + 1e-9):
            continue
        t = score(plan, profile, hw)
        if t < best_t or (t == best_t and u < best_u):
            best, best_t, best_u = plan, t, u
    if best is None:
        raise _infeasible(profile, cap, sizes, name)
    return best.replace(simulated_iteration_time_s=best_t, search_time_s=time.perf_counter() - t0)


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
    n = gpus or hw.gpus
    R = profile.num_layers

    def make(u):
        if any(profile.costs(ph, u).memory.max() > cap for ph in ("FWD", "BWD")):
            return None
        bwd = [(l, l) for l in range(R)]
        return Plan(name, "vDP", n, batch, u, u, bwd[:-1], bwd, R, input_batch_grouping=grouping,
                    memory_cap=cap, **_ident(profile, hw))
    return _best_by_size(make, same_sizes(profile, batch, n), profile, hw, name, cap)


def plan_naive_swap(profile, hw, batch, cap, gpus=None, **_):
    return plan_layerwise(profile, hw, batch, cap, grouping=False, name="naive-swap", gpus=gpus)


def plan_l2l(profile, hw, batch, cap, gpus=None, **_):
    return plan_layerwise(profile, hw, batch, cap, grouping=True, name="l2l", gpus=gpus)


def plan_zero_offload(profile, hw, batch, cap, gpus=None, **_):
    """All weights resident: the whole model is one backward pack (vDP)."""
    n = gpus or hw.gpus
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
        return Plan("zero-offload", "vDP", n, batch, u, u, [], [(0, R - 1)], R, memory_cap=cap, **_ident(profile, hw))
    return _best_by_size(make, sizes, profile, hw, "zero-offload", cap)


def plan_harmony(profile, hw, batch, cap, *, mode="vPP", gpus=None, packing_fwd=("balanced_time", "reuse"),
                 packing_bwd=("balanced_time",), cost_model="default", **kw):
    """Harmony's search; under the default cost model its candidates are judged by our simulator."""
    from .harmony_compat import harmony_search
    n = gpus or hw.gpus
    scorer = None
    if cost_model == "default":
        def scorer(plan):
            return score(plan.replace(cost_model="default", **_ident(profile, hw)), profile, hw)
    res = harmony_search(profile, batch, n, mode, cap, packing_fwd=packing_fwd, packing_bwd=packing_bwd,
                         rank_fit_normally=True, score=scorer, **kw)
    plan = res.best_plan()
    return plan.replace(cost_model=cost_model, **_ident(profile, hw))


PLANNERS = {
    "harmony": plan_harmony,
    "naive-swap": plan_naive_swap,
    "l2l": plan_l2l,
    "zero-offload": plan_zero_offload,
}


def get_planner(name: str):
    key = name.lower().replace("_", "-")
    if key not in PLANNERS:
        raise UsageError(f"unknown planner {name!r}; valid: {', '.join(PLANNERS)}")
    return PLANNERS[key]


__all__ = ["PLANNERS", "get_planner", "score", "plan_harmony", "plan_naive_swap", "plan_l2l", "plan_zero_offload",
           "max_pack_end"]
