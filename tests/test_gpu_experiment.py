"""The GPU experiment's logic (experiments/gpu/), run on the CPU with tiny models and caps."""
from __future__ import annotations

import json
import signal

import pandas as pd
import pytest

from experiments.gpu.__main__ import main


@pytest.mark.slow
def test_quick_experiment_writes_every_table_and_the_figure(tmp_path):
    args = ["--quick", "--device", "cpu", "--root", str(tmp_path), "--models", "gpt2-tiny,vgg-tiny",
            "--caps", "0.002", "--methods", "ours,naive-swap,torch-offload,deepspeed", "--steps", "2",
            "--warmup", "1"]
    assert main(args) == 0
    res = tmp_path / "experiments" / "results"
    runs = pd.read_csv(res / "gpu_runs.csv")
    # the trained cases are those whose footprint is at least 4x the cap; vgg-tiny's is not
    assert set(runs.model) == {"gpt2-tiny", "vgg-tiny"}
    assert (runs[runs.model == "vgg-tiny"].method == "-").all()
    gpt = runs[runs.model == "gpt2-tiny"].set_index("method")
    assert (gpt.footprint_GB >= 4 * 0.002).all()
    for m in ("ours", "naive-swap", "torch-offload"):
        assert gpt.loc[m, "status"] == "ok" and gpt.loc[m, "samples_per_s"] > 0 and gpt.loc[m, "steps"] == 2
    for m in ("ours", "naive-swap"):      # plans: simulated and measured side by side, bytes counted,
        assert gpt.loc[m, "measured_over_simulated"] > 0 and gpt.loc[m, "moved_h2d_GB"] > 0
        for stream in ("compute", "cpu", "h2d", "d2h"):    # and each stream's busy time against the simulator's
            assert gpt.loc[m, f"busy_{stream}_over_sim"] > 0
    assert (res / "gpu" / "gpt2_tiny_cap0.002GB" / "ours.trace.json").exists()
    assert (res / "gpu_busy_by_stream.png").stat().st_size > 10_000
    # and by kind of work, from the trace and the simulator's iteration of the same plan:
    # the measured work and the modelled one are both there for each kind, for each traced run
    kinds = pd.read_csv(res / "gpu_by_kind.csv").set_index(["method", "kind"])
    for kind in ("forward", "backward", "CPU step", "weights in"):
        assert kinds.loc[("ours", kind), "measured_s"] > 0 and kinds.loc[("ours", kind), "simulated_s"] > 0
    assert "by kind of work" in (res / "gpu_summary.md").read_text()
    assert "CUDA" in gpt.loc["deepspeed", "status"] or "DeepSpeed" in gpt.loc["deepspeed", "status"]
    corr = pd.read_csv(res / "gpu_correctness.csv")
    assert len(corr) == 6 and (corr.max_rel_error < 1e-4).all() and (corr.moved_by_training > 1e-3).all()
    assert (res / "gpu_samples_per_s.png").stat().st_size > 10_000
    # a second call resumes: nothing is measured again; one stage alone runs alone
    before = (res / "gpu" / "gpt2_tiny_cap0.002GB" / "ours.run.json").stat().st_mtime_ns
    assert main(args) == 0
    assert main([*args, "--stages", "plan"]) == 0
    assert (res / "gpu" / "gpt2_tiny_cap0.002GB" / "ours.run.json").stat().st_mtime_ns == before


@pytest.mark.slow
def test_handoff_stage_trains_a_plan_both_ways_and_reports_it(tmp_path):
    """Stage ``handoff``: the case's plan with its gradients kept on the GPU and through host memory,
    trained alternately; the same training (same losses), fewer swaps and bytes, both simulated."""
    import json

    from harmony_opt.core.plan import Plan

    args = ["--quick", "--device", "cpu", "--root", str(tmp_path), "--models", "gpt2-tiny", "--caps", "0.002",
            "--methods", "ours", "--steps", "2", "--warmup", "1"]
    assert main([*args, "--stages", "probe,profile,plan"]) == 0
    case = tmp_path / "experiments" / "results" / "gpu" / "gpt2_tiny_cap0.002GB"
    info = json.loads((case / "case.json").read_text())
    info["batch"] = 4                     # one backward microbatch of 4: every backward handoff can stay
    (case / "case.json").write_text(json.dumps(info))
    R = Plan.load(case / "ours.plan.json").num_layers
    bwd = [(k, k) for k in range(R - 2)] + [(R - 2, R - 1)]
    Plan("test", "vPP", 1, 4, 2, 4, [(0, 2), (3, R - 3)], bwd, R).save(case / "ours.plan.json")
    assert main([*args, "--stages", "handoff,report"]) == 0
    h = json.loads((case / "handoff.json").read_text())
    assert h["swaps"]["kept"] == h["swaps"]["host"] - 2 * (len(bwd) - 1)     # dX out, dY in at each boundary
    assert [(r["plan"], r["ok"]) for r in h["runs"]] == [("host", True), ("kept", True)] * 3
    assert h["simulated_kept_s"] <= h["simulated_host_s"]
    table = pd.read_csv(tmp_path / "experiments" / "results" / "gpu_handoff.csv").iloc[0]
    assert table.status == "ok" and table.moved_kept_GB < table.moved_host_GB
    assert table.loss_last_kept == pytest.approx(table.loss_last_host, rel=1e-6)
    assert "Gradients kept on the GPU" in (tmp_path / "experiments" / "results" / "gpu_summary.md").read_text()


