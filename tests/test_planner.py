"""The CP-SAT planner: equals the exact DP where both apply, valid plans, explanations, determinism."""
import pytest
from hypothesis import given, settings, strategies as st

from harmony_opt import InfeasibleError, get_hardware
from harmony_opt.simulator import simulate
from solver_models.arcs import Config, build_arcs
from solver_models.dp import solve_chain
from solver_models.packing import objective_of, solve
from solver_models.planner import PlannerOptions, plan

from conftest import synthetic_profile

HW1 = get_hardware("1080ti-x4").with_gpus(1)


@settings(max_examples=25, deadline=None)
@given(st.integers(3, 40), st.integers(0, 1000), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]),
       st.floats(0.15, 1.0))
def test_cp_sat_equals_dp_on_one_gpu(R, seed, uf, ub, tight):
    prof = synthetic_profile(R=R, seed=seed)
    full = int(prof.costs("BWD", ub).pack_memory(0, R - 1))
    single = max(int(prof.costs(ph, u).memory.max()) for ph, u in (("BWD", ub), ("FWD", uf)))
    cap = max(single, int(full * tight))
    cfg = Config("vPP", 1, uf, ub)
    ph = build_arcs(prof, HW1, 8, cfg, cap, options=False)
    dp = solve_chain(ph.fwd, ph.bwd, ph.crit, R)
    res = solve(ph, R, cfg, HW1, time_limit=20)
    if dp is None:
        assert res.objective is None
        return
    assert res.status == "OPTIMAL"
    assert res.objective == pytest.approx(dp[0], abs=2e-6)
    # the packs the solver returns have the objective it reports
    assert objective_of(ph, cfg, HW1, res.packs_fwd, res.packs_bwd, res.options) == pytest.approx(res.objective,
                                                                                                    abs=2e-6)


def test_planner_returns_valid_plans_under_the_cap():
    prof = synthetic_profile(R=12, seed=3)
    hw = get_hardware("1080ti-x4").with_gpus(2)
    cap = int(prof.costs("BWD", 4).pack_memory(0, 11) * 0.4)
    p = plan(prof, hw, 8, PlannerOptions(time_limit=5, hint=False), memory_cap=cap)
    p.validate()
    tl = simulate(p, prof, hw, memory_cap=cap)
    assert max(tl.peak_memory().values()) <= cap
    assert tl.iteration_time == pytest.approx(p.simulated_iteration_time_s)
    assert p.solver["lower_bound_s"] <= p.simulated_iteration_time_s
    assert p.solver["status"] in ("OPTIMAL", "FEASIBLE")


def test_same_seed_same_plan():
    prof = synthetic_profile(R=10, seed=5)
    hw = get_hardware("1080ti-x4").with_gpus(2)
    cap = int(prof.costs("BWD", 4).pack_memory(0, 9) * 0.5)
    a = plan(prof, hw, 8, PlannerOptions(time_limit=5, hint=False, seed=1), memory_cap=cap)
    b = plan(prof, hw, 8, PlannerOptions(time_limit=5, hint=False, seed=1), memory_cap=cap)
    strip = lambda p: {k: v for k, v in p.to_dict().items() if k not in ("search_time_s", "solver")}  # noqa: E731
    assert strip(a) == strip(b)


def test_infeasible_request_is_explained():
    prof = synthetic_profile(R=6, seed=1)
    hw = get_hardware("1080ti-x4").with_gpus(1)
    with pytest.raises(InfeasibleError) as e:
        plan(prof, hw, 8, PlannerOptions(time_limit=2, hint=False), memory_cap=2**20)
    msg = str(e.value)
    assert "layer" in msg and "microbatch 1" in msg and "1048576 bytes" in msg
    assert e.value.layer is not None and e.value.needed_bytes > e.value.cap_bytes


def _stash_friendly(R=8):
    """Forward-heavy layers whose saved activations are small: stashing beats recomputing."""
    prof = synthetic_profile(R=R, seed=2)
    micro = prof.microbatch.copy()
    micro["saved_bytes"] = micro["input_bytes"]          # saved == the input: cheap to move
    fwd = micro.phase == "FWD"
    micro.loc[fwd, "gpu_time_s"] *= 20                   # the recompute is expensive
    micro.loc[~fwd, "gpu_time_s"] = micro.loc[~fwd, "gpu_time_s"] + micro.loc[fwd, "gpu_time_s"].to_numpy()
    return type(prof)(prof.name, prof.layers, micro, prof.meta)


def test_planner_stashes_where_it_pays_and_the_plan_is_faster():
    prof = _stash_friendly()
    hw = get_hardware("1080ti-x4").with_gpus(1)
    cap = 10 * 2**30
    searched = plan(prof, hw, 8, PlannerOptions(time_limit=5), memory_cap=cap)
    harmony_only = plan(prof, hw, 8, PlannerOptions(time_limit=5, options=False), memory_cap=cap)
    assert any(not o.recompute for o in searched.options)
    assert all(o.recompute and o.optimizer == "cpu" for o in harmony_only.options)
    assert searched.simulated_iteration_time_s < harmony_only.simulated_iteration_time_s
    tl = simulate(searched, prof, hw, memory_cap=cap)
    assert max(tl.peak_memory().values()) <= cap


def test_timeline_model_schedules_the_simulated_events_at_least_as_well():
    from solver_models.timeline import solve_timeline
    prof = synthetic_profile(R=10, seed=7)
    hw = get_hardware("1080ti-x4").with_gpus(2)
    cap = int(prof.costs("BWD", 4).pack_memory(0, 9) * 0.5)
    p = plan(prof, hw, 8, PlannerOptions(time_limit=3, hint=False), memory_cap=cap)
    r = solve_timeline(p, prof, hw, time_limit=2)
    assert r.status in ("OPTIMAL", "FEASIBLE")
    # the simulator's schedule is feasible for the model, so the optimum is no later; and it is
    # a real schedule of the same events, so it is no earlier than the model's own bound
    assert r.bound_s - 1e-6 <= r.makespan_s <= r.simulated_s + 1e-6
    assert len(r.starts) == r.events
    # what the planner reports is this model's objective and its agreement with the simulator
    assert p.solver["model"] == "timeline"
    assert p.solver["fidelity"] == pytest.approx(abs(p.solver["objective"] - p.simulated_iteration_time_s)
                                                 / p.simulated_iteration_time_s)
    assert p.solver["fidelity"] <= 0.03


def test_same_inputs_give_byte_identical_plan_json():
    prof = synthetic_profile(R=10, seed=5)
    hw = get_hardware("1080ti-x4").with_gpus(2)
    cap = int(prof.costs("BWD", 4).pack_memory(0, 9) * 0.5)
    a = plan(prof, hw, 8, PlannerOptions(time_limit=3, seed=3), memory_cap=cap)
    b = plan(prof, hw, 8, PlannerOptions(time_limit=3, seed=3), memory_cap=cap)
    keep = lambda p: p.replace(search_time_s=None, solver={k: v for k, v in p.solver.items()  # noqa: E731
                                                           if "wall" not in k}
                               | {"timeline": {k: v for k, v in (p.solver["timeline"] or {}).items()
                                               if "wall" not in k}})
    assert keep(a).to_json() == keep(b).to_json()
