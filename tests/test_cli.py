"""The command line as a user meets it: output, files, one-line errors with exit code 2."""
import json

import pytest

from harmony_opt.cli import main


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_profiles_lists_the_six_models(capsys):
    rc, out, _ = run(capsys, "profiles")
    assert rc == 0
    for name, gb in (("bert_large", "1.34"), ("bert_96", "4.97"), ("gpt2_medium", "1.63"), ("gpt2_xl", "6.55"),
                     ("vgg416", "2.31"), ("resnet1026", "3.21")):
        line = next(l for l in out.splitlines() if l.split()[0] == name)
        assert gb in line


def test_show_writes_a_figure(capsys, tmp_path):
    rc, out, _ = run(capsys, "show", "gpt2_medium", "--plot", str(tmp_path / "p.png"))
    assert rc == 0 and "28 layers" in out
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_baseline_then_simulate(capsys, tmp_path):
    plan = tmp_path / "l2l.json"
    rc, out, err = run(capsys, "baseline", "--planner", "l2l", "--profile", "gpt2_medium", "--batch", "8",
                       "--gpus", "2", "-o", str(plan))
    assert rc == 0, err
    assert json.loads(plan.read_text())["planner"] == "l2l"
    rc, out, err = run(capsys, "simulate", str(plan), "--plot", str(tmp_path / "g.png"),
                       "--trace", str(tmp_path / "t.json"))
    assert rc == 0, err
    assert "iteration time" in out and (tmp_path / "g.png").exists() and (tmp_path / "t.json").exists()


@pytest.mark.parametrize("argv,fragment", [
    (["show", "no_such_model"], "no profile 'no_such_model'"),
    (["show", "gpt2_xl", "-u", "50"], "outside the profiled"),
    (["baseline", "--planner", "magic", "--profile", "gpt2_xl", "--batch", "8"], "unknown planner"),
    (["baseline", "--planner", "l2l", "--profile", "gpt2_xl", "--batch", "8", "--hardware", "tpu"],
     "unknown hardware"),
    (["baseline", "--planner", "l2l", "--profile", "gpt2_xl", "--batch", "8", "--memory-cap", "1MB"],
     "alone needs"),
    (["baseline", "--planner", "zero-offload", "--profile", "gpt2_xl", "--batch", "8", "--memory-cap", "9e9"],
     "more than the cap"),
    (["simulate", "missing.json"], "does not exist"),
    (["plan", "--profile", "gpt2_xl"], "required"),
])
def test_bad_input_one_line_exit_2(capsys, argv, fragment):
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    assert fragment in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
