"""The command line as a user meets it: output, files, one-line errors with exit code 2."""
import json
import re
from pathlib import Path

import pytest

from harmony_opt.cli import main

GOOD = str(Path(__file__).resolve().parent / "bad_inputs" / "profiles" / "good")    # a small valid profile folder


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
    # the plan's host memory beside the hardware's budgets (harmony_opt.sim.host_memory)
    assert re.search(r"^host memory: [\d.]+ GiB \(weights and buffers [\d.]+ GiB, optimizer state .*activation "
                     r"buffers .*hardware 1080ti-x4 has 256.00 GiB, 192.00 GiB pinnable$", out, re.M), out
    assert "warning" not in out


def test_baseline_names_any_planner_of_the_registry_ours_too(capsys, tmp_path):
    """`baseline --planner cp-sat` is ours through the registry, with --mode and --gpus as the others take them."""
    plan = tmp_path / "ours.json"
    rc, out, err = run(capsys, "baseline", "--planner", "cp-sat", "--profile", GOOD,
                       "--batch", "2", "--gpus", "1", "--mode", "vPP", "-o", str(plan))
    assert rc == 0, err
    assert out.startswith("cp-sat: vPP on 1 GPU(s)")
    saved = json.loads(plan.read_text())
    assert saved["planner"] == "cp-sat" and saved["gpus"] == 1 and saved["solver"]


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
    (["show", "gpt2_xl", "-u", "0"], "microbatch 0 is outside the profiled"),
    (["baseline", "--planner", "l2l", "--profile", "gpt2_xl", "--batch", "8", "--gpus", "-1"], "give 1 to 4"),
    (["plan", "--profile", "gpt2_xl", "--batch", "8", "--gpus", "0"], "give 1 to 4"),
    (["plan", "--profile", "gpt2_xl", "--batch", "8", "--wall-limit", "0"], "--wall-limit must be > 0 seconds"),
    (["plan", "--profile", "gpt2_xl", "--batch", "8", "--processes", "0"], "--processes must be >= 1"),
    (["plan", "--profile", "gpt2_xl", "--batch", "8", "--time-limit", "inf"], "--time-limit must be > 0 seconds"),
    (["compare", "--profile", "gpt2_medium", "--batch", "4", "--memory-cap", "1MB", "--time-limit", "1"],
     "no planner found a plan; layer 0 of gpt2_medium alone needs"),
])
def test_bad_input_one_line_exit_2(capsys, argv, fragment):
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    assert fragment in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_compare_prints_why_a_planner_has_no_plan_in_full(capsys):
    """The table stays narrow; the refusal (how much memory against which cap) is not cut off."""
    rc = main(["compare", "--profile", "gpt2_medium", "--batch", "4", "--gpus", "1", "--time-limit", "1",
               "--memory-cap", "2GiB"])
    out = capsys.readouterr().out
    assert rc == 0
    row = next(line for line in out.splitlines() if line.lstrip().startswith("zero-offload "))
    assert row.split()[-4:] == ["no", "plan", "(see", "below)"]
    assert ("zero-offload: gpt2_medium needs 12.26 GiB (13162675200 bytes) on each GPU with all weights "
            "(1.61 GiB) resident at microbatch 1, more than the cap of 2.00 GiB (2147483648 bytes)") in out.splitlines()


def test_output_path_that_is_a_folder_is_exit_2(capsys, tmp_path):
    rc, out, err = run(capsys, "baseline", "--planner", "l2l", "--profile", "gpt2_medium", "--batch", "8",
                       "--gpus", "2", "-o", str(tmp_path))
    assert rc == 2 and err == f"harmony-opt: error: -o {tmp_path}: is a folder; give a file name such as plan.json\n"
    assert list(tmp_path.iterdir()) == []     # no temporary file left behind


@pytest.mark.parametrize("argv", [
    ["plan", "--profile", "gpt2_xl", "--batch", "64", "-o", "{f}/plan.json"],
    ["baseline", "--planner", "harmony", "--profile", "gpt2_xl", "--batch", "64", "-o", "{f}/plan.json"],
    ["compare", "--profile", "gpt2_xl", "--batch", "64", "--plot", "{f}/gantt.png"],
])
def test_a_bad_output_path_fails_before_the_search(capsys, tmp_path, monkeypatch, argv):
    """A user should not wait for a search whose result cannot be written."""
    import harmony_opt.planners.registry
    import harmony_opt.solver_models.planner

    def searched(*a, **k):
        raise AssertionError("the search ran before the output path was checked")
    monkeypatch.setattr(harmony_opt.solver_models.planner, "plan", searched)
    monkeypatch.setattr(harmony_opt.planners.registry, "get_planner", searched)
    a_file = tmp_path / "not_a_folder"
    a_file.write_text("")
    argv = [x.format(f=a_file) for x in argv]
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and err == f"harmony-opt: error: {argv[-2]}: cannot write {argv[-1]}: {a_file} is a file, not a " \
                              f"folder; choose another path (a file in a writable folder) or free some space\n"


