"""Same inputs, seed and worker count give byte-identical plan files (issue #7).

Wall-clock timings stay on the Plan object and out of the file (Plan.to_json), so the bytes
depend only on the inputs."""
from __future__ import annotations

import math

import pytest

from harmony_opt.planners.registry import BASELINES, get_planner
from harmony_opt.core.errors import InfeasibleError
from harmony_opt.core.hardware import get_hardware
from harmony_opt.core.plan import Plan

from conftest import synthetic_profile


@pytest.fixture(scope="module")
def inputs():
    return synthetic_profile(R=12, seed=3), get_hardware("1080ti-x4", memory_cap="600MB")


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_baseline_plan_files_are_byte_identical(name, inputs, tmp_path):
    profile, hw = inputs
    files = []
    for i in range(2):
        try:
            plan = get_planner(name)(profile, hw, 8, hw.gpu_memory_bytes)
        except InfeasibleError:
            pytest.skip(f"{name} has no plan for these inputs")
        assert plan.search_time_s is not None and plan.search_time_s > 0     # measured, kept in memory
        files.append(plan.save(tmp_path / f"{i}.json").read_bytes())
    assert files[0] == files[1]


@pytest.mark.parametrize("workers", [1, 2])
def test_cp_sat_plan_files_are_byte_identical(workers, inputs, tmp_path):
    from harmony_opt.solver_models.planner import PlannerOptions, plan
    profile, hw = inputs
    opts = PlannerOptions(time_limit=4, seed=7, workers=workers)
    a, b = (plan(profile, hw, 8, opts, memory_cap=hw.gpu_memory_bytes) for _ in range(2))
    assert a.save(tmp_path / "a.json").read_bytes() == b.save(tmp_path / "b.json").read_bytes()


def test_timings_and_non_finite_numbers_stay_out_of_the_file(inputs):
    profile, hw = inputs
    plan = get_planner("l2l")(profile, hw, 8, hw.gpu_memory_bytes)
    plan = plan.replace(solver={"wall_time_s": 1.5, "bound": float("nan"), "inner": {"wall_time_s": 2.0}},
                        stats={"efficiency": math.inf})
    d = Plan.from_dict(__import__("json").loads(plan.to_json())).to_dict()
    assert d["search_time_s"] is None and d["solver"] == {"wall_time_s": None, "bound": None,
                                                           "inner": {"wall_time_s": None}}
    assert d["stats"] == {"efficiency": None}
    assert plan.search_time_s > 0


def test_cp_sat_plan_is_the_same_in_fresh_processes_with_other_hash_seeds(tmp_path):
    """Python randomizes string hashing per process: no set or dict order may reach the models."""
    import os
    import subprocess
    import sys
    code = ("import sys; sys.path.insert(0, 'tests'); from conftest import synthetic_profile; "
            "from harmony_opt.core.hardware import get_hardware; from harmony_opt.solver_models.planner import PlannerOptions, plan; "
            "p = plan(synthetic_profile(R=14, seed=4), get_hardware('1080ti-x4', memory_cap='600MB'), 8, "
            "PlannerOptions(time_limit=3, seed=2)); sys.stdout.write(p.to_json())")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outs = [subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    assert outs[0] == outs[1] and '"planner": "cp-sat"' in outs[0]


def test_more_processes_give_the_same_plan_file(tmp_path, monkeypatch):
    """--processes N runs the local search and the simulator's descent in N forked processes and
    takes their results in the order one process computes them: the file is the same, and the
    processes did do the work (both steps went through the pool)."""
    import concurrent.futures

    import harmony_opt.solver_models.pool as pool
    from harmony_opt.core.bundled import load_profile
    from harmony_opt.solver_models.planner import PlannerOptions, plan
    calls = {"submit": 0, "map": 0}

    class Counted(concurrent.futures.ProcessPoolExecutor):
        def submit(self, *a, **k):
            calls["submit"] += 1
            return super().submit(*a, **k)

        def map(self, *a, **k):
            calls["map"] += 1
            return super().map(*a, **k)
    monkeypatch.setattr(pool.concurrent.futures, "ProcessPoolExecutor", Counted)
    profile, hw = load_profile("bert_large"), get_hardware("1080ti-x4").with_gpus(2)
    files = [plan(profile, hw, 32, PlannerOptions(time_limit=4, uneven=True, processes=n),
                  memory_cap=10 * 2**30).save(tmp_path / f"{n}.json").read_bytes() for n in (1, 2)]
    assert files[0] == files[1]
    assert calls["submit"] > 0 and calls["map"] > 0
