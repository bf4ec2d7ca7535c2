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
    f, b, c, mbs = build_arcs(prof, HW1, 8, cfg, cap)
    dp = solve_chain(f, b, c, R)
    res = solve(f, b, c, R, cfg, HW1, mbs, time_limit=20)
    if dp is None:
        assert res.objective is None
        return
    assert res.status == "OPTIMAL"
    assert res.objective == pytest.approx(dp[0], abs=2e-6)
    # the packs the solver returns have the objective it reports
    assert objective_of(f, b, c, cfg, HW1, mbs, res.packs_fwd, res.packs_bwd) == pytest.approx(res.objective,
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
