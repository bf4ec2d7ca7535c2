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
from .plan import Plan, data_shares
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


def _best_by_size(make: Callable[[int], Plan | None], sizes, profile, hw, name, cap) -> Plan:
    t0 = time.perf_counter()
    best, best_t = None, float("inf")
    for u in sizes:
        plan = make(u)
        if plan is None:
            continue
        t = score(plan, profile, hw)
        if t < best_t:
            best, best_t = plan, t
    if best is None:
        raise _infeasible(profile, cap, sizes, name)
    return best.replace(simulated_iteration_time_s=best_t, search_time_s=time.perf_counter() - t0)


def _infeasible(profile, cap, sizes, name) -> InfeasibleError:
    u = min(sizes) if sizes else profile.size_range("BWD")[0]
    try:
        check_layers_fit(profile, "BWD", u, cap)
    except InfeasibleError as e:
        return e
    return InfeasibleError(f"{name}: no feasible plan of {profile.name} under a cap of {fmt_bytes(cap)} "
                           f"({cap} bytes) at microbatch sizes {sizes[:3]}...; try another planner or a larger cap",
                           cap_bytes=cap)


def plan_layerwise(profile: Profile, hw: Hardware, batch: int, cap: int, *, grouping: bool, name: str,
                   gpus: int | None = None) -> Plan:
    """One layer per pack (naive-swap and l2l), vDP over the GPUs."""
    n = gpus or hw.gpus
    R = profile.num_layers
    sizes = feasible_sizes(profile, batch, "vDP", n)

    def make(u):
        if any(profile.costs(ph, u).memory.max() > cap for ph in ("FWD", "BWD")
               if u <= profile.size_range(ph)[1]):
            return None
        bwd = [(l, l) for l in range(R)]
        return Plan(name, "vDP", n, batch, u, u, bwd[:-1], bwd, R, input_batch_grouping=grouping,
                    memory_cap=cap, **_ident(profile, hw))
    sizes = [u for u in sizes if u <= profile.size_range("FWD")[1]]
    return _best_by_size(make, sizes, profile, hw, name, cap)


def plan_naive_swap(profile, hw, batch, cap, gpus=None, **_):
    return plan_layerwise(profile, hw, batch, cap, grouping=False, name="naive-swap", gpus=gpus)


def plan_l2l(profile, hw, batch, cap, gpus=None, **_):
    return plan_layerwise(profile, hw, batch, cap, grouping=True, name="l2l", gpus=gpus)


def plan_zero_offload(profile, hw, batch, cap, gpus=None, **_):
    """All weights resident: the whole model is one backward pack (vDP)."""
    n = gpus or hw.gpus
    R = profile.num_layers
    need_w = int(profile.param_bytes(0, R - 1) + profile.buffer_bytes(0, R - 1))
    sizes = feasible_sizes(profile, batch, "vDP", n)
    u0 = min(sizes) if sizes else profile.size_range("BWD")[0]
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