def test_a_plan_from_a_profile_folder_finds_it_without_profile(capsys, tmp_path, monkeypatch):
    """A plan made from a profile folder records the folder's absolute path: simulate and check find
    it without --profile; a moved or changed folder is one line, exit 2, naming the folder and
    saying to pass --profile; --profile still wins. Plans written before (no path) read as before."""
    import shutil
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "good"
    shutil.copytree(Path(__file__).resolve().parent / "bad_inputs/profiles/good", folder)
    rc, _, err = run(capsys, "baseline", "--planner", "l2l", "--profile", "good", "--batch", "2", "--gpus", "1",
                     "-o", "p.json")
    assert rc == 0, err
    rc, _, err = run(capsys, "plan", "--profile", "good", "--batch", "2", "--gpus", "1", "--time-limit", "1",
                     "--no-compare", "--quiet", "-o", "cp.json")
    assert rc == 0, err
    for plan in ("p.json", "cp.json"):
        assert json.loads((tmp_path / plan).read_text())["profile"]["path"] == str(folder.resolve())
    monkeypatch.chdir(tmp_path / "..")      # the path is absolute: found from any folder
    for cmd in ("simulate", "check"):
        for plan in ("p.json", "cp.json"):
            rc, out, err = run(capsys, cmd, str(tmp_path / plan))
            assert rc == 0 and err == "", (cmd, plan, err)
    monkeypatch.chdir(tmp_path)
    # the folder moved: one line naming it; --profile with its new place still works
    folder.rename(tmp_path / "moved")
    # (a plan written before plans recorded the folder: the name only, read as before)
    old = json.loads(Path("p.json").read_text())
    del old["profile"]["path"]
    Path("old.json").write_text(json.dumps(old))
    rc, _, err = run(capsys, "simulate", "old.json")
    assert rc == 2 and "the plan's profile 'good' is not a bundled profile or a folder here; pass --profile" in err
    for cmd in ("simulate", "check"):
        rc, _, err = run(capsys, cmd, "p.json")
        assert rc == 2 and err == (f"harmony-opt: error: p.json: the plan's profile folder {folder.resolve()} no "
                                   f"longer exists; pass --profile with the profile folder the plan was made "
                                   f"from\n"), err
        rc, _, err = run(capsys, cmd, "p.json", "--profile", str(tmp_path / "moved"))
        assert rc == 0, err
    # the folder is back but its profile changed: one line naming it
    shutil.copytree(tmp_path / "moved", folder)
    micro = folder / "microbatch.csv"
    lines = micro.read_text().splitlines()
    cells = lines[1].split(",")
    cells[3] = repr(float(cells[3]) * 2)    # gpu_time_s of the first row
    micro.write_text("\n".join([lines[0], ",".join(cells), *lines[2:]]) + "\n")
    assert lines[0].split(",")[3] == "gpu_time_s"
    rc, _, err = run(capsys, "simulate", "p.json")
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"p.json: the profile in {folder.resolve()} has changed since the plan was made" in err
    assert "pass --profile" in err
    rc, _, err = run(capsys, "simulate", "p.json", "--profile", str(tmp_path / "moved"))
    assert rc == 0, err
    # plans of bundled profiles carry the name and hash only (their files stay byte for byte as before),
    # whether the profile is named or its folder given
    from harmony_opt.core.bundled import load_profile, profile_ident, profiles_dir
    for spec in ("gpt2_medium", str(profiles_dir() / "gpt2_medium")):
        assert list(profile_ident(load_profile(spec))) == ["name", "identity"]


def test_plan_says_when_the_wall_limit_decided(capsys):
    """A work budget of a minute under a 2 s wall limit: the plan comes back in seconds, and the
    output warns that the same command may give another plan elsewhere."""
    rc, out, err = run(capsys, "plan", "--profile", "resnet1026", "--batch", "64", "--memory-cap", "10GiB",
                       "--time-limit", "60", "--wall-limit", "2", "--no-compare", "--quiet")
    assert rc == 0 and err == ""
    assert "note: --wall-limit 2 stopped the search before its work budget" in out
    assert "simulated iteration time" in out


@pytest.mark.parametrize("argv, cores, want", [((), {0, 1, 2}, 3), ((), set(range(16)), 4), ((), {5}, 1),
                                               (("--processes", "1"), {0, 1, 2}, 1)])
def test_plan_uses_the_cores_it_may_run_on_unless_told(capsys, monkeypatch, argv, cores, want):
    """Without --processes, plan runs on the cores its affinity allows (at most 4; the plan is the
    same for any number, tests/test_determinism.py); --processes N overrides it."""
    import os

    import harmony_opt.solver_models.planner as planner
    from harmony_opt.core.errors import UsageError

    seen = []

    def fake_plan(profile, hw, batch, opts, **kw):
        seen.append(opts.processes)
        raise UsageError("stop here")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores, raising=False)
    monkeypatch.setattr(planner, "plan", fake_plan)
    rc, _, err = run(capsys, "plan", "--profile", "bert_large", "--batch", "8", "--quiet", *argv)
    assert (rc, seen) == (2, [want]) and "stop here" in err


