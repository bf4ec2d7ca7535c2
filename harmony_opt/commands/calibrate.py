"""`harmony-opt calibrate`: fit the hardware's cost terms to measured steps of a plan."""
from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

from ..core.errors import PlanError, UsageError
from ..core.hardware import Hardware
from ..core.plan import Plan
from .common import MODEL_HELP, plan_hardware, plan_profile, writable_file, written
from .measure import add_overrides


def register(sub):
    c = sub.add_parser("calibrate",
                       help="run a plan (or read its trace), fit the hardware's cost terms so the simulator predicts "
                            "the measured step, and write the fitted hardware file")
    c.add_argument("plan", help="plan JSON")
    c.add_argument("--model", default=None, help="the model to run the plan on: " + MODEL_HELP)
    add_overrides(c, " (the same as the profile the plan was made from took)")
    c.add_argument("--hardware", default=None,
                   help="hardware to start from: preset or .toml/.json file (default: the plan's)")
    c.add_argument("--profile", default=None, help="profile to simulate with (default: the one the plan names)")
    c.add_argument("--steps", type=int, default=9,
                   help="steps to run; the traced ones are fitted, the median of those after the first is the step "
                        "time the fit is closed on (default 9)")
    c.add_argument("--traced", type=int, default=4,
                   help="steps to trace and fit, pooled: the last and every other one before it, at most this many "
                        "(default 4)")
    c.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--trace", metavar="FILE", nargs="+", default=None,
                   help="fit these traced steps, pooled (each from `harmony-opt run PLAN --trace FILE`) instead of "
                        "running")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument("-o", "--output", required=True, help="fitted hardware file to write (.toml or .json)")
    c.set_defaults(func=_calibrate)


def _calibrate(args):
    from ..calibrate import calibrate, format_table

    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1 (the last step is the one fitted), got {args.steps}")
    if args.traced < 1:
        raise UsageError(f"--traced must be >= 1 (the traced steps are the ones fitted), got {args.traced}")
    if args.trace and args.model:
        raise UsageError("give --model to run the plan, or --trace FILE to fit a step already traced, not both")
    if not args.trace and not args.model:
        raise UsageError("give --model to run the plan on (or --trace FILE, a step traced by `harmony-opt run`)")
    if args.overrides and not args.model:
        raise UsageError("--set changes the model's spec: give it with --model")
    if Path(args.output).suffix not in (".toml", ".json"):
        raise UsageError(f"-o {args.output}: give a .toml or .json file name, as --hardware reads them")
    writable_file(args.output, "-o", "hardware.toml")
    plan = Plan.load(args.plan)
    hw = plan_hardware(plan, args.plan, args.hardware)
    profile = plan_profile(plan, args.plan, args.profile)
    try:
        plan.check_against(profile, hw)
    except PlanError as e:
        raise PlanError(f"{args.plan}: {e}") from None
    if args.trace:
        from ..sim.timeline import Timeline
        measured, where = [], ", ".join(args.trace)
        for f in args.trace:
            measured.append(Timeline.from_chrome_trace(f))
            print(f"read a traced step from {f}: {len(measured[-1].events)} events, "
                  f"{measured[-1].iteration_time:.4f} s")
        step_time = None
    else:
        (measured, step_time), where = _measure(plan, args), "the measured step"
    print(f"simulating the plan on {hw.name} and fitting its cost terms")
    try:
        cal = calibrate(plan, profile, hw, measured, where, step_time=step_time)
    except PlanError as e:
        raise PlanError(f"{args.plan}: {e}") from None
    print(f"busy time by kind of work (all ranks): measured, simulated on {hw.name}, the fitted terms' "
          f"prediction, re-simulated on the fitted hardware")
    print(format_table(cal.table))
    it = cal.iteration
    traced = "the traced one" if it["traced_steps"] == 1 else f"the {it['traced_steps']} traced ones' median"
    print(f"iteration: measured {it['target']:.4f} s" + (f" (median of the steps after the first; {traced} "
          f"{it['measured']:.4f} s)" if it["settled"] else "") + f", simulated {it['before']:.4f} s "
          f"before ({it['target'] / it['before']:.2f}x), {it['fitted']:.4f} s with the fitted terms, "
          f"{it['after']:.4f} s after closing the step ({it['target'] / it['after']:.2f}x)")
    print(f"no event running on rank 0: measured {it['measured_idle'] * 1e3:.3f} ms, simulated "
          f"{it['before_idle'] * 1e3:.3f} ms before, {it['after_idle'] * 1e3:.3f} ms after (in a measured step: the "
          f"executor's own work between instructions; where copies do not overlap compute, the fit prices it "
          f"in each instruction's fixed cost)")
    for line in _term_lines(cal, hw):
        print(line)
    for note in cal.notes:
        print(f"note: {note}")
    if cal.unmatched:
        print("note: measured work with no simulated event of its pack and microbatch (not fitted): "
              + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in cal.unmatched.items()))
    if args.device == "cpu" and not args.trace and hw.copy_overlap:
        print("note: on the CPU the executor runs copies in program order, not beside compute; set copy_overlap "
              "= false in the written file for the simulator to do the same")
    when = datetime.date.today().isoformat()
    source = f"trace {where}" if args.trace else f"{args.steps} step(s) on {args.device}, {len(measured)} traced"
    out = cal.hardware
    out = dataclasses.replace(out, name=out.name if out.name.endswith("-calibrated") else f"{out.name}-calibrated",
                              description=f"calibrated {when} against traced steps of plan {args.plan} "
                                          f"({source}) from hardware {hw.name!r}")
    path = written(out.save, args.output, f"the hardware file {args.output}")
    print(f"wrote {path}; use it as --hardware {path} with plan, baseline, simulate or compare")