@pytest.mark.parametrize("bad, says", [(["--methods", "ours,foo"], "--methods: unknown foo"),
                                       (["--caps", "abc"], "--caps: cannot read"),
                                       (["--models", "gpt2-xl"], "--models: unknown gpt2-xl"),
                                       (["--gpu", "nowhere", "--stages", "plan"], "profile folder")])
def test_bad_input_is_one_line_and_exit_2(bad, says, tmp_path, capsys):
    before = signal.getsignal(signal.SIGTERM)
    assert main(["--quick", "--device", "cpu", "--root", str(tmp_path), *bad]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1
    # the time limit's SIGTERM handler is the command's alone: a caller's own SIGTERM (pytest under
    # `timeout`) must not become a SystemExit inside whatever test runs next
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_broken_result_file_is_one_line_and_exit_2(tmp_path, capsys):
    """A result an earlier stage left half-written (its process killed mid-write, a hand edit): the
    report names the file and says what to do, in one line."""
    case = tmp_path / "experiments" / "results" / "gpu" / "gpt2_tiny_cap0.002GB"
    case.mkdir(parents=True)
    (case / "case.json").write_text('{"model": "gpt2-tiny", ')
    assert main(["--quick", "--device", "cpu", "--root", str(tmp_path), "--stages", "report"]) == 2
    err = capsys.readouterr().err.strip()
    assert "case.json: line 1: not valid JSON" in err and "delete it" in err and len(err.splitlines()) == 1


def test_cached_model_build_has_the_same_weights_and_buffers(tmp_path):
    import torch

    from experiments.gpu.trial import build_cached
    from harmony_opt.measure.models import build_model

    fresh = build_model("resnet-tiny", norm="batch")                 # BatchNorm: buffers too
    first = build_cached("resnet-tiny", {"norm": "batch"}, tmp_path)   # builds and saves
    again = build_cached("resnet-tiny", {"norm": "batch"}, tmp_path)   # loads
    assert any(True for layer in again.layers for _ in layer.buffers())
    assert len(list(tmp_path.iterdir())) == 1
    for a, b, c in zip(fresh.layers, first.layers, again.layers):
        ta, tb, tc = (dict(x.named_parameters()) | dict(x.named_buffers()) for x in (a, b, c))
        assert ta.keys() == tc.keys() and all(torch.equal(ta[k], tc[k]) and torch.equal(ta[k], tb[k]) for k in ta)
    x, y = fresh.make_batch(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert again.loss(x, y).item() == fresh.loss(x, y).item()


def test_first_recompute_excess_counts_packs_with_later_microbatches_only():
    from experiments.gpu.first_rec import first_rec_excess

    def ev(name, ts, dur):
        return {"ph": "X", "name": name, "ts": ts * 1e3, "dur": dur * 1e3, "tid": 0}
    trace = {"traceEvents": [{"ph": "M", "name": "thread_name"},
                             ev("REC 4-7", 0, 10), ev("BWD 4-7", 10, 3), ev("REC 4-7", 13, 5), ev("REC 4-7", 18, 4),
                             ev("REC 0-3", 22, 9), ev("BWD 0-3", 31, 2)]}
    got = first_rec_excess(trace)
    # pack 4-7: first 10 ms against the shortest later one, 4 ms; pack 0-3 has no later microbatch
    assert got == {"step_ms": 33.0, "packs": 1, "excess_ms": 6.0, "later_rec_ms": 9.0}


def test_first_recompute_host_times_are_read_from_the_last_step(tmp_path, capsys):
    from experiments.gpu.first_rec import host_excess, main as first_rec
    rows = [[1, "(4, 7)", 0, 50.0], [1, "(4, 7)", 1, 1.0],          # a warm-up step: not counted
            [2, "(4, 7)", 1, 2.0], [2, "(4, 7)", 0, 7.0], [2, "(4, 7)", 2, 3.0], [2, "(0, 3)", 0, 9.0]]
    assert host_excess(rows) == {"packs": 1, "excess_ms": 5.0, "later_rec_ms": 5.0}
    path = tmp_path / "host.json"
    path.write_text(json.dumps(rows))
    assert first_rec(["--host", str(path)]) == 0
    assert "5.0 ms over 1 packs" in capsys.readouterr().out
    path.write_text('{"a": 1}')
    assert first_rec(["--host", str(path)]) == 2
    err = capsys.readouterr().err
    assert "no host times" in err and len(err.strip().splitlines()) == 1


def test_first_recompute_tool_says_in_one_line_what_is_wrong_with_its_input(tmp_path, capsys):
    from experiments.gpu.first_rec import main as first_rec
    not_a_trace = tmp_path / "t.json"
    not_a_trace.write_text('{"a": 1}')
    for path, says in ((tmp_path / "missing.json", "does not exist"), (not_a_trace, "no timed events")):
        assert first_rec([str(path)]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1
    for args in ([], ["--host"]):
        assert first_rec(args) == 2
        err = capsys.readouterr().err
        assert "give the traces to read" in err and len(err.strip().splitlines()) == 1
