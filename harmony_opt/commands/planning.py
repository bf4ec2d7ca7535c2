"""`harmony-opt plan | baseline | simulate | compare`."""
from __future__ import annotations

import math
import time
from pathlib import Path

import pandas as pd

from ..core.bundled import load_profile
from ..core.errors import HarmonyOptError, InfeasibleError, PlanError, UsageError
from ..core.hardware import get_hardware, usable_cores
from ..core.plan import Plan
from ..core.units import fmt_bytes
from ..sim.host_memory import host_memory, host_memory_per_server
from .common import plan_hardware, plan_profile, writable_file


def _common(p):
    p.add_argument("--profile", required=True, help="bundled profile name or profile folder")
    p.add_argument("--hardware", default="1080ti-x4", help="preset (1080ti-x4, h100-x1) or .toml/.json file")
    p.add_argument("--batch", type=int, required=True, help="minibatch size D")
    p.add_argument("--mode", default="auto", choices=("auto", "vPP", "vDP"))
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all of the hardware's)")
    p.add_argument("--memory-cap", default=None, help="usable GPU memory, e.g. 9e9, 10GiB, 8583MB")
    p.add_argument("--cost-model", default="default", choices=("default", "harmony"))


def register(sub):
    p = sub.add_parser("plan", help="search the fastest plan with CP-SAT")
    _common(p)
    p.add_argument("--time-limit", type=float, default=10.0,
                   help="search budget in work seconds (deterministic: the same plan on any machine; about "
                        "wall seconds on 2 cores, up to 2x more on a loaded machine)")
    p.add_argument("--wall-limit", type=float, default=None,
                   help="also stop after this many wall-clock seconds (the plan may then depend on the "
                        "machine's speed; the output says when it did)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="CP-SAT workers (results depend on seed and workers only)")
    p.add_argument("--processes", type=int, default=None,
                   help="processes for Harmony's hint, the first solutions, local search and simulator "
                        "descent: the same plan for any N, sooner (2 on 2 cores: 0.6-0.9x the wall time of 1); "
                        "default: the cores this process may use, at most 4")
    p.add_argument("--no-hint", action="store_true", help="do not warm-start from Harmony's search")
    p.add_argument("--harmony-space", action="store_true",
                   help="restrict to Harmony's decisions (u_fwd >= u_bwd, sizes dividing D, recompute, CPU optimizer)")
    p.add_argument("--even", action="store_true",
                   help="only microbatch sizes that divide the minibatch (by default the others are searched "
                        "too, after these; the last microbatch is then smaller)")
    p.add_argument("--no-gpu-handoff", action="store_true",
                   help="hand every gradient between backward packs through host memory, as Harmony does")
    p.add_argument("--no-compare", action="store_true", help="do not run the baselines after planning")
    p.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    p.add_argument("--quiet", action="store_true", help="do not print solver progress")
    p.set_defaults(func=_plan)

    from ..planners.registry import PLANNERS
    b = sub.add_parser("baseline", help="plan with one planner by name (a baseline, or ours)")
    b.add_argument("--planner", required=True,
                   help="; ".join(f"{e.name}: {e.description}" for e in PLANNERS.values()))
    _common(b)
    b.add_argument("--packing-fwd", default="balanced_time,reuse", help="Harmony's forward packers (or 'all')")
    b.add_argument("--packing-bwd", default="balanced_time", help="Harmony's backward packers (or 'all')")
    b.add_argument("-o", "--output", default=None)
    b.set_defaults(func=_baseline)

    s = sub.add_parser("simulate", help="simulate a plan: iteration time, memory, swap volume")
    s.add_argument("plan")
    s.add_argument("--profile", default=None, help="profile (default: the one named in the plan)")
    s.add_argument("--hardware", default=None, help="hardware (default: the plan's)")
    s.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON")
    s.add_argument("--plot", default=None, help="write a Gantt PNG with memory over time")
    s.set_defaults(func=_simulate)

    c = sub.add_parser("compare", help="every planner on the same inputs, scored by the same simulator")
    _common(c)
    c.add_argument("--time-limit", type=float, default=10.0)
    c.add_argument("-o", "--output", default=None, help="write the table as CSV")
    c.add_argument("--plot", default=None, help="write the Gantt PNG of the best plan")
    c.set_defaults(func=_compare)


def _inputs(args):
    profile = load_profile(args.profile)
    hw = get_hardware(args.hardware, memory_cap=args.memory_cap)
    if args.gpus is not None and not 1 <= args.gpus <= hw.gpus:
        raise UsageError(f"--gpus {args.gpus}: hardware {hw.name!r} has {hw.gpus} GPU(s); give 1 to {hw.gpus}")
    if args.batch < 1:
        raise UsageError(f"--batch must be >= 1, got {args.batch}")
    largest = int(min(profile.sizes("FWD").max(), profile.sizes("BWD").max()))
    fewest = -(-args.batch // largest)
    if fewest > MAX_MICROBATCHES:
        raise UsageError(f"--batch {args.batch}: at least {fewest:,} microbatches of {largest} (the largest size "
                         f"{args.profile} profiles in both phases); the simulator plays every one, and more than "
                         f"{MAX_MICROBATCHES:,} take too long to plan: profile larger sizes (profile -u) or give a "
                         f"smaller --batch")
    return profile, hw


#: The most microbatches per minibatch (at the profile's largest size) plan, baseline and compare
#: take: the Harmony hint's simulations and the check of the plan's compiled program play every
#: microbatch, outside the search's work budget. gpt2_medium on 1080ti-x4 (sizes up to 9),
#: --time-limit 2: 1.9 s at 114 microbatches of 9 (batch 1,024), 60 s at 911, 98 s at 1,821, over
#: 400 s at 7,282; batch 1e8 looked like a hang.
MAX_MICROBATCHES = 4_096


def _packers(text: str):
    return tuple(x.strip() for x in text.split(",") if x.strip()) if text not in ("all", "defaults") else text


def _describe(plan: Plan) -> str:
    return (f"{plan.mode} on {plan.gpus} GPU(s), microbatch fwd {plan.microbatch_fwd} / bwd {plan.microbatch_bwd}, "
            f"{len(plan.packs_fwd)} forward + {len(plan.packs_bwd)} backward packs"
            + (", gradients kept on the GPU between backward packs" if plan.gpu_handoff else "")
            + (f", swaps in its own order on {len(plan.transfer_order)} stream(s)" if plan.transfer_order else ""))


def _show(df: pd.DataFrame, width: int = 40) -> str:
    """The table with blanks where a planner has no value (pandas prints <NA> otherwise); notes
    longer than ``width`` (why a planner has no plan) are printed in full beneath it, not cut."""
    df = df.astype(object).where(df.notna(), "")
    below = []
    if "note" in df:
        long = df.note.astype(str).str.len() > width
        below = [r.note if r.note.startswith(f"{r.planner.split()[0]}:") else f"{r.planner}: {r.note}"
                 for r in df[long].itertuples()]
        df.loc[long, "note"] = "no plan (see below)"
    return "\n".join([df.to_string(index=False), *below])


def _program_line(plan: Plan, profile) -> str:
    """The peak live device bytes of the plan's compiled program (what the runtime holds and its
    memory guard counts), beside the cap; a warning where it would not fit."""
    from ..compile.program_memory import program_memory
    mem = program_memory(plan, profile)
    line = ("peak device memory at run time (the compiled program): "
            + ", ".join(f"GPU{r} {fmt_bytes(b)}" for r, b in enumerate(mem.peaks)) + f" of {fmt_bytes(mem.cap)}")
    if not mem.fits:
        r, ins, need = mem.over
        line += (f"\nwarning: on GPU {r}, instruction {ins} would hold {fmt_bytes(need)}: this plan would be refused "
                 f"at run time")
    return line


def _host_line(host, hw) -> str:
    """A plan's host memory (host_memory.HostMemory) beside the hardware's budgets (a server's, on several)."""
    if host.server is not None:
        return (f"host memory of server {host.server}: {fmt_bytes(host.total)} ({host.parts()}), "
                f"{fmt_bytes(host.pinned)} of it pinned; each server has {fmt_bytes(hw.host_memory_bytes)}, "
                f"{fmt_bytes(hw.pinned_memory_bytes)} pinnable")
    return (f"host memory: {fmt_bytes(host.total)} ({host.parts()}), {fmt_bytes(host.pinned)} of it pinned; "
            f"hardware {hw.name} has {fmt_bytes(hw.host_memory_bytes)}, {fmt_bytes(hw.pinned_memory_bytes)} pinnable")


def _host_memories(plan, profile, hw) -> list:
    """The plan's host memory: the machine's, or each server's where its ranks span several."""
    if hw.servers_used(plan.gpus) > 1:
        return host_memory_per_server(plan, profile, hw)
    return [host_memory(plan, profile, hw)]


def solver_summary(s: dict) -> list[str]:
    """What the planner proved about its plan, in a few lines (plan.solver, see docs/planner.md)."""
    def pct(v):
        return f"{v:.2%}" if v is not None else "n/a"
    out = []
    if s.get("objective") is not None:
        what = "one chain per GPU" if s["model"] == "chain" else "pipeline over the GPUs"
        out.append(f"planner's model of the default simulator ({what}): {s['objective']:.4f} s for this plan, "
                   f"|model - simulated| = {pct(s['fidelity'])}")
    c = s.get("configuration")
    if c and c.get("bound") is None:
        out.append(f"configuration {c['configuration']}: best found ({c['found_by']}); the planner's model describes "
                   f"the default simulator, so it proves nothing under this cost model: the simulator judged")
    elif c:
        how = {"dp": "proven optimal for the model by the exact DP", "cp-sat": "proven optimal for the model by CP-SAT",
               "shapes": "proven optimal for the model by CP-SAT, shape by shape"}
        proof = how.get(c["proof"], f"best found ({c['found_by']}), bound {c['bound']:.4f} s, gap {pct(c['gap'])}")
        out.append(f"configuration {c['configuration']}: {proof}")
    if s.get("bound") is not None and s.get("objective") is not None:
        out.append(f"bound over every configuration searched: {s['bound']:.4f} s, gap {pct(s['gap'])} "
                   f"({s['evaluated']} evaluated, {s['pruned']} pruned by their bound"
                   + (f", {s['out_of_budget']} not reached in the time limit" if s.get("out_of_budget") else "") + ")")
    t = s.get("timeline")
    if t is None and s.get("bound") is not None and s.get("objective") is not None:
        out.append("timeline model of this plan's events: not run, the search left it too little of the work "
                   "budget (a longer --time-limit leaves it room)")
    if t and t.get("objective") is not None:
        from harmony_opt.solver_models.event_schedule import HINT
        source = "no schedule found in its time: the simulator's" if t["status"] == HINT else \
            f"CP-SAT {t['status'].lower()}"
        o = t.get("transfer_order")
        kept = bool(o and o["kept"])
        in_rule = " in Harmony's transfer order" if kept else ""
        out.append(f"timeline model of this plan's events{in_rule} ({source}): "
                   f"{t['objective']:.4f} s, bound {t['bound']:.4f} s, gap {pct(t['gap'])}")
        if t.get("order_bound") is not None:        # plans saved before it was reported have none
            out.append(f"bound over every order of the transfers in their streams: {t['order_bound']:.4f} s, "
                       f"gap {pct(t['order_gap'])}")
        if o:
            found = f"timeline model choosing the order of the swaps (CP-SAT {o['status'].lower()}): " \
                    f"{o['objective']:.4f} s, bound {o['bound']:.4f} s"
            if kept:
                streams = f"{o['streams']} stream{'s' if o['streams'] > 1 else ''}"
                out.append(f"{found}; its order ({streams} reordered) simulates in {o['simulated']:.4f} s "
                           f"against {o['rule_simulated']:.4f} s in Harmony's: the plan carries it")
            elif o["streams"]:
                out.append(f"{found}; its order simulates in {o['simulated']:.4f} s, no faster than Harmony's: "
                           f"the plan keeps Harmony's")
            else:
                out.append(f"{found}; no faster order found: the plan keeps Harmony's")
    return out


def hint_note(s: dict, time_limit: float) -> str | None:
    """Where Harmony's search for the warm start took most of the budget and the plan is no faster than
    its plan, say so and what limit leaves room beyond it: a search that could not start is not a proof
    that Harmony's plan is the best."""
    hint, budget, speedup = s.get("hint_work_s"), s.get("work_budget_s"), s.get("speedup_over_harmony")
    if not hint or not budget or speedup is None or speedup > 1 + 1e-9 or hint < 0.5 * budget:
        return None
    return (f"note: Harmony's search (the warm start) took {hint:.1f} of the {budget:.1f} work seconds of "
            f"--time-limit {time_limit:g}, so the search went little beyond its plan; --time-limit "
            f"{math.ceil(time_limit * hint / (0.3 * budget))} or more leaves it two thirds of its budget")


def _outputs(args, output_example: str = "plan.json") -> None:
    """Check the output paths before the search: a bad path fails in a second, not after it."""
    for name, example in (("output", output_example), ("plot", "timeline.png"), ("trace", "trace.json")):
        path = getattr(args, name, None)
        if path:
            writable_file(path, "-o" if name == "output" else f"--{name}", example)


def _plan(args):
    from harmony_opt.solver_models.planner import PlannerOptions, plan
    profile, hw = _inputs(args)
    _outputs(args)
    opts = PlannerOptions(mode=args.mode, gpus=args.gpus, time_limit=args.time_limit, wall_limit=args.wall_limit,
                          seed=args.seed, workers=args.workers, hint=not args.no_hint,
                          processes=usable_cores(4) if args.processes is None else args.processes,
                          harmony_space=args.harmony_space, uneven=not args.even, cost_model=args.cost_model,
                          gpu_handoff=not args.no_gpu_handoff)
    report = None if args.quiet else print
    p = plan(profile, hw, args.batch, opts, memory_cap=hw.gpu_memory_bytes, report=report)
    s = p.solver
    print(f"plan: {_describe(p)}, {sum(not o.recompute for o in p.options)} stashed pack(s), "
          f"{sum(o.optimizer == 'gpu' for o in p.options)} GPU optimizer step(s)")
    print(f"simulated iteration time {p.simulated_iteration_time_s:.4f} s ({p.cost_model} cost model)")
    print(_program_line(p, profile))
    for host in _host_memories(p, profile, hw):
        print(_host_line(host, hw))
    for line in solver_summary(s):
        print(line)
    print(f"search {p.search_time_s:.2f} s; lower bound over all plans {s['lower_bound_s']:.4f} s, "
          f"efficiency {p.stats['efficiency']:.3f}")
    if s.get("stopped_by_wall"):
        print(f"note: --wall-limit {args.wall_limit:g} stopped the search before its work budget: the same "
              f"command may give another plan on a faster or slower machine")
    if s.get("speedup_over_harmony"):
        print(f"Harmony's search on the same inputs: {s['harmony_time_s']:.4f} s -> speed-up "
              f"{s['speedup_over_harmony']:.3f}x" + ("  (its plan was the best found)" if s["source"] ==
                                                     "harmony-hint" else ""))
    note = hint_note(s, args.time_limit)
    if note:
        print(note)
    if args.output:
        print(f"wrote {p.save(args.output)}")
    if not args.no_compare and args.cost_model == "default":
        from ..planners.registry import BASELINES
        df, _ = compare_table(profile, hw, args.batch, args.mode, args.gpus,
                              planners=BASELINES)
        ours = {"planner": "cp-sat (this plan)", "mode": p.mode, "gpus": p.gpus, "u_fwd": p.microbatch_fwd,
                "u_bwd": p.microbatch_bwd, "packs_fwd": len(p.packs_fwd), "packs_bwd": len(p.packs_bwd),
                "iteration_s": round(p.simulated_iteration_time_s, 4), "efficiency": round(p.stats["efficiency"], 3),
                "search_s": round(p.search_time_s, 2), "note": ""}
        df = pd.concat([pd.DataFrame([ours]).astype({c: "Int64" for c in ("gpus", "u_fwd", "u_bwd", "packs_fwd",
                                                                             "packs_bwd")}), df], ignore_index=True)
        print("\ncomparison (same simulator, same inputs):")
        print(_show(df.drop(columns=["peak_GiB_per_gpu"], errors="ignore")))


def _baseline(args):
    from ..planners.registry import get_planner, planner_entry
    profile, hw = _inputs(args)
    _outputs(args)
    entry = planner_entry(args.planner)
    planner = get_planner(entry.name)
    kw = {"gpus": args.gpus}
    if entry.name == "harmony":
        kw.update(mode="vPP" if args.mode == "auto" else args.mode, cost_model=args.cost_model,
                  packing_fwd=_packers(args.packing_fwd), packing_bwd=_packers(args.packing_bwd))
    elif entry.modes == "auto":
        kw.update(mode=args.mode, cost_model=args.cost_model)
    p = planner(profile, hw, args.batch, hw.gpu_memory_bytes, **kw)
    print(f"{p.planner}: {_describe(p)}")
    print(f"simulated iteration time {p.simulated_iteration_time_s:.6f} s ({p.cost_model} cost model); "
          f"search {p.search_time_s:.3f} s")
    if args.output:
        print(f"wrote {p.save(args.output)}")


def _simulate(args):
    from ..sim.simulator import simulate
    plan = Plan.load(args.plan)
    profile = plan_profile(plan, args.plan, args.profile)
    _outputs(args)
    hw = plan_hardware(plan, args.plan, args.hardware)
    try:
        if plan.cost_model == "harmony":
            from ..harmony import simulate_harmony
            tl = simulate_harmony(plan, profile)
        else:
            tl = simulate(plan, profile, hw)
    except PlanError as e:   # the plan does not fit this profile or hardware: say which file
        raise PlanError(f"{args.plan}: {e}") from None
    moved = tl.bytes_moved()
    print(f"{plan.planner} plan: {_describe(plan)}")
    print(f"iteration time {tl.iteration_time:.6f} s ({plan.cost_model} cost model)")
    if "reserved_memory" in tl.meta:
        print("GPU memory the simulator reserves for its tasks (the planners' pack memory), at most: "
              + ", ".join(f"GPU{r} {fmt_bytes(b)}" for r, b in tl.meta["reserved_memory"].items()))
    else:
        print(f"peak GPU memory ({plan.cost_model} cost model): "
              + ", ".join(f"GPU{r} {fmt_bytes(b)}" for r, b in tl.peak_memory().items()))
    if plan.memory_cap or hw.gpu_memory_bytes:
        print(_program_line(plan if plan.memory_cap else plan.replace(memory_cap=hw.gpu_memory_bytes), profile))
    print(f"bytes moved: host->GPU {moved['h2d'] / 1e9:.2f} GB, GPU->host {moved['d2h'] / 1e9:.2f} GB, "
          f"GPU<->GPU {moved['p2p'] / 1e9:.2f} GB"
          + (f", between servers {tl.meta['network_bytes'] / 1e9:.2f} GB" if "network_bytes" in tl.meta else ""))
    for host in _host_memories(plan, profile, hw):
        print(_host_line(host, hw))
        try:
            host.check(hw, "this plan")
        except InfeasibleError as e:
            print(f"warning: {e}")
    if args.trace:
        print(f"wrote {tl.to_chrome_trace(args.trace)}")
    if args.plot:
        print(f"wrote {tl.plot(args.plot, cap=plan.memory_cap or hw.gpu_memory_bytes)}")


def compare_table(profile, hw, batch, mode="auto", gpus=None, time_limit=10.0, planners=None):
    """Every planner on the same inputs; returns (table, plans by name).

    ``planners``: names to run (default all: cp-sat and the baselines), so a caller that
    sweeps modes runs the mode-independent baselines once."""
    from ..planners.registry import PLANNERS, get_planner
    from ..sim.bound import lower_bound
    from ..sim.simulator import simulate
    cap = hw.gpu_memory_bytes
    rows, plans, errors = [], {}, {}
    bound = lower_bound(profile, hw, batch, cap)["bound_s"]
    runs = []
    for name, entry in PLANNERS.items():
        if planners is not None and name not in planners:
            continue
        fn = get_planner(name)
        if entry.modes == "auto":   # searches the modes itself, within the one asked for
            runs.append((name, lambda fn=fn: fn(profile, hw, batch, cap, gpus=gpus, mode=mode,
                                                time_limit=time_limit)))
        elif entry.modes == "per-mode":     # one run in each mode the request allows
            for m in (("vPP", "vDP") if mode == "auto" else (mode,)):
                label = f"{name} {m}" if mode == "auto" else name
                runs.append((label, lambda fn=fn, m=m: fn(profile, hw, batch, cap, gpus=gpus, mode=m)))
        else:
            runs.append((name, lambda fn=fn: fn(profile, hw, batch, cap, gpus=gpus)))
    for name, run in runs:
        t0 = time.perf_counter()
        try:
            p = run()
        except HarmonyOptError as e:
            rows.append({"planner": name, "iteration_s": float("nan"), "note": str(e).split(";")[0]})
            errors[name] = str(e)
            continue
        tl = simulate(p, profile, hw)
        peak = tl.peak_memory()
        moved = tl.bytes_moved()
        plans[name] = (p, tl)
        rows.append({
            "planner": name, "mode": p.mode, "gpus": p.gpus, "u_fwd": p.microbatch_fwd, "u_bwd": p.microbatch_bwd,
            "packs_fwd": len(p.packs_fwd), "packs_bwd": len(p.packs_bwd),
            "iteration_s": round(tl.iteration_time, 4), "efficiency": round(bound / tl.iteration_time, 3),
            "swap_GB": round((moved["h2d"] + moved["d2h"]) / 1e9, 2),
            "peak_GiB_per_gpu": "/".join(f"{b / 2**30:.2f}" for b in peak.values()),
            "search_s": round(time.perf_counter() - t0, 2), "note": "",
        })
    rows.append({"planner": "lower-bound", "iteration_s": round(bound, 4), "efficiency": 1.0,
                 "note": "no plan can be faster"})
    df = pd.DataFrame(rows)
    for col in ("gpus", "u_fwd", "u_bwd", "packs_fwd", "packs_bwd"):
        if col in df:
            df[col] = df[col].astype("Int64")     # whole numbers, blank where a planner failed
    df.attrs["errors"] = errors                   # planner -> its error message, in full
    return df, plans


def _compare(args):
    profile, hw = _inputs(args)
    _outputs(args, "compare.csv")
    df, plans = compare_table(profile, hw, args.batch, args.mode, args.gpus, args.time_limit)
    print(f"{profile.name}, minibatch {args.batch}, {hw.name} (cap {hw.gpu_memory_bytes / 2**30:.2f} GiB), "
          f"default cost model")
    print(_show(df))
    if not plans:   # every planner refused: an infeasible request, worded by the first refusal
        raise InfeasibleError(f"no planner found a plan; {next(iter(df.attrs['errors'].values()))}")
    if args.output:
        from ..core.io import atomic_write_text
        atomic_write_text(args.output, df.to_csv(index=False))
        print(f"wrote {args.output}")
    if args.plot and plans:
        best = min(plans, key=lambda k: plans[k][1].iteration_time)
        p, tl = plans[best]
        out = tl.plot(Path(args.plot), title=f"{profile.name} D={args.batch}: {best} plan, "
                      f"{tl.iteration_time:.2f} s/iteration", cap=hw.gpu_memory_bytes)
        print(f"wrote {out}")
