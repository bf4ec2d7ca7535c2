"""The experiments (experiments/, `python -m experiments`) at tiny scale: synthetic GPT-2 profiles,
the compare grid, tables, figures, and the command lines that run them."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harmony_opt.core import bundled
from harmony_opt.planners import baselines
from harmony_opt.planners.registry import get_planner
from harmony_opt.core.hardware import get_hardware
from harmony_opt.report import machine_description, markdown_table

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:       # experiments/ is the checkout's, not installed: import it from here
    sys.path.insert(0, str(ROOT))
from experiments import cli as E, compare as C, scaling as S, servers as V, table1 as T  # noqa: E402
from harmony_opt.measure.synthetic import GPT2_SCALING, GPT2_XL, GPT2Shape, gpt2_profile

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
        plan = get_planner(name)(prof, hw, 16, hw.gpu_memory_bytes)
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
    cells = C.compare_cells([tiny_bundle], batches=(8,), gpus=(1, 2), time_limit=0.5,
                            gantt=(tiny_bundle, 8, 2, "vPP"))
    df, timelines = C.compare(cells, jobs=1)
    n2 = df[df.gpus_requested == 2]
    # both modes for ours and Harmony's on 2 GPUs, vPP only on 1; baselines once; one bound per cell
    assert sorted(n2[n2.planner == "cp-sat"].mode_requested) == ["vDP", "vPP"]
    assert list(df[(df.gpus_requested == 1) & (df.planner == "cp-sat")].mode_requested) == ["vPP"]
    assert (df.planner == "lower-bound").sum() == 2 and (df.planner == "naive-swap").sum() == 2
    assert set(df.status) <= {"ok", "infeasible", "skipped", "bound"}
    ok = df[df.status == "ok"]
    bound = df[df.planner == "lower-bound"].set_index("gpus_requested").iteration_s
    assert (ok.iteration_s.to_numpy() >= bound[ok.gpus_requested].to_numpy() * (1 - 1e-3)).all()
    best = C.best_per_cell(df)
    assert not best.duplicated(["model", "batch", "gpus_requested", "planner"]).any()
    ours = best[(best.planner == "cp-sat") & (best.gpus_requested == 2)].iteration_s.iloc[0]
    assert ours == n2[n2.planner == "cp-sat"].iteration_s.min()
    # what the planner reports of each of our plans, and its speed-up over Harmony's in the same mode
    mine = df[df.planner == "cp-sat"]
    assert set(C.COMPARE_SOLVER_COLUMNS) <= set(df.columns)
    assert mine.solver_config_status.isin(["OPTIMAL", "FEASIBLE", "NOT_SOLVED"]).all()
    assert (mine.speedup_vs_harmony >= 1 - 1e-3).all()      # iteration_s is rounded to 0.1 ms
    assert df[df.planner != "cp-sat"].solver_fidelity.isna().all()
    sp = C.speedups(df)
    assert len(sp) == 2 and (sp.speedup >= 1 - 1e-3).all()
    assert (sp.harmony_s / sp.ours_s == sp.speedup).all()
    paths = C.write_compare(df, timelines, tmp_path / "out", 0.5, C.BASELINE_BUDGET,
                            gantt_case=(tiny_bundle, 8, 2, "vPP"))
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "## Speed-up of ours over Harmony's search" in md and "solver_config_proof" in md
    assert "no cell was skipped" in md
    names = {p.name for p in paths}
    assert {"compare.csv", "compare.md", "compare_iteration_time.png", "compare_swap_volume.png",
            "compare_efficiency.png", "gantt_tiny_ours.png", "gantt_tiny_harmony.png"} <= names
    assert all(p.stat().st_size > 0 for p in paths)
    assert len(pd.read_csv(tmp_path / "out" / "compare.csv")) == len(df)


#: the columns issue #6 asks table1.csv for
TABLE1_REQUIRED = ["model", "layers", "harmony_configs", "harmony_search_s", "harmony_time_s", "ours_search_s",
                   "ours_time_s", "ours_bound_s", "ours_gap", "speedup"]


def test_table1_row_both_searches_and_solver_columns(tiny_bundle, tmp_path):
    """Harmony's search, ours at its settings and ours with mode and GPUs free; what plan.solver says."""
    row = T.table1_row(tiny_bundle, 2**30, time_limit=0.5, batch=8, gpus=4)
    df = pd.DataFrame([row])
    for prefix in ("ours_", "ours_free_"):
        for col in ("search_s", "search_ratio", "mode", "gpus", "time_s", "model_s", "fidelity", "bound_s", "gap",
                    "config_status", "config_proof", "config_gap", "timeline_gap", "found_by"):
            assert prefix + col in df.columns, prefix + col
        assert row[prefix + "config_status"] in {"OPTIMAL", "FEASIBLE", "NOT_SOLVED"}
        assert row[prefix + "config_proof"] in {"dp", "cp-sat", "none"}
        assert row[prefix + "search_ratio"] == pytest.approx(row[prefix + "search_s"] / row["harmony_search_s"])
        # the planner's model against the simulator, as the planner defines it
        if math.isfinite(row[prefix + "model_s"]):
            assert row[prefix + "fidelity"] == pytest.approx(
                abs(row[prefix + "model_s"] - row[prefix + "time_s"]) / row[prefix + "time_s"], rel=1e-6)
    assert row["ours_mode"] == "vPP" and row["ours_gpus"] == 4
    # both start from Harmony's plan: never slower than it (the free one also tries vDP and fewer GPUs)
    assert row["speedup"] >= 1 - 1e-9 and row["ours_free_speedup"] >= 1 - 1e-9
    assert row["harmony_any_mode_time_s"] <= row["harmony_time_s"] + 1e-9
    assert row["ours_free_speedup_any_mode"] == pytest.approx(row["harmony_any_mode_time_s"] / row["ours_free_time_s"])
    assert row["lower_bound_s"] <= min(row["ours_time_s"], row["ours_free_time_s"]) * (1 + 1e-9)
    paths = T.write_table1(df, tmp_path, 0.5)
    csv = pd.read_csv(tmp_path / "table1.csv")
    assert set(TABLE1_REQUIRED + T.TABLE1_OURS_MD + T.TABLE1_FREE_MD) <= set(csv.columns)
    md = (tmp_path / "table1.md").read_text()
    assert md.count("\n## ") == 3 and "ours_free_speedup" in md and "Machine:" in md
    assert {p.name for p in paths} == {"table1.csv", "table1.md"}


