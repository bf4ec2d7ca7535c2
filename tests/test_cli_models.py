"""The command line with a user's own model (`--model file.py:function`, `package.module:function`),
a data file (`run --data`), the trained weights written out (`run --save`), and their bad inputs:
one line on stderr, exit code 2."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from torch import nn

from harmony_opt.cli import main
from harmony_opt.core.errors import UsageError
from harmony_opt.core.plan import Plan
from harmony_opt.measure.models import resolve_model
from harmony_opt.training import SampleSlices, train

pytestmark = pytest.mark.usefixtures("one_thread")

USER_MODEL = textwrap.dedent('''
    import torch
    from torch import nn
    from harmony_opt.measure.decompose import LayeredModel, decompose

    class Scaled(nn.Module):
        """A layer class of the user's own: rank processes must import this file to unpickle it."""
        def __init__(self, width):
            super().__init__()
            self.linear = nn.Linear(width, width)
        def forward(self, x):
            return torch.tanh(self.linear(x)) * 0.5

    def make_batch(batch, gen):
        return torch.randn(batch, 8, generator=gen), torch.randint(4, (batch,), generator=gen)

    def build(width=16):
        body = nn.Sequential(nn.Sequential(nn.Linear(8, width), nn.Tanh()), Scaled(width), Scaled(width),
                             nn.Linear(width, 4))
        return LayeredModel("mine", decompose(body, nn.CrossEntropyLoss()), make_batch, {"optimizer": "sgd"})

    def not_a_model():
        return nn.Linear(2, 2)

    def broken():
        raise ValueError("no weights here")

    def batch_norm():
        body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
        return LayeredModel("bn", decompose(body, nn.CrossEntropyLoss()), make_batch, {"optimizer": "sgd"})

    class Last(nn.Module):
        def forward(self, x):
            return x[0][:, -1]

    def recurrent():
        body = nn.Sequential(nn.Unflatten(1, (2, 4)), nn.LSTM(4, 8, batch_first=True), Last(), nn.Linear(8, 4))
        return LayeredModel("lstm", decompose(body, nn.CrossEntropyLoss()), make_batch, {"optimizer": "sgd"})

    def seq_first():
        body = nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), Mean(), nn.Linear(8, 4))
        return LayeredModel("seq", decompose(body, nn.CrossEntropyLoss()),
                            lambda b, g: (torch.randn(5, b, 8, generator=g), torch.randint(4, (b,), generator=g)))

    class Mean(nn.Module):
        def forward(self, x):
            return x.mean(0)
