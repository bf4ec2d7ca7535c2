"""Calibration: the fit recovers known cost terms from a synthetic step, the command refuses bad input
in one line, and a real CPU run calibrates and reports its plan's promise."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

from harmony_opt import get_hardware
from harmony_opt.calibrate import (CLOSE_TOLERANCE, _line, busy_by_work, calibrate, close_step, fit_hardware,
                                   host_instruction, idle_time, instruction_gap, instruction_gaps, neutral, scaled,
                                   work_of)
from harmony_opt.cli import main
from harmony_opt.core.errors import UsageError
from harmony_opt.core.hardware import Hardware
from harmony_opt.core.plan import PackOptions, Plan, forward_instructions
from harmony_opt.sim.simulator import simulate
from harmony_opt.sim.timeline import HOST_COLUMNS, Timeline

from conftest import synthetic_profile

HW = get_hardware("1080ti-x4").with_gpus(2)
#: the terms the synthetic step is made with
COMPUTE, ISSUE, H2D_BW, H2D_LAT, D2H_BW, D2H_LAT, CPU_SCALE, CPU_CALL = 0.8, 50e-6, 2e9, 30e-6, 3e9, 20e-6, 1.5, 1e-3
GPU_STEP_SLOWER, ALL_REDUCE_BW, ALL_REDUCE_LAT, P2P_BW, P2P_LAT = 2.0, 4e9, 300e-6, 5e9, 40e-6


def _plan(mode="vPP", gpus=1, gpu_step=False) -> Plan:
    bwd = [(0, 0), (1, 1), (2, 3), (4, 5), (6, 6), (7, 7)]     # 5 CPU steps or more: enough to fit a fixed cost
    opts = tuple(PackOptions(recompute=i != 1, optimizer="gpu" if gpu_step and i == 2 else "cpu")
                 for i in range(len(bwd)))
    return Plan("test", mode, gpus, 8, 2, 2, [(0, 2), (3, 6)], bwd, 8, options=opts)


def _synthetic(tl: Timeline, n_ranks: int) -> Timeline:
    """The simulated step as a machine with known terms would run it: each event's duration from the
    neutral one by the terms (the start times do not matter to the fit); a compute event pays ISSUE
    per instruction (a recomputing backward pack's event is two, the recompute and the backward, where
    the simulator plays them as one; a forward pack's, one per piece the compiler cuts it into)."""
    ev = tl.events.copy()
    d = (ev.end - ev.start).to_numpy(dtype=float, copy=True)
    split = set(ev.pack[(ev.stream == "compute") & (ev.kind == "REC")])      # recompute events of their own
    recomputes = {f"{a}-{b}" for (a, b), o in zip(_plan().packs_bwd, _plan().options) if o.recompute} - split
    pieces = {f"{a}-{b}": n for (a, b), n in forward_instructions(_plan().packs_fwd, _plan().packs_bwd).items()}
    for i, (s, k, b, p) in enumerate(zip(ev.stream, ev.kind, ev.bytes, ev.pack)):
        w = work_of(s, k)
        if w in ("forward", "backward"):
            d[i] = COMPUTE * d[i] + ISSUE * (pieces[p] if w == "forward" else 2 if p in recomputes else 1)
        elif w in ("weights in", "activations in"):
            d[i] = b / H2D_BW + H2D_LAT
        elif w in ("weights out", "activations out"):
            d[i] = b / D2H_BW + D2H_LAT
        elif w == "CPU step":
            d[i] = CPU_SCALE * d[i] + CPU_CALL
        elif w == "GPU step":
            d[i] = GPU_STEP_SLOWER * d[i]
        elif w == "all-reduce":
            d[i] = 2 * (n_ranks - 1) / n_ranks * b / ALL_REDUCE_BW + ALL_REDUCE_LAT
        elif w == "GPU to GPU":
            d[i] = b / P2P_BW + P2P_LAT
    ev["end"] = ev.start + d
    return Timeline(ev, float(ev.end.max()), ranks=tl.ranks, meta={"source": "measured"})


def test_a_gpu_step_fit_recovers_its_call_and_holds_the_per_tensor_cost():
    """Every backward pack stepped on the GPU (six groups, two sizes): the fit recovers the cost per
    call besides the bandwidth, and leaves no per-tensor cost to charge on top of what it fitted; a
    plan without GPU steps keeps the input's (the probe's) terms."""
    call, per = 150e-6, 9e-6
    prof = synthetic_profile(R=8)
    hw = dataclasses.replace(HW, gpu_optimizer_call_s=1.0, gpu_optimizer_tensor_s=per)   # the probe's
    bwd = [(0, 0), (1, 1), (2, 3), (4, 5), (6, 6), (7, 7)]
    plan = Plan("test", "vPP", 1, 8, 2, 2, [(0, 2), (3, 6)], bwd, 8,
                options=tuple(PackOptions(optimizer="gpu") for _ in bwd))
    sim = simulate(plan, prof, neutral(hw))
    ev = sim.events.copy()
    gpu = (ev.stream == "compute") & (ev.kind == "GPU_UPD")
    assert gpu.sum() == len(bwd)
    ev.loc[gpu, "end"] = ev.start[gpu] + GPU_STEP_SLOWER * (ev.end - ev.start)[gpu] + call
    got = fit_hardware(Timeline(ev, float(ev.end.max()), ranks=1, meta={"source": "measured"}), sim, hw, plan).hardware
    _close(got.gpu_optimizer_call_s, call)
    _close(got.gpu_optimizer_bandwidth, hw.gpu_optimizer_bandwidth / GPU_STEP_SLOWER)
    assert got.gpu_optimizer_tensor_s == 0
    plain = _plan()
    sim = simulate(plain, prof, neutral(hw))
    kept = fit_hardware(_synthetic(sim, 1), sim, hw, plain).hardware
    assert (kept.gpu_optimizer_call_s, kept.gpu_optimizer_tensor_s) == (1.0, per)


def _serial(step: Timeline, gap: float) -> Timeline:
    """``step``'s events but the CPU steps (which run on a thread beside), one at a time on one rank, each
    starting ``gap`` after the one before it ends: a serial device's time between instructions."""
    ev = step.events.sort_values("start")
    ev = ev[ev.stream != "cpu"].reset_index(drop=True)
    t = 0.0
    for i in ev.index:
        d = ev.at[i, "end"] - ev.at[i, "start"]
        ev.at[i, "start"] = t + gap
        ev.at[i, "end"] = t = t + gap + d
    return Timeline(ev, t, ranks=1, meta={"source": "measured"})


#: the host's time issuing an instruction that is not compute, and between one issue and the next
HOST_ISSUE, HOST_GAP = 40e-6, 60e-6


def _with_host(step: Timeline) -> Timeline:
    """``step`` with the host's issue times of a GPU run: per rank, its events (but the CPU steps, which
    run on a thread beside) issued in start order, a compute instruction for as long as its kernels run
    (launch-bound), any other for HOST_ISSUE, HOST_GAP between one and the next."""
    ev = step.events.sort_values(["rank", "start"]).reset_index(drop=True)
    ev["task"] = [f"{i}:{s}" for i, s in enumerate(ev.stream)]
    rows = []
    for r, g in ev[ev.stream != "cpu"].groupby("rank"):
        t = 0.0
        for name, s, k, a, b in zip(g.task, g.stream, g.kind, g.start, g.end):
            d = b - a if s == "compute" else HOST_ISSUE
            rows.append((int(r), name, str(k).lower(), t, t + d))
            t += d + HOST_GAP
    return Timeline(ev, step.iteration_time, ranks=step.ranks, meta=dict(step.meta),
                    host=pd.DataFrame(rows, columns=HOST_COLUMNS))


def _close(a, b):
    assert a == pytest.approx(b, rel=1e-6), (a, b)


@pytest.mark.parametrize("mode,gpus,gpu_step", [("vPP", 1, False), ("vPP", 2, True), ("vDP", 2, True)])
def test_fit_recovers_known_terms_from_a_synthetic_step(mode, gpus, gpu_step):
    prof, plan = synthetic_profile(R=8), _plan(mode, gpus, gpu_step)
    hw = dataclasses.replace(HW, compute_scale=3.0, h2d_latency_s=1.0)     # ignored: the fit is against neutral
    sim = simulate(plan, prof, neutral(hw))
    cal = fit_hardware(_synthetic(sim, gpus), sim, hw, plan)
    got = cal.hardware
    _close(got.compute_scale, COMPUTE)
    _close(got.issue_overhead_s, ISSUE)
    _close(got.h2d_bandwidth, H2D_BW)
    _close(got.h2d_latency_s, H2D_LAT)
    _close(got.d2h_bandwidth, D2H_BW)
    _close(got.d2h_latency_s, D2H_LAT)
    _close(got.cpu_optimizer_scale, CPU_SCALE)
    _close(got.cpu_optimizer_call_s, CPU_CALL)
    if gpu_step:
        _close(got.gpu_optimizer_bandwidth, hw.gpu_optimizer_bandwidth / GPU_STEP_SLOWER)
    if mode == "vDP":
        _close(got.collective_bandwidth, ALL_REDUCE_BW)
        _close(got.collective_latency_s, ALL_REDUCE_LAT)
    else:
        assert got.collective_bandwidth is None and got.collective_latency_s == 0
    if mode == "vPP" and gpus > 1:      # activations handed between GPUs
        _close(got.p2p_bandwidth, P2P_BW)
        _close(got.p2p_latency_s, P2P_LAT)
    else:
        assert got.p2p_bandwidth == hw.p2p_bandwidth and got.p2p_latency_s == 0
    # the rest is kept, and the shared link still runs as many copies at once
    assert got.copy_overlap == hw.copy_overlap
    assert got.link_slots == hw.link_slots
    # the fitted formulas price the simulated events as they were measured, kind by kind
    for work, secs in cal.measured.items():
        _close(cal.fitted[work], secs)
    # one pack's GPU step (on each replica): its cost per call cannot be told from its bytes, and the fit says so
    assert not cal.unmatched and cal.notes == ([f"GPU step: {gpus if mode == 'vDP' else 1} matched group(s) of one "
                                                f"shape: the slope alone, through the origin (the fixed cost needs "
                                                f"events of different sizes)"] if gpu_step else [])


@pytest.mark.parametrize("mode,gpus", [("vPP", 1), ("vPP", 2), ("vDP", 2)])
def test_host_time_per_instruction_is_fitted_from_the_issue_times(mode, gpus):
    prof, plan = synthetic_profile(R=8), _plan(mode, gpus)
    hw = dataclasses.replace(HW, host_instruction_s=1e-3)
    sim = simulate(plan, prof, neutral(hw))
    step = _synthetic(sim, gpus)
    # per rank: every instruction's gap, and the issue of those that are not compute, over its events
    counted = sim.events[sim.events.stream != "cpu"]
    want = np.mean([(len(g) * HOST_GAP + (g.stream != "compute").sum() * HOST_ISSUE) / len(g)
                    for _, g in counted.groupby("rank")])
    assert host_instruction(_with_host(step), sim) == pytest.approx(want, rel=1e-9)
    got = fit_hardware(_with_host(step), sim, hw, plan)
    assert got.hardware.host_instruction_s == pytest.approx(want, rel=1e-9)
    assert any("per instruction besides the compute kernels" in n for n in got.notes)
    # a step without issue times (the CPU device, a trace of an older run) keeps the input's term
    assert host_instruction(step, sim) is None
    assert fit_hardware(step, sim, hw, plan).hardware.host_instruction_s == hw.host_instruction_s


def test_one_shape_of_event_fits_the_slope_alone_and_says_so():
    """Every CPU step of one size: the per-call cost cannot be told from the scale."""
    prof = synthetic_profile(R=4)
    plan = Plan("test", "vPP", 1, 4, 2, 2, [], [(0, 3)], 4)
    sim = simulate(plan, prof, neutral(HW))
    cal = fit_hardware(_synthetic(sim, 1), sim, HW, plan)
    assert cal.hardware.cpu_optimizer_call_s == 0.0
    _close(cal.hardware.cpu_optimizer_scale, CPU_SCALE + CPU_CALL / float(
        (sim.events[sim.events.stream == "cpu"].end - sim.events[sim.events.stream == "cpu"].start).sum()))
    assert any(n.startswith("CPU step: 1 matched group(s) of one shape") for n in cal.notes)


def test_a_fixed_cost_is_fitted_only_where_the_groups_tell_it():
    """Three groups whose noise alone sets the intercept (Harmony's plan of a small model): the input's
    fixed cost is kept and the slope fitted with it. Twelve groups of the same machine with less
    noise: the fixed cost is fitted, near the true one, and the input's is ignored."""
    x, n = np.array([1.0, 2.0, 3.5]), np.ones(3)
    y = 1.0 * x + 0.1 + np.array([0.3, -0.2, -0.1])      # true: slope 1, fixed 0.1
    _, free_fixed, _ = _line(x, n, y, 1.0, True)
    assert free_fixed > 0.3                               # the free fit takes the noise for a fixed cost
    slope, fixed, note = _line(x, n, y, 1.0, True, fixed0=0.1)
    assert fixed == 0.1 and slope == pytest.approx(float(x @ (y - 0.1) / (x @ x)))
    assert "do not tell the fixed cost" in note
    # noise the other way, the free fixed cost below 0: three groups do not tell that either, and the
    # input's is kept; twelve groups of a machine without a fixed cost do, and it is 0
    y = 1.0 * x + 0.1 + np.array([-0.3, 0.2, 0.1])
    slope, fixed, note = _line(x, n, y, 1.0, True, fixed0=0.1)
    assert fixed == 0.1 and "do not tell the fixed cost" in note
    rng = np.random.default_rng(2)
    x12, n12 = np.linspace(1.0, 12.0, 12), rng.integers(1, 4, 12).astype(float)
    y12 = 1.0 * x12 - 0.01 * n12 + rng.normal(0, 0.002, 12)
    slope, fixed, note = _line(x12, n12, y12, 1.0, True, fixed0=0.1)
    assert fixed == 0.0 and slope == pytest.approx(float(x12 @ y12 / (x12 @ x12))) and "negative" in note
    rng = np.random.default_rng(0)
    x = np.linspace(1.0, 12.0, 12)
    n = rng.integers(1, 4, 12).astype(float)
    y = 1.0 * x + 0.1 * n + rng.normal(0, 0.005, 12)
    slope, fixed, note = _line(x, n, y, 1.0, True, fixed0=0.5)
    assert slope == pytest.approx(1.0, rel=0.01) and fixed == pytest.approx(0.1, rel=0.1) and note == ""


def test_kinds_at_different_ratios_to_the_profile_are_not_a_fixed_cost():
    """Harmony's plan of a 12-layer BERT at 12x its largest layer, pooled over nine traced steps (the
    compute groups as measured on the CPU): its forward ran at 1.28x the profile and its backward packs
    at 1.06-1.19x. One slope for both read that as 668 us per instruction (the probed cost: 38 us),
    and L2L, of many more instructions, was predicted 1.5x slower than it ran. Tested within each kind,
    the groups do not tell a fixed cost; where the kinds' groups do show one, it is fitted."""
    x = np.array([5.488, 8.177, 6.061, 6.082, 4.258]) * 1e-3
    n = np.array([3.0, 2.0, 2.0, 2.0, 2.0])
    y = np.array([7.042, 8.840, 6.495, 6.469, 5.059]) * 1e-3
    kinds = ["forward"] + ["backward"] * 4
    assert _line(x, n, y, 1.0, True, fixed0=37.9e-6)[1] > 10 * 37.9e-6
    slope, fixed, note = _line(x, n, y, 1.0, True, fixed0=37.9e-6, kinds=kinds)
    assert fixed == 37.9e-6 and "do not tell the fixed cost" in note
    _close(slope, float(x @ (y - fixed * n) / (x @ x)))
    rng = np.random.default_rng(1)
    x = np.array([2.0, 3.0, 4.0, 1.0, 1.5, 2.0, 3.0])
    n = np.array([3.0, 3.0, 3.0, 2.0, 2.0, 2.0, 2.0])
    kinds = ["forward"] * 3 + ["backward"] * 4
    y = 1.2 * x + 0.2 * n + rng.normal(0, 1e-3, 7)
    slope, fixed, note = _line(x, n, y, 1.0, True, fixed0=0.01, kinds=kinds)
    assert fixed == pytest.approx(0.2, rel=0.05) and slope == pytest.approx(1.2, rel=0.01) and note == ""



def test_groups_of_like_work_do_not_trade_the_slope_for_a_fixed_cost():
    """Harmony's plan of a 12-layer BERT at 4x its largest layer, pooled over 15 traced steps on the
    CPU: 14 compute groups of one block each, whose profiled times differ only by the profile's noise
    (4.3-5.6 ms for like blocks). The measured times did not follow that noise, and the free fit,
    F-test passed, read them as 3.0 ms per instruction and a compute scale of 0.05, which predicted
    other plans up to 39 % off. Its slope's standard error is 6x the slope: the input's fixed cost is
    kept and the slope fitted with it."""
    x = np.array([5.263, 7.359, 5.324, 5.324, 4.622, 4.622, 5.579, 5.579, 4.299, 4.299, 4.642, 4.642, 4.522,
                  4.522]) * 1e-3
    n = np.array([2.0, 3.0] + [2.0] * 12)
    y = np.array([6.787, 9.425, 6.629, 7.227, 6.985, 6.341, 5.900, 5.688, 5.854, 5.900, 5.962, 5.681, 6.936,
                  6.860]) * 1e-3
    kinds = ["forward"] * 2 + ["backward"] * 12
    slope, fixed, note = _line(x, n, y, 1.0, True, fixed0=33.6e-6, kinds=kinds)
    assert fixed == 33.6e-6 and "standard error" in note
    _close(slope, float(x @ (y - fixed * n) / (x @ x)))
    assert 1.2 < slope < 1.4

def test_recalibrating_a_calibrated_file_does_not_add_the_gap_twice():
    """One backward pack of two equal microbatches: one shape, so the compute's fixed cost is the
    input's plus the time between instructions, which the file records; calibrating again from that
    file on the same step gives the same fixed cost, not one more gap."""
    prof = synthetic_profile(R=4)
    plan = Plan("test", "vPP", 1, 4, 2, 2, [], [(0, 3)], 4)
    hw = dataclasses.replace(HW.with_gpus(1), copy_overlap=False, issue_overhead_s=30e-6)
    sim = simulate(plan, prof, neutral(hw))
    gap = 40e-6
    spaced = _serial(_synthetic(sim, 1), gap)
    once = fit_hardware(spaced, sim, hw, plan)
    _close(once.hardware.issue_overhead_s, 30e-6 + gap)
    _close(once.hardware.instruction_gap_s, gap)
    assert any(n.startswith("compute: ") and "one shape" in n for n in once.notes)
    twice = fit_hardware(spaced, sim, once.hardware, plan).hardware
    _close(twice.issue_overhead_s, 30e-6 + gap)
    _close(twice.compute_scale, once.hardware.compute_scale)
    assert Hardware.from_dict(twice.to_dict()) == twice          # the record survives a file


def test_executor_names_match_the_simulators():
    """The executor times a backward pack's recompute apart (REC) and names a copy by its tensor's layer;
    both are matched to the simulator's events."""
    assert work_of("compute", "REC") == work_of("compute", "BWD") == "backward"
    assert work_of("compute", "UPD") == work_of("compute", "GPU_UPD") == "GPU step"
    assert work_of("swap_in", "W") == work_of("swap_in_w", "W") == "weights in"
    assert work_of("swap_in", "B") == "weights in" and work_of("swap_in", "sX") == "activations in"
    assert work_of("swap_out", "dW") == "weights out" and work_of("swap_out", "sA") == "activations out"
    assert work_of("p2p", "ARD") == "all-reduce" and work_of("cpu", "UPD") == "CPU step"


def test_idle_time_is_the_step_less_the_union_of_events():
    rows = [(0, "compute", "FWD", 0, "0-0", 0, 0.0, 1.0, 0), (0, "swap_in", "X", 0, "0-0", 0, 0.5, 2.0, 8),
            (0, "compute", "BWD", 1, "0-0", 0, 3.0, 4.0, 0), (1, "compute", "FWD", 0, "0-0", 0, 0.0, 5.0, 0)]
    tl = Timeline.from_records(rows, 5.0, ranks=2)
    assert idle_time(tl) == pytest.approx(2.0) and idle_time(tl, rank=1) == 0.0


def test_chrome_trace_round_trips(tmp_path):
    prof, plan = synthetic_profile(R=8), _plan("vPP", 2)
    tl = _with_host(simulate(plan, prof, HW))
    tl.meta.update({"source": "measured", "plan_identity": "abc"})
    back = Timeline.from_chrome_trace(tl.to_chrome_trace(tmp_path / "t.json"))
    # the host's issue times travel on a thread of their own, not as events
    assert back.host["instruction"].tolist() == tl.host["instruction"].tolist()
    assert np.allclose(back.host[["start", "end"]].to_numpy(float), tl.host[["start", "end"]].to_numpy(float))
    assert back.ranks == tl.ranks and back.iteration_time == tl.iteration_time
    assert back.meta == {"source": "measured", "plan_identity": "abc"}
    cols = ["rank", "stream", "kind", "pack", "microbatch", "bytes"]
    assert back.events[cols].values.tolist() == tl.events[cols].values.tolist()
    assert np.allclose(back.events.end - back.events.start, tl.events.end - tl.events.start, atol=1e-9)
    assert busy_by_work(back) == pytest.approx(busy_by_work(tl))
    (tmp_path / "bad.json").write_text('{"traceEvents": []}')
    with pytest.raises(UsageError, match="no timed events"):
        Timeline.from_chrome_trace(tmp_path / "bad.json")


def test_a_step_missing_a_kind_of_work_is_refused():
    prof, plan = synthetic_profile(R=8), _plan()
    sim = simulate(plan, prof, HW)
    measured = _synthetic(sim, 1)
    measured.events = measured.events[measured.events.stream != "swap_in_w"]
    with pytest.raises(UsageError, match=r"has no weights in events but the plan moves 8 weight packs to the device"):
        calibrate(plan, prof, HW, measured)


# -- the command, on a real CPU run of the smallest model -------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A profile of gpt2-tiny (one quick pass) and a plan for it that swaps under a 2 MB cap."""
    t = tmp_path_factory.mktemp("tiny")
    assert main(["profile", "gpt2-tiny", "--device", "cpu", "-u", "1,2", "-o", str(t / "prof"), "--repeats", "1",
                 "--warmup", "0", "--threads", "1"]) == 0
    assert main(["baseline", "--planner", "harmony", "--profile", str(t / "prof"), "--hardware", "h100-x1",
                 "--batch", "4", "--memory-cap", "2MB", "-o", str(t / "plan.json")]) == 0
    return t


def _one_line_error(capsys, argv, fragment):
    assert main(argv) == 2, argv
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and fragment in err, (argv, err)


@pytest.mark.usefixtures("one_thread")
def test_calibrate_a_real_cpu_run_writes_hardware_that_simulate_accepts(tiny, capsys):
    plan, out = str(tiny / "plan.json"), tiny / "fitted.toml"
    capsys.readouterr()
    assert main(["calibrate", plan, "--model", "gpt2-tiny", "--steps", "5", "--traced", "2", "--no-progress",
                 "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "running 5 step(s) of the plan" in text and "measured ms" in text and "re-simulated ms" in text
    assert "fitting the 2 traced (*)" in text and "the 2 traced ones' median" in text
    assert "iteration: measured" in text and "no event running on rank 0" in text and f"wrote {out}" in text
    hw = Hardware.load(out)
    assert hw.name == "h100-x1-calibrated" and hw.compute_scale > 0 and hw.h2d_latency_s >= 0
    assert hw.issue_overhead_s >= 0 and hw.cpu_optimizer_scale > 0 and hw.copy_overlap
    assert main(["simulate", plan, "--hardware", str(out)]) == 0
    assert "iteration time" in capsys.readouterr().out


@pytest.mark.usefixtures("one_thread")
def test_run_reports_the_promise_and_its_trace_calibrates(tiny, capsys):
    plan, trace = str(tiny / "plan.json"), tiny / "t.json"
    capsys.readouterr()
    assert main(["run", plan, "--model", "gpt2-tiny", "--steps", "4", "--no-progress", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "the plan's promise:" in out and ("s per step simulated on h100-x1; the 2 untraced step(s) after the "
                                             "first took a median of") in out
    assert "forward" in out and "weights in" in out
    assert main(["calibrate", plan, "--trace", str(trace), str(trace), "-o", str(tiny / "from_trace.json")]) == 0
    assert capsys.readouterr().out.count("read a traced step from") == 2
    assert json.loads((tiny / "from_trace.json").read_text())["compute_scale"] > 0
    # a trace without the plan's weight copies, or from another plan, is refused
    doc = json.loads(trace.read_text())
    tids = {e["tid"] for e in doc["traceEvents"] if e.get("name") == "thread_name" and e["args"]["name"] == "swap_in"}
    cut = dict(doc, traceEvents=[e for e in doc["traceEvents"] if not (
        e.get("ph") == "X" and e["tid"] in tids and e["args"]["kind"] in ("W", "B"))])
    (tiny / "cut.json").write_text(json.dumps(cut))
    _one_line_error(capsys, ["calibrate", plan, "--trace", str(tiny / "cut.json"), "-o", str(tiny / "x.toml")],
                    "cut.json has no weights in events but the plan moves")
    other = dict(doc, otherData={**doc["otherData"], "plan_identity": "0123456789abcdef"})
    (tiny / "other.json").write_text(json.dumps(other))
    _one_line_error(capsys, ["calibrate", plan, "--trace", str(tiny / "other.json"), "-o", str(tiny / "x.toml")],
                    "was traced from another plan")
    # without the plan's profile at hand: one note line instead
    d = json.loads((tiny / "plan.json").read_text())
    (tiny / "lost.json").write_text(json.dumps(dict(d, profile={"name": "gpt2-tiny"})))
    assert main(["run", str(tiny / "lost.json"), "--model", "gpt2-tiny", "--steps", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "note: not compared with the plan's simulation:" in out and "promise" not in out


def test_calibrate_refuses_bad_input_in_one_line(tiny, capsys):
    plan, out = str(tiny / "plan.json"), str(tiny / "x.toml")
    run = ["--model", "gpt2-tiny", "-o", out]
    for argv, fragment in (
            (["calibrate", plan, *run, "--steps", "0"], "--steps must be >= 1"),
            (["calibrate", plan, *run, "--traced", "0"], "--traced must be >= 1"),
            (["calibrate", plan, "--model", "vgg-tiny", "-o", out], "not of model 'vgg-tiny'"),
            (["calibrate", plan, *run, "--set", "n_layer=1"], "the plan has 8 layers"),
            (["calibrate", str(tiny / "nope.json"), *run], "does not exist"),
            (["calibrate", plan, *run, "--hardware", str(tiny / "nope.toml")], "does not exist"),
            (["calibrate", plan, "--trace", str(tiny / "nope.json"), "-o", out], "does not exist"),
            (["calibrate", plan, "--trace", plan, "-o", out], "no traceEvents"),
            (["calibrate", plan, *run, "--trace", plan], "not both"),
            (["calibrate", plan, "-o", out], "give --model"),
            (["calibrate", plan, "--model", "gpt2-tiny", "-o", str(tiny / "x.txt")], ".toml or .json")):
        _one_line_error(capsys, argv, fragment)
    assert not (tiny / "x.toml").exists()


def test_time_between_instructions_goes_into_each_fixed_cost_on_a_serial_device():
    """On a device that runs a rank's instructions one at a time, the executor's own work between them
    is time no event shows: the fit spreads it over every instruction's fixed cost, once."""
    prof, plan = synthetic_profile(R=8), _plan()
    hw = dataclasses.replace(HW.with_gpus(1), copy_overlap=False)
    sim = simulate(plan, prof, neutral(hw))
    gap = 40e-6
    spaced = _serial(_synthetic(sim, 1), gap)
    assert idle_time(spaced) == pytest.approx(gap * len(spaced.events))
    overlapped = fit_hardware(spaced, sim, dataclasses.replace(hw, copy_overlap=True), plan).hardware
    serial = fit_hardware(spaced, sim, hw, plan)
    for field in ("issue_overhead_s", "h2d_latency_s", "d2h_latency_s"):
        _close(getattr(serial.hardware, field), getattr(overlapped, field) + gap)
    _close(serial.hardware.compute_scale, COMPUTE)
    assert any("between consecutive instructions" in n for n in serial.notes)


def test_the_time_between_instructions_is_the_typical_gap_not_the_mean():
    """A serial step whose instructions are 40 us apart but for three long hand-offs (3 ms: the CPU
    optimizer taking a pack's gradients) charges each instruction 40 us: the long gaps are the step's,
    not every instruction's (charged per instruction, they would make a plan of many small packs
    predicted slow)."""
    prof, plan = synthetic_profile(R=8), _plan()
    hw = dataclasses.replace(HW.with_gpus(1), copy_overlap=False)
    sim = simulate(plan, prof, neutral(hw))
    gap, long = 40e-6, 3e-3
    spaced = _serial(_synthetic(sim, 1), gap)
    ev = spaced.events.sort_values("start").reset_index(drop=True)
    for i in (5, 11, 17):                                     # three long gaps: every later event shifts
        ev.loc[i:, ["start", "end"]] += long - gap
    spaced = Timeline(ev, spaced.iteration_time + 3 * (long - gap), ranks=1, meta=spaced.meta)
    gaps = instruction_gaps(spaced)
    assert len(gaps) == len(ev) - 1 and np.sort(gaps)[-3:] == pytest.approx([long] * 3)
    _close(instruction_gap(spaced), gap)
    assert idle_time(spaced) / len(ev) > 2 * gap                # what the mean would have charged
    serial = fit_hardware(spaced, sim, hw, plan).hardware
    overlapped = fit_hardware(spaced, sim, dataclasses.replace(hw, copy_overlap=True), plan).hardware
    _close(serial.issue_overhead_s, overlapped.issue_overhead_s + gap)


def test_several_traced_steps_are_pooled_each_event_at_its_median():
    """Three traced steps, one of them with every event twice as long (the machine busy elsewhere for
    that step): the pooled fit is the fit of a typical step, each event at its median over the steps,
    and the gaps of every step are pooled before their median is taken."""
    prof, plan = synthetic_profile(R=8), _plan()
    hw = dataclasses.replace(HW.with_gpus(1), copy_overlap=False)
    sim = simulate(plan, prof, neutral(hw))
    typical = _serial(_synthetic(sim, 1), 40e-6)
    ev = typical.events.copy()
    ev[["start", "end"]] *= 2
    slow = Timeline(ev, 2 * typical.iteration_time, ranks=1, meta=typical.meta)
    one = fit_hardware(typical, sim, hw, plan).hardware
    pooled = fit_hardware([typical, slow, typical], sim, hw, plan).hardware
    for field in ("compute_scale", "issue_overhead_s", "h2d_bandwidth", "d2h_latency_s", "instruction_gap_s"):
        _close(getattr(pooled, field), getattr(one, field))
    _close(fit_hardware([slow, slow, typical], sim, hw, plan).hardware.compute_scale, 2 * COMPUTE)
    # the gaps: one step's 40 us each, another's 80 us each, a third's 80 us: the pooled median
    assert instruction_gap([typical, slow, slow]) == pytest.approx(80e-6)
    assert busy_by_work([typical, slow, typical]) == pytest.approx(busy_by_work(typical))
    whole = _synthetic(sim, 1)              # with its CPU steps, which a calibration checks for
    ev = whole.events.copy()
    ev[["start", "end"]] *= 2
    cal = calibrate(plan, prof, hw, [whole, Timeline(ev, 2 * whole.iteration_time, ranks=1), whole])
    assert cal.iteration["measured"] == whole.iteration_time and cal.iteration["traced_steps"] == 3


def test_a_cpu_step_covers_the_time_between_instructions_it_runs_in():
    """The CPU optimizer's steps run on a thread beside the rank's instructions: a gap they fill is not
    the executor's idle time."""
    rows = [(0, "compute", "BWD", 0, "0-0", 0, 0.0, 1.0, 0), (0, "swap_out", "dW", 1, "0-0", -1, 1.5, 2.0, 8),
            (0, "cpu", "UPD", 2, "0-0", -1, 2.0, 3.5, 0), (0, "swap_in", "W", 3, "1-1", -1, 4.0, 4.5, 8),
            (0, "compute", "FWD", 4, "1-1", 0, 4.6, 5.0, 0)]
    gaps = instruction_gaps(Timeline.from_records(rows, 5.0, ranks=1))
    assert gaps == pytest.approx([0.5, 0.5, 0.1])          # 2.0-4.0 less the CPU step's 2.0-3.5


def test_closing_the_step_recovers_a_machine_uniformly_slower():
    """A machine that ran every kind of work 1.3x slower than fitted (a shared machine's drift between
    the traced step and the others) is recovered by one factor on every time term, solved on the
    step time; the fitted terms keep their proportions, and where the step matches nothing changes."""
    prof, plan = synthetic_profile(R=8), _plan()
    base = dataclasses.replace(HW.with_gpus(1), copy_overlap=False, issue_overhead_s=20e-6, h2d_latency_s=10e-6,
                               d2h_latency_s=5e-6, cpu_optimizer_call_s=1e-4)
    true = scaled(base, 1.3)
    assert true.compute_scale == pytest.approx(1.3) and true.h2d_bandwidth == pytest.approx(base.h2d_bandwidth / 1.3)
    slow, fast = (simulate(plan, prof, h).iteration_time for h in (true, base))
    assert slow == pytest.approx(1.3 * fast, rel=1e-9)       # every duration stretched: the same schedule
    got, factor, note = close_step(plan, prof, base, slow)
    assert factor == pytest.approx(1.3, rel=1e-6) and "scaled by 1.3000" in note
    assert got.issue_overhead_s == pytest.approx(26e-6) and got.d2h_bandwidth == pytest.approx(true.d2h_bandwidth)
    _close(simulate(plan, prof, got).iteration_time, slow)
    got, factor, _ = close_step(plan, prof, true, fast)
    assert factor == pytest.approx(1 / 1.3, rel=1e-6)
    assert close_step(plan, prof, base, fast * (1 + CLOSE_TOLERANCE / 2)) == (base, 1.0, "")


@pytest.mark.usefixtures("one_thread")
def test_a_two_rank_cpu_run_is_simulated_on_its_own_route_and_calibrates(tiny):
    """On the CPU device two ranks hand activations to each other by Gloo send (probe sets
    ``p2p_bandwidth``), and a kept graph's saved activations are copied to the host in line with its
    forward (traced as a swap-out of sA): the simulation has the same kinds of work as the run, so a
    pipeline of two ranks calibrates, and the step closes with the sends scaled too."""
    from harmony_opt.compile.program import Kind
    from harmony_opt.core.profile import Profile
    from harmony_opt.measure.models import build_model
    from harmony_opt.training import train
    profile = Profile.load(tiny / "prof")
    hw = dataclasses.replace(get_hardware("1080ti-x4").with_gpus(2), copy_overlap=False, p2p_bandwidth=3e9,
                             p2p_latency_s=80e-6, gpu_memory_bytes=1 << 30)
    # the forward pack [0, 3] runs on rank 0, the loss pack [4, 7] on rank 1, the backward pack [0, 3]
    # on rank 0 again, where it keeps its forward's graph
    plan = Plan("t", "vPP", 2, 4, 2, 2, [(0, 3)], [(0, 3), (4, 7)], 8,
                options=(PackOptions(recompute=False), PackOptions()), hardware=hw.to_dict())
    sim = simulate(plan, profile, hw).events
    assert {"Y", "dX"} <= set(sim[sim.stream == "p2p"].kind)
    assert not sim[(sim.stream == "swap_out") & sim.kind.isin(["Y", "dX"])].shape[0]
    res = train(build_model("gpt2-tiny"), plan, steps=3, progress=False, trace=True)
    measured = res.timeline()
    ev = measured.events
    assert ((ev.stream == "swap_out") & (ev.kind == "sA")).sum() == 2
    # each rank's waits for the other's messages are traced apart: not the executor's own work (idle time)
    recvs = sum(x.kind is Kind.RECV for ins in res.program.ranks for x in ins)
    assert (ev.stream == "wait").sum() == recvs and set(ev[ev.stream == "wait"].kind) <= {"X", "Y", "dX", "dY"}
    cal = calibrate(plan, profile, hw, measured)
    got = cal.hardware
    # every message of gpt2-tiny has one size: the sends' fixed cost is fitted, their bandwidth kept
    factor, fit = cal.iteration["scale"], cal.fits["GPU to GPU"]
    assert fit.points >= 2 and "fixed cost alone" in fit.note
    assert got.p2p_bandwidth == pytest.approx(hw.p2p_bandwidth / factor) and got.p2p_latency_s > 0
