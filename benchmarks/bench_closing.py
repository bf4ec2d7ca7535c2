"""Benchmark: how ``calibrate`` should fit and close the step, judged on the same measurements.

The per-event fit prices the traced steps of Harmony's plan, pooled (every other step of each run from
the second on); the step time it is closed on is the median of the untraced ones. Four calibrations
of the same traced steps, judged on the same measured plans
(``bench_fidelity.py``'s models, caps and planners, runs interleaved the same way):

* ``scale``: what ``calibrate`` does: a fixed cost fitted only where the matched groups tell it
  (else the probed one kept), then every time term times one factor (``calibrate.close_step``);
* ``free``: every fixed cost fitted freely (``calibrate(..., prior=False)``), then the same factor;
* ``shift``: the fit of ``scale``, then every instruction's fixed cost plus one amount, none below 0;
* ``none``: the fit of ``scale`` alone.

Reported: per calibration, the plans within 10 % and 15 % of their measured step, the worst error, and
per case the spread (largest over smallest measured / simulated).

    OMP_NUM_THREADS=1 python benchmarks/bench_closing.py     # writes benchmarks/results/closing.{csv,md}

Run it on a quiet machine: every figure is a wall-clock time.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import pandas as pd
import torch

import bench_fidelity as bf
from harmony_opt.calibrate import GAP_FIELDS, calibrate, close_step, scaled
from harmony_opt.core.io import write_results
from harmony_opt.measure.models import build_model
from harmony_opt.measure.probe import probe_hardware, probe_summary
from harmony_opt.measure.profiler import profile_model
from harmony_opt.report import machine_description, markdown_table
from harmony_opt.sim.simulator import simulate

ROOT = Path(__file__).resolve().parent.parent


def shift_close(plan, profile, hardware, target):
    """Every instruction's fixed cost (``GAP_FIELDS``) plus one amount, solved by bisection so that
    ``plan`` simulates to ``target``, no fixed cost below 0."""
    def shifted(d):
        return dataclasses.replace(hardware, **{f: getattr(hardware, f) + d for f in GAP_FIELDS})

    def step(d):
        return simulate(plan, profile, shifted(d), with_timeline=False).iteration_time
    lo, hi = -min(getattr(hardware, f) for f in GAP_FIELDS), 0.0
    if step(0.0) < target:
        lo, hi = 0.0, 1e-6
        while step(hi) < target and hi < target:
            lo, hi = hi, hi * 2
    elif step(lo) > target:
        return shifted(lo)
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) < target else (lo, mid)
    return shifted((lo + hi) / 2)


def factor_close(plan, profile, hardware, target):
    return close_step(plan, profile, hardware, target)[0]


CLOSINGS = {"scale": factor_close,
            "free": factor_close,
            "shift": shift_close,
            "none": lambda plan, profile, hw, t: hw}


def run_case(label, model_name, overrides, factor, profile, hw, steps, rounds) -> list[dict]:
    model = build_model(model_name, **overrides)
    least = max(profile.costs("BWD", 1).pack_memory(i, i) for i in range(profile.num_layers))
    cap = int(least * factor)
    base = bf.make_plans(profile, hw, cap).get(bf.CALIBRATE_ON)
    if base is None:
        return []
    t, trace, _ = bf.measured_in_rounds(model, {bf.CALIBRATE_ON: base}, steps, rounds, bf.calibration_traced(steps))
    # the per-event fit alone: calibrate's own closing (one factor on every time term) undone
    cal = calibrate(base, profile, hw, trace[bf.CALIBRATE_ON], step_time=t[bf.CALIBRATE_ON])
    fit = scaled(cal.hardware, 1 / cal.iteration["scale"])
    free = calibrate(base, profile, hw, trace[bf.CALIBRATE_ON], step_time=t[bf.CALIBRATE_ON], prior=False)
    fits = {**dict.fromkeys(CLOSINGS, fit), "free": scaled(free.hardware, 1 / free.iteration["scale"])}
    plans = bf.make_plans(profile, cal.hardware, cap)
    measured, _, _ = bf.measured_in_rounds(model, {"calibrated on": base, **plans}, steps, rounds)
    again = measured.pop("calibrated on")
    # as bench_fidelity: closed on the calibrated-on plan's median in the rounds of the plans judged
    hws = {name: fn(base, profile, fn(base, profile, fits[name], t[bf.CALIBRATE_ON]), again)
           for name, fn in CLOSINGS.items()}
    rows = []
    for name, plan in plans.items():
        row = dict(model=label, cap=cap, cap_factor=factor, planner=name, measured_s=measured[name])
        for closing, h in hws.items():
            row[closing] = measured[name] / simulate(plan, profile, h, with_timeline=False).iteration_time
        print(f"  {label} {factor}x {name:24s} " + " ".join(f"{k} {row[k]:.3f}" for k in CLOSINGS), flush=True)
        rows.append(row)
    return rows


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    out = []
    for closing in CLOSINGS:
        err = (df[closing] - 1).abs()
        spread = df.groupby(["model", "cap"], sort=False)[closing].agg(lambda r: r.max() / r.min())
        out.append(dict(calibration=closing, plans=len(df), within_10_pct=int((err <= 0.10).sum()),
                        within_15_pct=int((err <= 0.15).sum()), worst_error_pct=100 * err.max(),
                        worst_spread=spread.max(), median_spread=spread.median()))
    return pd.DataFrame(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "closing"))
    args = ap.parse_args(argv)
    if args.steps < 3 or args.rounds < 1:
        ap.error("give --steps >= 3 and --rounds >= 1")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    hw = probe_hardware("cpu", threads=torch.get_num_threads()).with_gpus(1)
    rows = []
    for label, name, overrides in bf.MODELS:
        print(f"profiling {label} ...", flush=True)
        profile = profile_model(build_model(name, **overrides), bf.SIZES, "cpu", progress=False)
        for factor in bf.CAP_FACTORS:
            rows += run_case(label, name, overrides, factor, profile, hw, args.steps, args.rounds)
    df = pd.DataFrame(rows)
    summary = summarize(df)
    text = ["# Calibrating the step: fixed costs fitted where the trace tells them or freely; closed by a factor, "
            "a shift, or nothing; on the same measurements\n",
            f"`OMP_NUM_THREADS=1 python benchmarks/bench_closing.py` ({time.perf_counter() - t0:.0f} s); "
            f"{machine_description()}; {torch.get_num_threads()} intra-op thread(s); bench_fidelity.py's cases, "
            f"{args.steps} steps per run, {args.rounds} runs per plan interleaved. Each column is measured / "
            f"simulated on the hardware calibrated on Harmony's plan that way; the plans judged are "
            f"those made on the hardware `calibrate` writes.\n",
            f"Probed: {probe_summary(hw)}.\n",
            "## Summary\n", markdown_table(summary, floatfmt=".3f"), "",
            "## Per plan\n", markdown_table(df, floatfmt=".4f"), ""]
    write_results(Path(args.out), df, "\n".join(text))
    print(markdown_table(summary, floatfmt=".3f"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