''')

PLAN = {"version": 1, "planner": "manual", "mode": "vPP", "gpus": 1, "batch": 6, "microbatch": {"fwd": 3, "bwd": 2},
        "packs": {"fwd": [[0, 1], [2, 2]], "bwd": [[0, 1], [2, 2], [3, 4]]}, "num_layers": 5,
        "memory_cap": 10**8, "profile": {"name": "mine"}}


@pytest.fixture
def user_files(tmp_path):
    """The user's model file, a plan for it, and a data file of 20 samples (three minibatches of 6)."""
    model_file = tmp_path / "my_model_cli.py"
    model_file.write_text(USER_MODEL)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    gen = torch.Generator().manual_seed(3)
    data = {"inputs": torch.randn(20, 8, generator=gen), "targets": torch.randint(4, (20,), generator=gen)}
    torch.save(data, tmp_path / "data.pt")
    yield tmp_path, f"{model_file}:build", data
    sys.modules.pop("my_model_cli", None)


def one_line_error(capsys, argv, fragment):
    assert main(argv) == 2, argv
    out, err = capsys.readouterr()
    shown = err.rsplit("\r", 1)[-1]
    assert shown.startswith("harmony-opt: error: ") and err.count("\n") == 1 and fragment in shown, (argv, err)
    return out


def test_profile_compile_and_run_a_users_model_on_a_data_file_and_save_it(user_files, capsys):
    tmp, spec, data = user_files
    assert main(["profile", spec, "--set", "width=12", "--device", "cpu", "--microbatch", "1,2", "--repeats", "1",
                 "--warmup", "0", "--no-progress", "-o", str(tmp / "prof")]) == 0
    assert "5 layers" in capsys.readouterr().out
    assert main(["compile", str(tmp / "plan.json"), "-o", str(tmp / "prog.json"), "--model", spec,
                 "--set", "width=12"]) == 0
    assert "peak" in capsys.readouterr().out
    assert main(["run", str(tmp / "plan.json"), "--model", spec, "--set", "width=12", "--data", str(tmp / "data.pt"),
                 "--epochs", "2", "--optimizer", "sgd", "--save", str(tmp / "out"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "mine: steps 0..5" in out and "the last 2 samples of each epoch" in out and "model.pt" in out
    saved = torch.load(tmp / "out" / "model.pt", weights_only=True)
    # the same training through the API: the model the CLI resolved, the data file's slices, two epochs
    model = resolve_model(spec, width=12)
    res = train(model, Plan.load(tmp / "plan.json"), SampleSlices(data["inputs"], data["targets"], 6), epochs=2,
                optimizer="sgd", progress=False)
    assert saved.keys() == {f"{l}.{k}" for l, sd in enumerate(res.weights) for k in sd}
    assert all(torch.equal(saved[f"{l}.{k}"], v) for l, sd in enumerate(res.weights) for k, v in sd.items())
    nn.Sequential(*model.layers).load_state_dict(saved)         # the keys nn.Sequential of the layers has


def test_a_users_model_trains_on_two_ranks(user_files, capsys):
    """Rank processes unpickle the user's layer class: they import the user's file by its name."""
    tmp, spec, _ = user_files
    plan = tmp / "two.json"
    plan.write_text(json.dumps({**PLAN, "gpus": 2}))
    assert main(["run", str(plan), "--model", spec, "--steps", "2", "--clip-grad-norm", "0.1", "--no-progress"]) == 0
    assert "mine: steps 0..1" in capsys.readouterr().out


def test_a_module_function_spec(tmp_path, monkeypatch, capsys):
    pkg = tmp_path / "user_pkg_cli"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(USER_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    assert main(["run", str(plan), "--model", "user_pkg_cli.models:build", "--steps", "1", "--no-progress"]) == 0
    assert "mine: steps 0..0" in capsys.readouterr().out
    assert resolve_model("user_pkg_cli.models:build", width=4).layers[1].linear.in_features == 4
    with pytest.raises(UsageError, match="returned Linear, not a harmony_opt.measure.decompose.LayeredModel"):
        resolve_model("user_pkg_cli.models:not_a_model")


def test_bad_model_specs_are_one_line(user_files, capsys):
    tmp, spec, _ = user_files
    plan = str(tmp / "plan.json")
    (tmp / "raises_on_import.py").write_text("raise RuntimeError('half written')\n")
    for model, extra, fragment in [
        (str(tmp / "none.py") + ":build", [], "no such file"),
        (str(tmp / "my_model_cli.py") + ":nope", [], "has no function 'nope'"),
        (str(tmp / "my_model_cli.py") + ":not_a_model", [], "not_a_model() returned Linear, not a harmony_opt"),
        (str(tmp / "my_model_cli.py") + ":broken", [], "broken() raised ValueError: no weights here"),
        (str(tmp / "raises_on_import.py") + ":build", [], "importing"),
        (spec, ["--set", "depth=3"], "build(depth=3) raised TypeError"),
        ("no_such_module_xyz:build", [], "no module named 'no_such_module_xyz'"),
        ("gpt9", [], "unknown model 'gpt9'; valid names: gpt2-medium"),
    ]:
        for argv in (["run", plan, "--model", model, "--no-progress"],
                     ["compile", plan, "-o", str(tmp / "p.json"), "--model", model],
                     ["profile", model, "--device", "cpu", "-o", str(tmp / "prof")]):
            one_line_error(capsys, argv + extra, fragment)
    assert not (tmp / "prof").exists()            # refused before the output folder was made


def test_a_layer_that_fails_on_a_size_is_named_and_no_folder_is_left(user_files, capsys):
    """BatchNorm in training cannot take one sample: the user's model fails, not the profiler. The
    layer and the size are named in one line; the output folder made for it is not left behind."""
    tmp, spec, _ = user_files
    model = spec.replace(":build", ":batch_norm")
    one_line_error(capsys, ["profile", model, "--device", "cpu", "-u", "1,2", "--no-progress", "-o", str(tmp / "prof")],
                   "model bn: layer 1 (BatchNorm1d) fails on a microbatch of 1: ValueError: Expected more than 1 "
                   "value per channel when training")
    assert not (tmp / "prof").exists()
    assert main(["profile", model, "--device", "cpu", "-u", "2,4", "--no-progress", "-o", str(tmp / "prof")]) == 0


def test_a_layer_that_returns_a_tuple_is_named(user_files, capsys):
    """nn.LSTM returns (output, (h, c)); packs hand one tensor on, so the layer is refused in one line
    with the fix, not an internal error in the profiler, and no output folder is left."""
    tmp, spec, _ = user_files
    one_line_error(capsys, ["profile", spec.replace(":build", ":recurrent"), "--device", "cpu", "-u", "1,2",
                            "--no-progress", "-o", str(tmp / "prof")],
                   "model lstm: layer 1 (LSTM) returns a tuple, not one tensor: a layer hands one tensor to the next")
    assert not (tmp / "prof").exists()


def test_a_batch_with_its_samples_off_dimension_0_is_refused_before_profiling(user_files, capsys):
    """A sequence-first transformer's make_batch puts the samples on dimension 1; microbatches are
    slices of dimension 0, so profiling it would time slices of the sequence. Refused up front."""
    tmp, spec, _ = user_files
    one_line_error(capsys, ["profile", spec.replace(":build", ":seq_first"), "--device", "cpu", "-u", "1,2",
                            "--no-progress", "-o", str(tmp / "prof")],
                   "make_batch(1, generator) returned 5 inputs and 1 targets; make_batch must return exactly the "
                   "number of samples it is asked for, on dimension 0")
    assert not (tmp / "prof").exists()


def test_bad_data_files_and_outputs_are_one_line(user_files, capsys):
    tmp, spec, data = user_files
    plan = str(tmp / "plan.json")
    torch.save({"inputs": data["inputs"]}, tmp / "no_targets.pt")
    torch.save({"inputs": data["inputs"], "targets": data["targets"][:10]}, tmp / "ragged.pt")
    torch.save({"inputs": data["inputs"][:4], "targets": data["targets"][:4]}, tmp / "short.pt")
    torch.save({"inputs": data["inputs"], "targets": data["targets"], "why": nn.Linear(1, 1)}, tmp / "code.pt")
    (tmp / "text.pt").write_text("inputs,targets\n1,2\n")
    (tmp / "afile").write_text("")
    for extra, fragment in [
        (["--data", str(tmp / "missing.pt")], "missing.pt does not exist"),
        (["--data", str(tmp / "text.pt")], "text.pt: not a readable torch file"),
        (["--data", str(tmp / "code.pt")], "code.pt: not a readable torch file"),     # weights_only: no objects
        (["--data", str(tmp / "no_targets.pt")], "expected a dict with tensors 'inputs' and 'targets', got ['inputs']"),
        (["--data", str(tmp / "ragged.pt")], "must hold the same number of samples"),
        (["--data", str(tmp / "short.pt")], "holds 4 samples, fewer than one minibatch of 6"),
        (["--epochs", "2"], "--epochs counts passes over --data"),
        (["--data", str(tmp / "data.pt"), "--steps", "7"], "the data has 3 minibatches but 7 steps"),
        (["--save", str(tmp / "afile")], "--save"),
        (["--clip-grad-norm", "0"], "clip_grad_norm must be a number > 0"),
    ]:
        out = one_line_error(capsys, ["run", plan, "--model", spec, "--no-progress"] + extra, fragment)
        assert "steps 0.." not in out
