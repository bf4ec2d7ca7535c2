"""The GPU experiment's logic (experiments/gpu/), run on the CPU with tiny models and caps."""
from __future__ import annotations

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
    assert "CUDA" in gpt.loc["deepspeed", "status"] or "DeepSpeed" in gpt.loc["deepspeed", "status"]
    corr = pd.read_csv(res / "gpu_correctness.csv")
    assert len(corr) == 4 and (corr.max_rel_error < 1e-4).all() and (corr.moved_by_training > 1e-3).all()
    assert (res / "gpu_samples_per_s.png").stat().st_size > 10_000
    # a second call resumes: nothing is measured again; one stage alone runs alone
    before = (res / "gpu" / "gpt2_tiny_cap0.002GB" / "ours.run.json").stat().st_mtime_ns
    assert main(args) == 0
    assert main([*args, "--stages", "plan"]) == 0
    assert (res / "gpu" / "gpt2_tiny_cap0.002GB" / "ours.run.json").stat().st_mtime_ns == before


@pytest.mark.parametrize("bad, says", [(["--methods", "ours,foo"], "--methods: unknown foo"),
                                       (["--caps", "abc"], "--caps: cannot read"),
                                       (["--models", "gpt2-xl"], "--models: unknown gpt2-xl"),
                                       (["--gpu", "nowhere", "--stages", "plan"], "profile folder")])
def test_bad_input_is_one_line_and_exit_2(bad, says, tmp_path, capsys):
    assert main(["--quick", "--device", "cpu", "--root", str(tmp_path), *bad]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_cached_model_build_has_the_same_weights_and_buffers(tmp_path):
    import torch

    from experiments.gpu.trial import build_cached
    from harmony_opt.models import build_model

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
