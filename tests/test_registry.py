"""The planner registry: every planner by name, ours first, one calling convention, cp-sat resolved lazily."""
from __future__ import annotations

import pytest

from harmony_opt.core.errors import InfeasibleError, UsageError
from harmony_opt.core.hardware import get_hardware
from harmony_opt.core.plan import Plan
from harmony_opt.planners import registry
from harmony_opt.planners.registry import BASELINES, PLANNERS, get_planner, planner_entry

from conftest import synthetic_profile


@pytest.fixture(scope="module")
def inputs():
    return synthetic_profile(R=8, sizes=(1, 2, 4), seed=5), get_hardware("1080ti-x4", memory_cap="600MB", gpus=2)


def test_names_order_and_descriptions():
    assert list(PLANNERS) == ["cp-sat", "harmony", "naive-swap", "l2l", "zero-offload"]
    assert BASELINES == ("harmony", "naive-swap", "l2l", "zero-offload")
    assert {e.name: e.modes for e in PLANNERS.values()} == {
        "cp-sat": "auto", "harmony": "per-mode", "naive-swap": "vDP", "l2l": "vDP", "zero-offload": "vDP"}
    for e in PLANNERS.values():
        assert e.description and "\n" not in e.description
        assert callable(e.load()) and e.target.count(":") == 1
    assert planner_entry("Zero_Offload").name == "zero-offload"


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(UsageError, match="unknown planner 'magic'; valid: cp-sat, harmony, naive-swap, l2l, "
                                         "zero-offload"):
        get_planner("magic")


def test_the_planner_layer_names_cp_sat_without_importing_it():
    """The registry sits below solver_models: it holds a string, not a reference (tests/test_layers.py
    checks the imports; this checks that the string names the adapter that exists)."""
    import inspect
    src = inspect.getsource(registry)
    assert "import harmony_opt.solver_models" not in src and "from harmony_opt.solver_models" not in src
    from harmony_opt.solver_models.planner import plan_under_cap
    assert PLANNERS["cp-sat"].load() is plan_under_cap


def test_cp_sat_through_the_registry_is_the_plan_of_calling_the_planner(inputs):
    from harmony_opt.solver_models.planner import PlannerOptions, plan
    profile, hw = inputs
    cap = 500 * 10**6
    got = get_planner("cp-sat")(profile, hw, 8, cap, gpus=2, mode="vPP", time_limit=1.0, seed=3)
    want = plan(profile, hw, 8, PlannerOptions(mode="vPP", gpus=2, time_limit=1.0, seed=3), memory_cap=cap)
    assert isinstance(got, Plan) and got.planner == "cp-sat"
    assert got.mode == "vPP" and got.gpus == 2 and got.memory_cap == cap
    assert got.to_json() == want.to_json()


def test_cp_sat_refuses_an_unknown_option(inputs):
    profile, hw = inputs
    with pytest.raises(UsageError, match="cp-sat: unknown option.*time_limt.*valid: mode"):
        get_planner("cp-sat")(profile, hw, 8, hw.gpu_memory_bytes, time_limt=1.0)


@pytest.mark.parametrize("name", BASELINES)
def test_every_baseline_takes_the_one_convention(name, inputs):
    """(profile, hw, batch, cap, gpus=...) -> a Plan of that planner under the cap, or a refusal that says why."""
    profile, hw = inputs
    kw = {"mode": "vDP"} if PLANNERS[name].takes_mode else {}
    try:
        p = get_planner(name)(profile, hw, 8, hw.gpu_memory_bytes, gpus=1, **kw)
    except InfeasibleError as e:
        assert str(e)
        return
    assert p.planner == name and p.gpus == 1 and p.memory_cap == hw.gpu_memory_bytes
    assert PLANNERS[name].modes == "per-mode" or p.mode == PLANNERS[name].modes
