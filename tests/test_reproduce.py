"""The experiments' logic at tiny scale: synthetic GPT-2 profiles, the compare grid, tables, figures."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from harmony_opt import baselines, bundled
from harmony_opt import reproduce as R
from harmony_opt.hardware import get_hardware
from harmony_opt.synthetic import GPT2_SCALING, GPT2_XL, GPT2Shape, gpt2_profile

from conftest import synthetic_profile


def test_gpt2_profile_rebuilds_its_reference():
    """Built with gpt2_xl's own shape, the model returns gpt2_xl's bytes and (mean-block) costs."""
    ref = bundled.load_profile("gpt2_xl")
    syn = gpt2_profile(GPT2_XL)
    assert syn.totals()["param_bytes"] == ref.totals()["param_bytes"]
    assert syn.totals()["buffer_bytes"] == ref.totals()["buffer_bytes"]
    for phase in ("FWD", "BWD"):
        a, b = syn.costs(phase, 4), ref.costs(phase, 4)
        np.testing.assert_array_equal(a.input, b.input)
        assert a.time.sum() == pytest.approx(b.time.sum(), rel=1e-3)
        assert a.memory[-1] == b.memory[-1] and a.memory[0] == b.memory[0]


def test_gpt2_scaling_series_shapes():
    """10B..100B parameters, 54..504 layers; activation memory grows with the hidden size."""
    assert [s.num_layers for s in GPT2_SCALING.values()] == list(range(54, 505, 50))
    params = [s.parameters() / 1e9 for s in GPT2_SCALING.values()]
    assert params[0] == pytest.approx(10, rel=0.1) and params[-1] == pytest.approx(100, rel=0.1)
    small = gpt2_profile(GPT2Shape(n_layer=3, n_embd=4096, n_head=32))
    xl = bundled.load_profile("gpt2_xl")
    assert small.num_layers == 7 and small.meta["synthetic"]["calibrated_on"] == "gpt2_xl"
    assert small.costs("BWD", 1).memory[1] > xl.costs("BWD", 1).memory[1]
    assert small.costs("FWD", 1).time[1] > xl.costs("FWD", 1).time[1]


def test_baseline_size_pruning_keeps_the_exhaustive_choice():
    """Skipping sizes whose compute floor exceeds the best time gives the same plan as simulating all."""
    prof = synthetic_profile(R=10, sizes=(1, 2, 4, 8), seed=3)
    hw = get_hardware("1080ti-x4", gpus=2)
    for name in ("naive-swap", "l2l"):
        plan = baselines.get_planner(name)(prof, hw, 16, hw.gpu_memory_bytes)
        times = {u: baselines.score(plan.replace(microbatch_fwd=u, microbatch_bwd=u), prof, hw) for u in (1, 2, 4, 8)}
        best = min(times.values())
        assert plan.simulated_iteration_time_s == best
        assert plan.microbatch_bwd == min(u for u, t in times.items() if t == best)


@pytest.fixture
def tiny_bundle(tmp_path, monkeypatch):
    """A bundled-profiles folder holding one small profile, "tiny"."""
    synthetic_profile(R=8, sizes=(1, 2, 4, 8), name="tiny").save(tmp_path / "tiny")
    monkeypatch.setenv("HARMONY_OPT_PROFILES", str(tmp_path))
    bundled._CACHE.clear()
    yield "tiny"
    bundled._CACHE.clear()


def test_compare_cell_rows_and_figures(tiny_bundle, tmp_path):
    cells = R.compare_cells([tiny_bundle], batches=(8,), gpus=(1, 2), time_limit=0.5,
                            gantt=(tiny_bundle, 8, 2, "vPP"))
    df, timelines = R.compare(cells, jobs=1)
    n2 = df[df.gpus_requested == 2]
    # both modes for ours and Harmony's on 2 GPUs, vPP only on 1; baselines once; one bound per cell
    assert sorted(n2[n2.planner == "cp-sat"].mode_requested) == ["vDP", "vPP"]
    assert list(df[(df.gpus_requested == 1) & (df.planner == "cp-sat")].mode_requested) == ["vPP"]
    assert (df.planner == "lower-bound").sum() == 2 and (df.planner == "naive-swap").sum() == 2
    assert set(df.status) <= {"ok", "infeasible", "skipped", "bound"}
    ok = df[df.status == "ok"]
    bound = df[df.planner == "lower-bound"].set_index("gpus_requested").iteration_s
    assert (ok.iteration_s.to_numpy() >= bound[ok.gpus_requested].to_numpy() * (1 - 1e-3)).all()
    best = R.best_per_cell(df)
    assert not best.duplicated(["model", "batch", "gpus_requested", "planner"]).any()
    ours = best[(best.planner == "cp-sat") & (best.gpus_requested == 2)].iteration_s.iloc[0]
    assert ours == n2[n2.planner == "cp-sat"].iteration_s.min()
    paths = R.write_compare(df, timelines, tmp_path / "out", 0.5, R.BASELINE_BUDGET,
                            gantt_case=(tiny_bundle, 8, 2, "vPP"))
    names = {p.name for p in paths}
    assert {"compare.csv", "compare.md", "compare_iteration_time.png", "compare_swap_volume.png",
            "compare_efficiency.png", "gantt_tiny_ours.png", "gantt_tiny_harmony.png"} <= names
    assert all(p.stat().st_size > 0 for p in paths)
    assert len(pd.read_csv(tmp_path / "out" / "compare.csv")) == len(df)


def test_compare_cell_skips_layerwise_baselines_over_budget(tiny_bundle):
    rows, _ = R.run_cell(R.CompareCell(tiny_bundle, 8, 1, time_limit=0.5, baseline_budget=10))
    df = pd.DataFrame(rows)
    skipped = df[df.status == "skipped"]
    assert sorted(skipped.planner) == ["l2l", "naive-swap"]
    assert skipped.note.str.contains("budget").all()
    assert "zero-offload" in set(df.planner)


def test_markdown_table_and_machine():
    md = R.markdown_table(pd.DataFrame({"a": [1, 2], "b": [0.5, math.nan], "c": ["x|y", None]}))
    assert md.splitlines()[0] == "| a | b | c |"
    assert md.splitlines()[3] == "| 2 |  |  |"
    assert "cores" in R.machine_description()


def test_reproduce_command_parses():
    from harmony_opt.cli import build_parser
    args = build_parser().parse_args(["reproduce", "compare", "--models", "bert_large", "--batches", "16",
                                      "--jobs", "1"])
    assert args.experiment == "compare" and args.jobs == 1 and callable(args.func)
