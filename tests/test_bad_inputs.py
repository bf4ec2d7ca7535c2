"""The bad-input corpus (tests/bad_inputs/manifest.toml): each case fails with its own error class and
message through the API, and through the command line as exit code 2 with one line on stderr."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from harmony_opt import errors
from harmony_opt.cli import main

ROOT = Path(__file__).resolve().parent.parent
CASES = tomllib.loads((ROOT / "tests/bad_inputs/manifest.toml").read_text())["case"]


def _api(case: dict):
    """The library call a program would make with this input."""
    from harmony_opt.bundled import load_profile
    from harmony_opt.hardware import Hardware, get_hardware
    from harmony_opt.plan import Plan
    from harmony_opt.profile import Profile
    from harmony_opt.program import Program, validate_program
    from harmony_opt.simulator import simulate
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
    hw = get_hardware(case["hardware"], memory_cap=case.get("memory_cap"))
    if kind == "hardware-spec":
        return hw
    profile = Profile.load(path)
    if kind == "baseline":
        from harmony_opt.baselines import get_planner
        return get_planner(case["planner"])(profile, hw, case["batch"], hw.gpu_memory_bytes)
    if kind == "cp-sat":
        from solver_models.planner import PlannerOptions, plan
        return plan(profile, hw, case["batch"], PlannerOptions(time_limit=2), memory_cap=hw.gpu_memory_bytes)
    raise AssertionError(f"manifest: unknown api {kind!r}")


def test_corpus_is_large_and_inputs_exist():
    assert len(CASES) >= 25
    assert len({c["name"] for c in CASES}) == len(CASES)
    for c in CASES:
        assert (ROOT / c["input"]).exists(), c["name"]
        assert issubclass(getattr(errors, c["error"]), errors.HarmonyOptError), c["name"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_api_raises_the_expected_class(case, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(errors.HarmonyOptError) as e:
        _api(case)
    assert type(e.value).__name__ == case["error"], str(e.value)
    assert case["fragment"] in str(e.value)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_cli_exit_2_with_one_line(case, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    rc = main([a.replace("{input}", case["input"]) for a in case["cli"]])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("harmony-opt: error: ") and case["fragment"] in err


def test_debug_shows_the_traceback(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    rc = main(["--debug", "show", "tests/bad_inputs/profiles/nan_time"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" in err and "ProfileError" in err


def test_internal_error_is_exit_1_with_a_hint(monkeypatch, capsys):
    import harmony_opt.commands.check as check

    def boom(args):
        raise KeyError("multi\nline")
    monkeypatch.setattr(check, "_check", boom)
    rc = main(["check", "."])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1
    assert "internal error: KeyError" in err and "this is a bug" in err and "--debug" in err


def test_check_accepts_the_good_profile(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(["check", "tests/bad_inputs/profiles/good"]) == 0
    assert "ok: profile good, 3 layers" in capsys.readouterr().out