def test_scaling_row_on_a_small_gpt2(tmp_path):
    row = S.scaling_row("gpt2_tiny", 0.5, batch=4, gpus=2, shape=GPT2Shape(n_layer=2, n_embd=4096, n_head=32))
    assert row["layers"] == 6 and row["ours_time_s"] <= row["harmony_time_s"] * (1 + 1e-9)
    for col in ("ours_fidelity", "ours_gap", "ours_config_status", "ours_config_proof", "ours_timeline_gap",
                "ours_search_ratio", "ours_efficiency"):
        assert col in row
    paths = S.write_scaling(pd.DataFrame([row]), tmp_path, 0.5)
    assert {p.name for p in paths} == {"scaling.csv", "scaling.md", "scaling.png"}
    assert "ours_config_status" in (tmp_path / "scaling.md").read_text()


def test_servers_rows(tiny_bundle, tmp_path):
    df = V.servers(0.5, models=[tiny_bundle], batch=8, counts=(1, 2))
    # one server, two on each network; Harmony's search and ours in each mode
    assert len(df) == 12 and set(zip(df.planner, df.mode_requested)) == set(V.RUNS)
    assert sorted(set(df.gpus)) == [4, 8] and set(df[df.servers == 2].network) == set(V.NETWORKS)
    two = df[df.servers == 2]
    assert (two[two["mode"] == "vDP"].network_GB > 0).all() and (two.host_GiB_per_server > 0).all()
    assert (df.lower_bound_s <= df.iteration_s * (1 + 1e-9)).all()
    paths = V.write_servers(df, tmp_path, 0.5)
    assert {p.name for p in paths} == {"servers.csv", "servers.md", "servers.png"}
    assert "network_GB" in (tmp_path / "servers.md").read_text()


