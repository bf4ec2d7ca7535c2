"""Training API and CLI: checkpoints that resume exactly, and bad input refused before any step."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from harmony_opt.cli import main
from harmony_opt.compile.compiler import compile_plan
from harmony_opt.measure.decompose import ClassificationLoss, LayeredModel
from harmony_opt.core.errors import DataError, PlanError, ProgramError, UsageError
from harmony_opt.compile.program import Kind
from harmony_opt.core.kinds import Tensor
from harmony_opt.core.plan import PackOptions, Plan
from harmony_opt.training import batch_seed, train


# one intra-op thread for every test here (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(batch: int, gen: torch.Generator):
    return torch.randn(batch, 8, generator=gen), torch.randint(4, (batch,), generator=gen)


def mlp(seed: int = 0) -> LayeredModel:
    torch.manual_seed(seed)
    layers = [nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
              nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4), ClassificationLoss()]
    return LayeredModel("mlp", layers, _batch, {"optimizer": "adam"})


def make_plan(**kw) -> Plan:
    d = dict(planner="test", mode="vPP", gpus=1, batch=6, microbatch_fwd=3, microbatch_bwd=2,
             packs_fwd=[(0, 1), (2, 2)], packs_bwd=[(0, 1), (2, 2), (3, 4)], num_layers=5,
             options=(PackOptions(recompute=False), PackOptions(), PackOptions()))
    d.update(kw)
    return Plan(**d)


def weights(model):
    return [{k: v.clone() for k, v in layer.state_dict().items()} for layer in model.layers]


def same(a, b) -> bool:
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


# -- checkpoints ------------------------------------------------------------------------------------------

def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    plan = make_plan()
    full = train(mlp(), plan, steps=6, progress=False)
    first = train(mlp(), plan, steps=3, checkpoint_dir=tmp_path, progress=False)
    assert first.losses == full.losses[:3]
    resumed = mlp(seed=123)                                 # other weights: the checkpoint's must win
    rest = train(resumed, plan, steps=6, checkpoint_dir=tmp_path, resume=True, progress=False)
    assert rest.start_step == 3 and rest.losses == full.losses
    assert same(rest.weights, full.weights)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


@pytest.mark.parametrize("mode", ["vDP", "vPP"])
def test_two_rank_checkpoint_gathers_every_ranks_optimizer_state(tmp_path, mode):
    plan = make_plan(mode=mode, gpus=2, batch=6, microbatch_fwd=3, microbatch_bwd=1)
    full = train(mlp(), plan, steps=4, progress=False)
    train(mlp(), plan, steps=2, checkpoint_dir=tmp_path, progress=False)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert sorted(state["optimizer"]) == ["0-1", "2-2", "3-4"]       # packs updated on ranks 0, 1 and 0
    assert all(s["state"] for s in state["optimizer"].values())        # Adam moments of every pack
    rest = train(mlp(), plan, steps=4, checkpoint_dir=tmp_path, resume=True, progress=False)
    assert same(rest.weights, full.weights) and rest.losses == full.losses


def test_resume_with_given_data_skips_the_batches_already_used(tmp_path):
    import harmony_opt

    plan = make_plan()
    data = [_batch(6, torch.Generator().manual_seed(100 + s)) for s in range(4)]
    full = harmony_opt.train(mlp(), plan, data, steps=4, optimizer="sgd", progress=False)   # the package's API
    train(mlp(), plan, data[:2], steps=2, optimizer="sgd", checkpoint_dir=tmp_path, checkpoint_every=1,
          progress=False)
    rest = train(mlp(), plan, data, steps=4, optimizer="sgd", checkpoint_dir=tmp_path, resume=True, progress=False)
    assert same(rest.weights, full.weights)


def test_resume_at_the_end_runs_nothing(tmp_path):
    plan = make_plan()
    done = train(mlp(), plan, steps=2, checkpoint_dir=tmp_path, progress=False)
    again = train(mlp(seed=5), plan, steps=2, checkpoint_dir=tmp_path, resume=True, progress=False)
    assert again.start_step == 2 and again.iteration_times == [] and again.losses == done.losses
    assert same(again.weights, done.weights)


def test_checkpoint_from_another_plan_is_refused(tmp_path):
    train(mlp(), make_plan(), steps=1, checkpoint_dir=tmp_path, progress=False)
    model = mlp()
    before = weights(model)
    with pytest.raises(DataError, match="written for another plan"):
        train(model, make_plan(microbatch_fwd=2), steps=2, checkpoint_dir=tmp_path, resume=True, progress=False)
    assert same(weights(model), before)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    train(mlp(), make_plan(), steps=1, checkpoint_dir=tmp_path, progress=False)
    other = mlp()
    other.layers[1] = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Tanh())
    with pytest.raises(DataError, match="layer 1 does not match the model"):
        train(other, make_plan(), steps=2, checkpoint_dir=tmp_path, resume=True, progress=False)


def test_missing_checkpoint_is_refused(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        train(mlp(), make_plan(), steps=2, checkpoint_dir=tmp_path / "none", resume=True, progress=False)
    with pytest.raises(UsageError, match="needs a checkpoint folder"):
        train(mlp(), make_plan(), steps=2, resume=True, progress=False)


def test_an_interrupted_checkpoint_write_leaves_the_previous_one(tmp_path, monkeypatch):
    plan = make_plan()
    train(mlp(), plan, steps=1, checkpoint_dir=tmp_path, progress=False)
    good = (tmp_path / "checkpoint.pt").read_bytes()

    def crash(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        train(mlp(), plan, steps=2, checkpoint_dir=tmp_path, resume=True, progress=False)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]
    assert (tmp_path / "checkpoint.pt").read_bytes() == good


# -- bad input, refused before any step --------------------------------------------------------------------

def test_plan_for_another_model_is_refused():
    with pytest.raises(PlanError, match="plan has 6 layers but model 'mlp' has 5"):
        train(mlp(), make_plan(num_layers=6, packs_bwd=[(0, 1), (2, 2), (3, 5)]), steps=1, progress=False)


def test_program_for_another_plan_is_refused():
    other = compile_plan(make_plan(microbatch_bwd=3))
    with pytest.raises(ProgramError, match="compiled from another plan"):
        train(mlp(), make_plan(), steps=1, program=other, progress=False)


def test_program_sized_for_another_model_is_refused():
    from harmony_opt.measure.shapes import measure_layer_bytes

    wide = mlp()
    wide.layers[1] = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Tanh())
    x, y = _batch(1, torch.Generator())
    program = compile_plan(make_plan(), layer_bytes=measure_layer_bytes(wide.layers, x, y))
    with pytest.raises(ProgramError, match="layer 1 has 1024 weight bytes; this model's has 1088"):
        train(mlp(), make_plan(), steps=1, program=program, progress=False)


def test_wrong_first_batch_size_is_refused_before_any_step(tmp_path):
    model = mlp()
    before = weights(model)
    data = [_batch(5, torch.Generator()), _batch(6, torch.Generator())]
    with pytest.raises(DataError, match=r"data batch 0: inputs hold 5 samples but the plan's minibatch is 6; .*"
                                        r"drop_last=True"):
        train(model, make_plan(), data, steps=2, checkpoint_dir=tmp_path, progress=False)
    assert same(weights(model), before)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("gpus", [1, 2])
def test_a_later_wrong_batch_stops_the_run_at_its_step(tmp_path, gpus):
    """Minibatches stream, so batch 2 is checked when step 2 draws it: steps 0 and 1 ran (their
    checkpoint, written every step, stays), the run stops there with the batch named."""
    plan = make_plan(mode="vDP", gpus=gpus, microbatch_bwd=3)
    data = [_batch(6, torch.Generator()), _batch(6, torch.Generator()), _batch(5, torch.Generator())]
    with pytest.raises(DataError, match="data batch 2: inputs hold 5 samples but the plan's minibatch is 6"):
        train(mlp(), plan, data, steps=3, checkpoint_dir=tmp_path, checkpoint_every=1, progress=False)
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 2


def test_data_that_does_not_fit_the_model_is_refused():
    data = [(torch.randn(6, 7), torch.randint(4, (6,)))]
    with pytest.raises(DataError, match=r"layer 0 \(Sequential\) fails on the data"):
        train(mlp(), make_plan(), data, steps=1, progress=False)


def test_too_little_data_is_refused():
    with pytest.raises(DataError, match="the data has 1 minibatches but 3 steps"):
        train(mlp(), make_plan(), [_batch(6, torch.Generator())], steps=3, progress=False)


def test_unknown_optimizer_and_device_are_refused():
    with pytest.raises(UsageError, match="optimizer 'lbfgs'"):
        train(mlp(), make_plan(), steps=1, optimizer="lbfgs", progress=False)
    with pytest.raises(UsageError, match="device"):
        train(mlp(), make_plan(), steps=1, device="tpu", progress=False)


def test_result_reports_speed_and_memory():
    res = train(mlp(), make_plan(), steps=3, progress=False)
    assert res.samples_per_s > 0 and len(res.iteration_times) == 3
    assert res.peak_device_bytes[0] > 0 and len(res.losses) == 3
    # every step copies each layer's weights in for the forward and the backward, and its gradients out
    weights = sum(q.numel() * q.element_size() for layer in mlp().layers for q in layer.parameters())
    assert res.bytes_moved[0]["h2d"] >= 3 * 2 * weights and res.bytes_moved[0]["d2h"] >= 3 * weights
    x, y = _batch(6, torch.Generator().manual_seed(batch_seed(0, 0)))
    with torch.no_grad():
        assert abs(res.losses[0] - mlp().loss(x, y).item()) < 1e-5


# -- command line -------------------------------------------------------------------------------------------

GPT2_PLAN = {"version": 1, "planner": "manual", "mode": "vPP", "gpus": 1, "batch": 4,
             "microbatch": {"fwd": 2, "bwd": 1}, "packs": {"fwd": [[0, 2], [3, 4]], "bwd": [[0, 2], [3, 4], [5, 7]]},
             "num_layers": 8, "memory_cap": 10**8, "profile": {"name": "gpt2-tiny"}}


def write_plan(path, **changes):
    path.write_text(json.dumps({**GPT2_PLAN, **changes}))
    return str(path)


def test_cli_compile_and_run_with_checkpoint(tmp_path, capsys):
    path = write_plan(tmp_path / "plan.json")
    assert main(["compile", path, "-o", str(tmp_path / "prog.json"), "--model", "gpt2-tiny"]) == 0
    out = capsys.readouterr().out
    assert "rank 0:" in out and "peak" in out and (tmp_path / "prog.json").is_file()
    assert main(["compile", path, "-o", str(tmp_path / "p2.json"), "--model", "gpt2-tiny",
                 "--memory-cap", "100kB"]) == 2
    assert "over the cap of 100000 bytes" in capsys.readouterr().err
    ck = tmp_path / "ck"
    assert main(["run", path, "--model", "gpt2-tiny", "--steps", "2", "--checkpoint", str(ck),
                 "--program", str(tmp_path / "prog.json")]) == 0
    out, err = capsys.readouterr()
    assert "gpt2-tiny: steps 0..1" in out and "samples/s" in out
    bar = err.replace("\r", "\n").splitlines()
    assert any("2/2" in x and "loss " in x and "samples/s" in x for x in bar), err     # the progress bar
    assert main(["run", path, "--model", "gpt2-tiny", "--steps", "3", "--checkpoint", str(ck), "--resume",
                 "--no-progress"]) == 0
    assert "steps 2..2" in capsys.readouterr().out
    # the resumed run ends exactly where an uninterrupted one does
    assert main(["run", path, "--model", "gpt2-tiny", "--steps", "3", "--checkpoint", str(tmp_path / "full"),
                 "--no-progress"]) == 0
    a, b = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (ck, tmp_path / "full"))
    assert a["step"] == b["step"] == 3 and a["losses"] == b["losses"]
    assert same(a["layers"], b["layers"])
    assert str(a["optimizer"]) == str(b["optimizer"])       # every Adam moment and step, bit for bit


def test_cli_refuses_bad_input_with_one_line_and_exit_2(tmp_path, capsys):
    """Each bad input: exit code 2, one line on stderr naming the problem, no step run, no checkpoint touched."""
    good = write_plan(tmp_path / "plan.json")
    ck = tmp_path / "ck"
    assert main(["run", good, "--model", "gpt2-tiny", "--steps", "1", "--checkpoint", str(ck), "--no-progress"]) == 0
    saved = (ck / "checkpoint.pt").read_bytes()
    capsys.readouterr()
    compile_plan(Plan.load(write_plan(tmp_path / "other.json", microbatch={"fwd": 4, "bwd": 2}))).save(
        tmp_path / "other-prog.json")
    six = write_plan(tmp_path / "six.json", num_layers=6, packs={"fwd": [[0, 2]], "bwd": [[0, 2], [3, 5]]})
    bert = write_plan(tmp_path / "bert.json", profile={"name": "bert-tiny"})
    cases = [
        (["run", six, "--model", "gpt2-tiny"], "the plan has 6 layers but model 'gpt2-tiny' has 8"),
        (["compile", six, "-o", str(tmp_path / "x.json"), "--model", "gpt2-tiny"], "six.json: the plan has 6 layers"),
        (["run", bert, "--model", "gpt2-tiny"], "made from a profile of 'bert-tiny', not of model 'gpt2-tiny'"),
        (["run", good, "--model", "gpt2-tiny", "--program", str(tmp_path / "other-prog.json")],
         "the program was compiled from another plan"),
        (["run", str(tmp_path / "other.json"), "--model", "gpt2-tiny", "--steps", "2", "--checkpoint", str(ck),
          "--resume"], "was written for another plan"),
        (["run", good, "--model", "gpt2-tiny", "--memory-cap", "20kB"],      # its progress bar is erased
         "no step ran: rank 0: instruction 0:IW[0-2]@i=539136: would hold 539136 bytes on the device, over the cap "
         "of 20000 bytes"),
    ]
    for argv, fragment in cases:
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        shown = err.rsplit("\r", 1)[-1]          # what a terminal shows: an erased progress bar leaves nothing
        assert shown.startswith("harmony-opt: error: ") and err.count("\n") == 1 and fragment in shown, (argv, err)
        assert "steps 0.." not in out
    assert sorted(p.name for p in ck.iterdir()) == ["checkpoint.pt"] and (ck / "checkpoint.pt").read_bytes() == saved
    assert main(["run", good, "--model", "gpt2-tiny", "--resume"]) == 2
    assert "--resume needs --checkpoint" in capsys.readouterr().err


def test_cli_run_and_compile_take_the_set_overrides_that_profile_took(tmp_path, capsys):
    """`profile gpt2-tiny --set n_layer=1` measures a 5-layer cut; run and compile build the same cut
    with the same --set (parsed as profile parses it), and refuse an unknown field in one line."""
    five = write_plan(tmp_path / "five.json", num_layers=5, packs={"fwd": [[0, 2]], "bwd": [[0, 2], [3, 4]]})
    assert main(["run", five, "--model", "gpt2-tiny", "--set", "n_layer=1", "--steps", "1", "--no-progress"]) == 0
    assert "gpt2-tiny: steps 0..0" in capsys.readouterr().out
    assert main(["compile", five, "-o", str(tmp_path / "prog.json"), "--model", "gpt2-tiny", "--set", "n_layer=1",
                 "--set", "n_embd=32"]) == 0
    assert "rank 0:" in capsys.readouterr().out
    for argv, fragment in [
        (["run", five, "--model", "gpt2-tiny", "--no-progress"], "the plan has 5 layers but model 'gpt2-tiny' has 8"),
        (["run", five, "--model", "gpt2-tiny", "--set", "n_layr=1"], "model gpt2-tiny: unknown option(s) n_layr"),
        (["run", five, "--model", "gpt2-tiny", "--set", "n_layer"], "--set 'n_layer': write KEY=VALUE"),
        (["compile", five, "-o", str(tmp_path / "x.json"), "--set", "n_layer=1"], "give it with --model"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and fragment in err, (argv, err)


def test_trace_times_every_instruction_of_the_last_step():
    res = train(mlp(), make_plan(), steps=2, progress=False, trace=True)
    tl = res.timeline()
    ev = tl.events
    timed = [x for x in res.program.ranks[0] if x.kind is not Kind.FREE]
    kept = [x for x in timed if x.kind is Kind.FWD and x.tensor is Tensor.SA]
    copies = ev[(ev.stream == "swap_out") & (ev.kind == "sA")]
    assert kept and len(ev) == len(timed) + len(kept) and set(ev.task) - set(copies.task) == {str(x) for x in timed}
    # a forward that keeps its graph copies the saved activations to the host in line: traced as the
    # forward, then a swap-out of sA of the copies' time, carrying their bytes (as the simulator has them)
    for x in kept:
        fwd = ev[ev.task == str(x)]
        out = copies[(copies.pack == fwd.pack.iloc[0]) & (copies.microbatch == fwd.microbatch.iloc[0])]
        assert len(fwd) == len(out) == 1
        assert out.start.iloc[0] == fwd.end.iloc[0] and out.bytes.iloc[0] > 0 and fwd.bytes.iloc[0] == 0
    assert (ev.end >= ev.start).all() and (ev.start >= 0).all() and ev.end.max() <= tl.iteration_time
    # the bytes each instruction copied (a stashing forward too), summed: the step's share of the count
    assert ev.bytes.sum() == (res.bytes_moved[0]["h2d"] + res.bytes_moved[0]["d2h"]) / 2
    assert ev[ev.stream == "swap_in"].bytes.sum() > 0 and ev[ev.stream == "swap_out"].bytes.sum() > 0
    assert set(ev.stream) >= {"compute", "swap_in", "swap_out", "cpu"} and tl.busy_time("cpu")[0] > 0
    # memory over the step: it rises and returns to nothing, never above what the memory guard saw
    mem = tl.memory.sort_values("time")
    assert mem.bytes.iloc[-1] == 0 and 0 < tl.peak_memory()[0] <= res.peak_device_bytes[0]
    with pytest.raises(UsageError, match="trace=True"):
        train(mlp(), make_plan(), steps=1, progress=False).timeline()


def test_traced_steps_are_the_last_and_every_other_before_it():
    from harmony_opt.runtime.worker import traced_steps
    assert traced_steps(0, 9, 4) == [2, 4, 6, 8] and traced_steps(0, 9, 10) == [2, 4, 6, 8]
    assert traced_steps(0, 5, 1) == [4] and traced_steps(3, 6, 2) == [5]      # a resumed run: from its own step
    assert traced_steps(0, 1, 3) == [0] and traced_steps(0, 2, 3) == [1] and traced_steps(0, 4, 0) == []


def test_several_traced_steps_and_the_untraced_between_them():
    res = train(mlp(), make_plan(), steps=7, progress=False, trace=3)
    assert res.traced == [2, 4, 6]
    tls = res.timelines()
    assert [t.iteration_time for t in tls] == [res.iteration_times[i] for i in (2, 4, 6)]
    timed = sum(x.kind is not Kind.FREE for x in res.program.ranks[0])
    assert all(len(t.events) >= timed for t in tls) and len({len(t.events) for t in tls}) == 1
    assert res.timeline().iteration_time == res.iteration_times[6] and res.trace[0] == res.traces[0][-1]
    # the steps that time the plan: neither the first (warm-up) nor a traced one
    times = res.iteration_times
    assert res.untraced_step_time() == sorted([times[1], times[3], times[5]])[1]
    assert res.settled_step_time() == pytest.approx(sum(sorted(times[1:])[2:4]) / 2)   # calibrate closes on it
    # a stream of unknown length traces every step and keeps the newest
    data = (_batch(6, torch.Generator().manual_seed(s)) for s in range(4))
    res = train(mlp(), make_plan(), data, progress=False, trace=2)
    assert res.traced == [2, 3] and len(res.timelines()) == 2


def test_instructions_are_named_in_a_profiler_trace_only_while_it_records(monkeypatch):
    """The named range costs about 7 us per instruction: a tenth of a tiny model's L2L step on the CPU."""
    from harmony_opt.runtime import executor
    entered = []
    real = executor.record_function
    monkeypatch.setattr(executor, "record_function", lambda name: entered.append(name) or real(name))
    train(mlp(), make_plan(), steps=1, progress=False)
    assert entered == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        res = train(mlp(), make_plan(), steps=1, progress=False)
    names = {e.name for e in prof.events()}
    every = {f"H:{x}" for x in res.program.ranks[0]}
    assert set(entered) == every and every <= names


def test_cli_run_writes_the_measured_trace_and_gantt(tmp_path, capsys):
    path = write_plan(tmp_path / "plan.json")
    trace, png = tmp_path / "t.json", tmp_path / "g.png"
    assert main(["run", path, "--model", "gpt2-tiny", "--steps", "2", "--no-progress", "--trace", str(trace),
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "last step" in out and "compute" in out and "swap_in" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["args"]["task"].split(":")[1][0] for e in events if e["ph"] == "X"} >= {"F", "B", "I", "O"}
    assert png.stat().st_size > 10_000
    # an output path that cannot be written is refused before any training
    (tmp_path / "afile").write_text("")
    assert main(["run", path, "--model", "gpt2-tiny", "--steps", "2", "--no-progress", "--trace",
                 str(tmp_path / "afile" / "t.json")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--trace" in err and len(err.strip().splitlines()) == 1
