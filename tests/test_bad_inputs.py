"""The bad-input corpus (tests/bad_inputs/manifest.toml): each case fails with its own error class and
message through the API, and through the command line as exit code 2 with one line on stderr.

The command-line half runs every case in one fresh interpreter, with the process's real stderr
(file descriptor 2) captured per case and Python's default warning filters, as a user's shell
would see it: so a warning, a library writing to the descriptor or a traceback counts as a
second line."""
from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from harmony_opt.core import errors
from harmony_opt.cli import main

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "tests/bad_inputs/manifest.toml"
CASES = tomllib.loads(MANIFEST.read_text())["case"]


def _api(case: dict):
    """The library call a program would make with this input."""
    from harmony_opt.core.bundled import load_profile
    from harmony_opt.core.hardware import Hardware, get_hardware
    from harmony_opt.core.plan import Plan
    from harmony_opt.core.profile import Profile
    from harmony_opt.compile.program import Program
    from harmony_opt.compile.validate import validate_program
    from harmony_opt.sim.simulator import simulate
    path = case["input"]
    kind = case["api"]
    if kind == "profile":
        return Profile.load(path)
    if kind == "hardware":
        return Hardware.load(path)
    if kind == "plan":
        return Plan.load(path)
    if kind == "simulate":
        plan = Plan.load(path)
        return simulate(plan, load_profile(plan.profile["name"]), Hardware.from_dict(plan.hardware))
    if kind == "program":
        return validate_program(Program.load(path))
    if kind == "write":
        return Plan.load("tests/bad_inputs/plans/gpt2_tiny_l2l_good.json").save(path)
    if kind == "checkpoint":
        from harmony_opt.runtime.checkpoint import load_checkpoint
        return load_checkpoint(path, plan_identity="", layers=[])
    hw = get_hardware(case["hardware"], memory_cap=case.get("memory_cap"))
    if kind == "hardware-spec":
        return hw
    profile = Profile.load(path)
    if kind == "baseline":
        from harmony_opt.planners.registry import get_planner
        return get_planner(case["planner"])(profile, hw, case["batch"], hw.gpu_memory_bytes, gpus=case.get("gpus"))
    if kind == "cp-sat":
        from harmony_opt.planners.registry import get_planner
        return get_planner("cp-sat")(profile, hw, case["batch"], hw.gpu_memory_bytes, time_limit=2)
    raise AssertionError(f"manifest: unknown api {kind!r}")


def test_corpus_is_large_and_inputs_exist():
    assert len(CASES) >= 25
    assert len({c["name"] for c in CASES}) == len(CASES)
    for c in CASES:
        path = ROOT / c["input"]
        assert path.exists() or c["api"] == "write", c["name"]
        assert issubclass(getattr(errors, c["error"]), errors.HarmonyOptError), c["name"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_api_raises_the_expected_class(case, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(errors.HarmonyOptError) as e:
        _api(case)
    assert type(e.value).__name__ == case["error"], str(e.value)
    assert case["fragment"] in str(e.value)


# Runs in a fresh interpreter: every case through harmony_opt.cli.main with file descriptors 1 and 2
# redirected to files, so whatever reaches the terminal is seen (Python and C writes, warnings).
_DRIVER = r"""
import json, os, sys, tempfile, tomllib
from harmony_opt.cli import main
out = []
for case in tomllib.loads(open(sys.argv[1]).read())["case"]:
    argv = [a.replace("{input}", case["input"]) for a in case["cli"]]
    with tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as std:
        sys.stdout.flush(); sys.stderr.flush()
        keep_out, keep_err = os.dup(1), os.dup(2)
        os.dup2(std.fileno(), 1); os.dup2(err.fileno(), 2)
        try:
            rc = main(argv)
        except BaseException as e:            # main must return a code, never raise
            rc = f"raised {type(e).__name__}"
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(keep_out, 1); os.dup2(keep_err, 2)
            os.close(keep_out); os.close(keep_err)
        err.seek(0)
        out.append({"name": case["name"], "rc": rc, "stderr": err.read().decode(errors="replace")})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    work = tmp_path_factory.mktemp("cli")       # outputs some commands would write land here, not in the repo
    for sub in ("tests",):
        (work / sub).symlink_to(ROOT / sub)
    proc = subprocess.run([sys.executable, "-c", _DRIVER, str(MANIFEST)], cwd=work, capture_output=True, text=True,
                          timeout=600, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["name"]: r for r in json.loads(proc.stdout.splitlines()[-1])}


def _env():
    import os
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("PYTHONWARNINGS", None)            # the filters a user's shell has
    return env


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_cli_exit_2_with_one_line(case, cli_results):
    res = cli_results[case["name"]]
    err = res["stderr"]
    assert res["rc"] == 2, err
    assert "Traceback" not in err and "Warning" not in err, err
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    assert err.startswith("harmony-opt: error: ") and case["fragment"] in err, err


@pytest.mark.parametrize("where", ["first", "last"])
def test_debug_shows_the_traceback(where, monkeypatch, capsys):
    """--debug before the command or appended to the line that failed (what the bug hint suggests)."""
    monkeypatch.chdir(ROOT)
    argv = ["show", "tests/bad_inputs/profiles/nan_time"]
    rc = main(["--debug"] + argv if where == "first" else argv + ["--debug"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" in err and "ProfileError" in err
    assert err.rstrip().splitlines()[-1].startswith("harmony-opt: error: ")


def test_internal_error_is_exit_1_with_a_hint(monkeypatch, capsys):
    import harmony_opt.commands.check as check

    def boom(args):
        raise KeyError("multi\nline")
    monkeypatch.setattr(check, "_check", boom)
    rc = main(["check", "."])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1
    assert "internal error: KeyError" in err and "this is a bug" in err and "--debug" in err
    rc = main(["--debug", "check", "."])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" in err and "KeyError" in err


def test_check_accepts_the_good_profile(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(["check", "tests/bad_inputs/profiles/good"]) == 0
    assert "ok: profile good, 3 layers" in capsys.readouterr().out