def _measure(plan: Plan, args):
    """Train ``plan`` for --steps steps with --traced of them traced: their Timelines, and the step
    time to close the fit on: the median of the steps after the first (warm-up). Not of the untraced
    ones alone: with every other step traced, the untraced of an 8-step run are steps 2, 4 and 6,
    and on a 4-layer GPT-2 medium two of them were still 15-50 % slower than the rest."""
    from ..training import check_plan, train
    from .running import _model

    model = _model(args.model, args.overrides, args.trust_remote_code)
    try:
        check_plan(model, plan)
    except PlanError as e:
        raise PlanError(f"{args.plan}: {e}") from None
    print(f"running {args.steps} step(s) of the plan on {model.name} ({args.device}); tracing the last and every "
          f"other one before it, at most {args.traced}")
    res = train(model, plan, steps=args.steps, device=args.device, seed=args.seed, progress=not args.no_progress,
                trace=args.traced)
    times = ", ".join(f"{t:.4f}" + ("*" if i in res.traced else "") for i, t in enumerate(res.iteration_times))
    print(f"step times {times} s; fitting the {len(res.traced)} traced (*)")
    return res.timelines(), res.settled_step_time()


def _term_lines(cal, hw: Hardware) -> list[str]:
    """The fitted terms, one line per pair, with the points each was fitted from."""
    h, out = cal.hardware, []
    f = cal.fits
    if f["compute"].points:
        out.append(f"compute: scale {h.compute_scale:.4g} x the profile, {h.issue_overhead_s * 1e6:.1f} us per event "
                   f"({f['compute'].points} matched groups)")
    for name, way in (("host -> GPU", "h2d"), ("GPU -> host", "d2h"), ("GPU to GPU", "p2p")):
        if f[name].points:
            out.append(f"{name}: {getattr(h, f'{way}_bandwidth') / 1e9:.3g} GB/s (was "
                       f"{getattr(hw, f'{way}_bandwidth') / 1e9:.3g}), {getattr(h, f'{way}_latency_s') * 1e6:.1f} "
                       f"us per {'send' if way == 'p2p' else 'copy'} ({f[name].points} matched groups)")
    if f["CPU step"].points:
        out.append(f"CPU optimizer: scale {h.cpu_optimizer_scale:.4g} x the profile, "
                   f"{h.cpu_optimizer_call_s * 1e6:.1f} us per call ({f['CPU step'].points} matched groups)")
    if f["GPU step"].points:
        out.append(f"GPU optimizer: {h.gpu_optimizer_bandwidth / 1e9:.3g} GB/s (was "
                   f"{hw.gpu_optimizer_bandwidth / 1e9:.3g}), {h.gpu_optimizer_call_s * 1e6:.1f} us per call "
                   f"({f['GPU step'].points} matched groups)")
    if f["all-reduce"].points:
        out.append(f"all-reduce: {h.collective_bandwidth / 1e9:.3g} GB/s, {h.collective_latency_s * 1e6:.1f} us per "
                   f"call ({f['all-reduce'].points} matched groups)")
    return out