def test_compare_cell_skips_layerwise_baselines_over_budget(tiny_bundle):
    rows, _ = C.run_cell(C.CompareCell(tiny_bundle, 8, 1, time_limit=0.5, baseline_budget=10))
    df = pd.DataFrame(rows)
    skipped = df[df.status == "skipped"]
    assert sorted(skipped.planner) == ["l2l", "naive-swap"]
    assert skipped.note.str.contains("budget").all()
    assert "zero-offload" in set(df.planner)


def test_markdown_table_and_machine():
    md = markdown_table(pd.DataFrame({"a": [1, 2], "b": [0.5, math.nan], "c": ["x|y", None]}))
    assert md.splitlines()[0] == "| a | b | c |"
    assert md.splitlines()[3] == "| 2 |  |  |"
    assert "cores" in machine_description()


def test_reproduce_command_passes_the_experiments_options_on():
    from harmony_opt.cli import build_parser
    args = build_parser().parse_args(["reproduce", "compare", "--models", "bert_large", "--batches", "16",
                                      "--jobs", "1"])
    assert args.experiment == "compare" and args.options == ["--models", "bert_large", "--batches", "16", "--jobs", "1"]
    inner = E.build_parser().parse_args([args.experiment, *args.options])
    assert inner.experiment == "compare" and inner.jobs == 1 and inner.models == "bert_large"


def test_reproduce_from_the_cli_runs_the_checkouts_experiments(tiny_bundle, tmp_path, capsys):
    from harmony_opt.cli import main
    rc = main(["reproduce", "compare", "--models", tiny_bundle, "--batches", "8", "--gpus", "1", "--jobs", "1",
               "--time-limit", "0.5", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and f"wrote {tmp_path / 'compare.csv'}" in out
    assert set(pd.read_csv(tmp_path / "compare.csv").planner) >= {"cp-sat", "harmony", "lower-bound"}


def test_reproduce_without_a_checkout_says_where_to_run_it(monkeypatch, tmp_path, capsys):
    """An installed harmony_opt has no experiments/ beside it: one line, exit 2, naming the command."""
    import harmony_opt
    from harmony_opt.cli import main
    (tmp_path / "harmony_opt").mkdir()
    monkeypatch.setattr(harmony_opt, "__file__", str(tmp_path / "harmony_opt" / "__init__.py"))
    rc = main(["reproduce", "table1", "--time-limit", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("harmony-opt: error: reproduce runs the experiments of a checkout")
    assert "python -m experiments {table1,compare,scaling,servers,all} [options]" in err


@pytest.mark.parametrize("argv, message", [
    (["table1", "--models", "nope"], "--models 'nope': none is a model of Table 1"),
    (["compare", "--models", "nope"], "--models 'nope': none is a bundled profile"),
    (["compare", "--jobs", "0"], "--jobs must be >= 1, got 0"),
    (["compare", "--batches", "a,b"], "--batches 'a,b': give whole numbers"),
    (["servers", "--time-limit", "-1"], "--time-limit must be > 0 seconds"),
    (["tabel1"], "invalid choice: 'tabel1'"),
])
def test_experiments_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    rc = E.main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("python -m experiments: error: ") and message in err


def test_python_m_experiments_help_runs_from_the_checkout():
    out = subprocess.run([sys.executable, "-m", "experiments", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "{table1,compare,scaling,servers,all}" in out.stdout and "--out" in out.stdout
    from experiments.common import RESULTS_DIR
    assert RESULTS_DIR == ROOT / "experiments" / "results"