def test_plan_says_when_harmonys_search_took_the_budget():
    """GPT-2 100B under --time-limit 10: Harmony's search for the warm start is charged 13 of the 9 work
    seconds and the plan is Harmony's; the user is told, with a limit that leaves room (49 s gave
    1.018x). Not where the search found a faster plan, nor where the hint took little."""
    from harmony_opt.commands.planning import hint_note
    starved = {"hint_work_s": 13.0, "work_budget_s": 9.0, "speedup_over_harmony": 1.0}
    note = hint_note(starved, 10.0)
    assert note.startswith("note: Harmony's search (the warm start) took 13.0 of the 9.0 work seconds")
    assert note.endswith("--time-limit 49 or more leaves it two thirds of its budget")
    assert hint_note({**starved, "speedup_over_harmony": 1.018}, 10.0) is None
    assert hint_note({**starved, "hint_work_s": 2.0}, 10.0) is None
    assert hint_note({"speedup_over_harmony": 1.0}, 10.0) is None          # a plan saved before the field


def test_plan_says_whether_it_carries_the_timeline_models_order_of_the_swaps():
    """The summary names the order the plan keeps: the timeline model's (with both simulated times),
    or Harmony's when the model's is no faster or none was found; the timeline gap is then said to be
    the rule order's. Where the search left the timeline model too little budget, it says so."""
    from harmony_opt.commands.planning import solver_summary
    tl = {"status": "FEASIBLE", "objective": 3.5192, "bound": 3.4592, "gap": 0.0171, "order_bound": 3.4548,
          "order_gap": 0.0183}
    step7 = {"status": "OPTIMAL", "objective": 3.4702, "bound": 3.4565, "streams": 1, "simulated": 3.5396,
             "rule_simulated": 3.5512, "kept": True}
    kept = "\n".join(solver_summary({"timeline": {**tl, "transfer_order": step7}}))
    assert "events in Harmony's transfer order (CP-SAT feasible): 3.5192 s" in kept
    assert "its order (1 stream reordered) simulates in 3.5396 s against 3.5512 s in Harmony's: the plan carries it" \
        in kept
    slower = "\n".join(solver_summary({"timeline": {**tl, "transfer_order": {**step7, "simulated": 3.56,
                                                                              "kept": False}}}))
    assert "simulates in 3.5600 s, no faster than Harmony's: the plan keeps Harmony's" in slower
    assert "in Harmony's transfer order" not in slower
    none = "\n".join(solver_summary({"timeline": {**tl, "transfer_order": {**step7, "streams": 0, "kept": False}}}))
    assert none.endswith("no faster order found: the plan keeps Harmony's")
    assert "choosing the order" not in "\n".join(solver_summary({"timeline": {**tl, "transfer_order": None}}))
    # where the search left too little of the budget for the timeline model, the summary says it did not run
    searched = {"objective": 3.52, "model": "pipeline", "fidelity": 0.001, "bound": 3.40, "gap": 0.034, "evaluated": 3,
                "pruned": 1, "timeline": None}
    assert "timeline model of this plan's events: not run" in "\n".join(solver_summary(searched))
    assert "not run" not in "\n".join(solver_summary({**searched, "timeline": tl}))


@pytest.mark.parametrize("line,fragment", [("compute_scale = 0", "compute_scale must be a finite number > 0"),
                                           ("h2d_latency_s = -1", "h2d_latency_s must be a finite number of seconds")])
def test_a_bad_execution_term_in_a_hardware_file_is_exit_2(capsys, tmp_path, line, fragment):
    from harmony_opt.core.hardware import PRESETS
    f = PRESETS["1080ti-x4"].save(tmp_path / "hw.toml")
    f.write_text(f.read_text() + line + "\n")
    rc, _, err = run(capsys, "baseline", "--planner", "l2l", "--profile", "gpt2_medium", "--batch", "8",
                     "--hardware", str(f))
    assert rc == 2 and fragment in err and str(f) in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_minibatch_of_too_many_microbatches_is_refused_at_once(capsys):
    """Batch 1e8 of gpt2_medium (sizes up to 9) ran for hours with no word, its simulations and program
    check outside the search's budget: now one line, before any work."""
    from harmony_opt.commands.planning import MAX_MICROBATCHES
    for cmd in (["plan", "--time-limit", "1"], ["baseline", "--planner", "harmony"], ["compare"]):
        argv = cmd + ["--profile", "gpt2_medium", "--hardware", "1080ti-x4", "--batch", str(10**8)]
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--batch 100000000: at least 11,111,112 microbatches of 9" in err, err
    argv[-1] = str(9 * MAX_MICROBATCHES + 1)              # one sample over the limit
    assert main(argv) == 2 and f"at least {MAX_MICROBATCHES + 1:,} microbatches" in capsys.readouterr().err
