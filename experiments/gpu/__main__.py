"""On a real GPU: probe it, profile three models, plan, train with every method, compare.

::

    python -m experiments.gpu                      # everything, on the GPU (resumes: done steps are kept)
    python -m experiments.gpu --stages probe,profile
    python -m experiments.gpu --quick --device cpu --root /tmp/x   # the same logic on tiny models (tests)

Stages, each skipped when its output exists (so one call can finish what an earlier one
started):

1. ``probe``: ``harmony-opt probe``'s measurement -> ``profiles/hardware/<gpu>.toml``.
2. ``profile``: GPT-2 medium, GPT-2 XL and VGG-416 at several microbatch sizes ->
   ``profiles/<gpu>/<model>/``.
3. ``plan``: for every model and memory cap (11 GB, 24 GB) the smallest minibatch whose
   plain-PyTorch training footprint (weights, gradients, optimizer state, activations) is at
   least 4x the cap; there: our CP-SAT plan, Harmony's search, naive-swap, each simulated,
   and the lower bound.
4. ``train``: every plan through the executor, PyTorch's FSDP CPU offload and DeepSpeed
   ZeRO-Offload (when importable), each alone in a process with the CUDA allocator capped:
   samples/s over ``--steps`` steps after ``--warmup``, peak memory, bytes moved.
5. ``correct``: weights after 10 steps through the executor vs plain PyTorch on the GPU,
   TF32 off (cases added later are run on the next call; done ones are kept).
6. ``handoff``: our plan with activation gradients kept on the GPU (Plan.gpu_handoff) and the
   same plan without, trained alternately, against the simulator's figures for both.
7. ``report``: ``experiments/results/gpu_runs.csv``, ``gpu_correctness.csv``,
   ``gpu_by_kind.csv`` (each traced run's work by kind against the simulator's),
   ``gpu_samples_per_s.png``, ``gpu_busy_by_stream.png`` and ``gpu_summary.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harmony_opt.core.errors import HarmonyOptError, UsageError
from harmony_opt.core.io import atomic_write_json
from harmony_opt.core.units import parse_bytes

from . import read_result

GB = 10 ** 9
METHODS = ("ours", "harmony", "naive-swap", "torch-offload", "deepspeed")
PLAN_METHODS = ("ours", "harmony", "naive-swap")
STAGES = ("probe", "profile", "plan", "train", "correct", "handoff", "report")


@dataclasses.dataclass(frozen=True)
class Workload:
    model: str
    sizes: tuple[int, ...]          # microbatch sizes to profile
    batches: tuple[int, ...]        # minibatch candidates: the smallest with footprint >= 4x cap is trained
    overrides: tuple = ()           # model spec overrides, as (key, value) pairs

    @property
    def tag(self) -> str:
        return self.model.replace("-", "_")


FULL = (Workload("gpt2-medium", (1, 2, 4, 8), (8, 16, 32)),
        Workload("gpt2-xl", (1, 2, 4), (2, 4, 8)),
        Workload("vgg416", (1, 2, 4, 8, 16), (16, 32)))
QUICK = (Workload("gpt2-tiny", (1, 2, 4), (8, 16)),
         Workload("vgg-tiny", (1, 2, 4), (8, 16)))


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


class Paths:
    def __init__(self, root: Path, gpu: str):
        self.root = root
        self.hardware = root / "profiles" / "hardware" / f"{gpu}.toml"
        self.profiles = root / "profiles" / gpu
        self.results = root / "experiments" / "results"
        self.raw = self.results / "gpu"

    def profile(self, w: Workload) -> Path:
        return self.profiles / w.tag

    def case(self, w: Workload, cap: int) -> Path:
        return self.raw / f"{w.tag}_cap{cap / GB:g}GB"


# -- stages ----------------------------------------------------------------------------------------

def stage_probe(P: Paths, device: str) -> None:
    from harmony_opt.measure.probe import probe_hardware

    if P.hardware.exists():
        return log(f"probe: {P.hardware} exists")
    hw = probe_hardware(device)
    P.hardware.parent.mkdir(parents=True, exist_ok=True)
    hw.save(P.hardware)
    log(f"probe: {hw.name}: h2d {hw.h2d_bandwidth / 1e9:.1f} GB/s, d2h {hw.d2h_bandwidth / 1e9:.1f} GB/s -> {P.hardware}")


def stage_profile(P: Paths, device: str, workloads, repeats: int) -> None:
    from harmony_opt.measure.models import build_model
    from harmony_opt.measure.profiler import profile_model

    for w in workloads:
        out = P.profile(w)
        if (out / "layers.csv").exists():
            log(f"profile: {out} exists")
            continue
        t0 = time.perf_counter()
        model = build_model(w.model, **dict(w.overrides))
        prof = profile_model(model, list(w.sizes), device, repeats=repeats, warmup=1, progress=False)
        prof.save(out)
        log(f"profile: {w.model} at u={list(prof.sizes('FWD'))} in {time.perf_counter() - t0:.0f} s -> {out}")


def footprint(profile, batch: int) -> int:
    """Bytes plain PyTorch training keeps on one device: W, dW, optimizer state, buffers, and every
    saved activation of the whole minibatch (the profile's largest microbatch, scaled)."""
    R = profile.num_layers
    u = int(profile.sizes("BWD")[-1])
    saved = profile.costs("BWD", u).pack_saved(0, R - 1) * batch / u
    return int(2 * profile.param_bytes(0, R - 1) + profile.buffer_bytes(0, R - 1) + profile.optimizer_bytes(0, R - 1)
               + saved)


def cases(P: Paths, workloads, caps):
    """(workload, cap, batch or None, footprint at that batch) for every model and cap."""
    from harmony_opt.core.profile import Profile

    for w in workloads:
        prof = Profile.load(P.profile(w))
        feet = {b: footprint(prof, b) for b in w.batches}
        for cap in caps:
            batch = next((b for b in w.batches if feet[b] >= 4 * cap), None)
            yield w, cap, batch, feet[batch or w.batches[-1]], prof


def stage_plan(P: Paths, workloads, caps, time_limit: float) -> None:
    from .trial import busy_by_stream
    from harmony_opt.planners.baselines import plan_naive_swap
    from harmony_opt.planners.registry import get_planner
    from harmony_opt.sim.bound import lower_bound
    from harmony_opt.core.hardware import get_hardware
    from harmony_opt.sim.simulator import simulate

    for w, cap, batch, foot, prof in cases(P, workloads, caps):
        d = P.case(w, cap)
        if (d / "case.json").exists():
            log(f"plan: {d} exists")
            continue
        d.mkdir(parents=True, exist_ok=True)
        info = {"model": w.model, "overrides": dict(w.overrides), "cap": cap, "batch": batch, "footprint": foot,
                "plans": {}}
        if batch is None:
            info["skipped"] = (f"footprint {foot / GB:.1f} GB at the largest minibatch tried ({w.batches[-1]}) is "
                               f"under 4x the cap")
        else:
            hw = get_hardware(P.hardware, memory_cap=cap)
            info["lower_bound_s"] = lower_bound(prof, hw, batch, cap)["bound_s"]
            makers = {"ours": lambda: get_planner("cp-sat")(prof, hw, batch, cap, time_limit=time_limit),
                      "harmony": lambda: get_planner("harmony")(prof, hw, batch, cap, mode="vPP", gpus=1),
                      "naive-swap": lambda: plan_naive_swap(prof, hw, batch, cap, gpus=1)}
            for method, make in makers.items():
                t0 = time.perf_counter()
                try:
                    p = make()
                except Exception as e:   # noqa: BLE001 - an infeasible or failed planner is a row of the table
                    info["plans"][method] = {"error": f"{type(e).__name__}: {e}"[:400]}
                    continue
                tl = simulate(p, prof, hw, memory_cap=cap)
                p.save(d / f"{method}.plan.json")
                moved = tl.bytes_moved()
                info.setdefault("simulated_busy", {})[method] = busy_by_stream(tl)
                info["plans"][method] = {"simulated_s": tl.iteration_time, "search_s": time.perf_counter() - t0,
                                         "sim_h2d": moved["h2d"], "sim_d2h": moved["d2h"],
                                         "sim_peak": max(tl.peak_memory().values()),
                                         "u_fwd": p.microbatch_fwd, "u_bwd": p.microbatch_bwd,
                                         "packs_fwd": len(p.packs_fwd), "packs_bwd": len(p.packs_bwd)}
            log(f"plan: {w.model} cap {cap / GB:.0f} GB, D={batch} (footprint {foot / GB:.1f} GB): " + ", ".join(
                f"{m} {v['simulated_s']:.3f} s" if "simulated_s" in v else f"{m} failed"
                for m, v in info["plans"].items()))
        atomic_write_json((d / "case.json"), info)


def _trial(job: dict, out: Path, timeout: float) -> dict:
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    try:
        subprocess.run([sys.executable, "-m", "experiments.gpu.trial", json.dumps(job), str(out)], env=env,
                       timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        atomic_write_json(out, {"ok": False, "error": f"timed out after {timeout:.0f} s"})
    if not out.exists():
        atomic_write_json(out, {"ok": False, "error": "the run's process died without a result"})
    return read_result(out)


def _deepspeed_available() -> str | None:
    try:
        import deepspeed  # noqa: F401
    except Exception as e:   # noqa: BLE001 - any import failure means "not available", said in the table
        return f"DeepSpeed not importable: {type(e).__name__}: {e}"[:300]
    return None


def stage_train(P: Paths, workloads, caps, device: str, steps: int, warmup: int, run_budget: float,
                methods) -> None:
    ds_missing = _deepspeed_available() if "deepspeed" in methods else None
    if device == "cuda":
        import torch
        atomic_write_json(P.raw / "device.json", {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                                  "cuda": torch.version.cuda})
    every = list(cases(P, workloads, caps))
    todo = [(c, m) for m in methods if m in PLAN_METHODS for c in every]
    todo += [(c, m) for m in methods if m not in PLAN_METHODS for c in every]      # the slow ones last
    for (w, cap, batch, _, _), method in todo:
        d = P.case(w, cap)
        info = read_result(d / "case.json")
        if batch is None:
            continue
        ours = info["plans"].get("ours", {})
        out = d / f"{method}.run.json"
        if out.exists():
            continue
        if method == "deepspeed" and (ds_missing or device != "cuda"):
            atomic_write_json(out, {"ok": False, "error": ds_missing or "DeepSpeed needs CUDA"})
            continue
        est = info["plans"].get(method, ours).get("simulated_s")
        if method in PLAN_METHODS and est is None:
            atomic_write_json(out, {"ok": False, "error": "no plan: " + info["plans"][method]["error"]})
            continue
        # plan methods: as many steps as the budget allows at the simulated speed; the others stop
        # by themselves once their measured steps took the budget
        n = min(steps, max(3, int(run_budget / est) - warmup)) if method in PLAN_METHODS else steps
        job = {"method": method, "model": w.model, "overrides": dict(w.overrides), "batch": batch, "cap": cap,
               "warmup": warmup, "steps": n, "device": device,
               "plan": str(d / f"{method}.plan.json"), "microbatch": ours.get("u_bwd", 1), "budget_s": run_budget,
               "trace_path": str(d / f"{method}.trace.json")}
        t0 = time.perf_counter()
        res = _trial(job, out, timeout=max(120.0, 6 * run_budget))
        res["wall_s"] = time.perf_counter() - t0
        res["job"] = job
        atomic_write_json(out, res)
        log(f"train: {w.model} cap {cap / GB:.0f} GB {method}: " + (
            f"{res['samples_per_s']:.2f} samples/s, step {res['step_s_mean']:.3f} s over {res['steps_measured']}"
            f" steps, peak {res['peak_allocated'] or 0:.3g} B" if res.get("ok") else f"FAILED {res['error']}"))


def stage_correct(P: Paths, device: str, quick: bool) -> None:
    from .correctness import check_all

    out = P.raw / "correctness.json"
    old = read_result(out) if out.exists() else []
    rows = check_all(device, quick, done={r["case"] for r in old})
    if not rows:
        return log(f"correct: {out} holds every case")
    P.raw.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, old + rows)
    for r in rows:
        log(f"correct: {r['case']}: max relative weight error {r['max_rel_error']:.2e}")


def stage_handoff(P: Paths, workloads, caps, device: str, steps: int, warmup: int, rounds: int = 3) -> None:
    """Plan.gpu_handoff measured: our plan of each case trained with the activation gradients between
    single-microbatch backward packs kept on the GPU and with Harmony's round trip through host
    memory, alternately (``rounds`` times each, so that drift hits both; the report takes the median
    over rounds, which leaves out the first run's cold caches), against the simulator's figures for
    both. Cases whose plan has no such pair of packs are recorded as such."""
    from harmony_opt.compile.compiler import compile_plan
    from harmony_opt.core.hardware import get_hardware
    from harmony_opt.core.plan import Plan
    from harmony_opt.sim.simulator import simulate

    for w, cap, batch, _, prof in cases(P, workloads, caps):
        d = P.case(w, cap)
        out = d / "handoff.json"
        if batch is None or out.exists() or not (d / "ours.plan.json").exists():
            continue
        base = Plan.load(d / "ours.plan.json")
        plans = {"host": base.replace(gpu_handoff=False), "kept": base.replace(gpu_handoff=True)}
        swaps = {k: sum(n for code, n in compile_plan(p).counts().items() if code[0] in "IO") for k, p in plans.items()}
        info = {"model": w.model, "cap": cap, "batch": batch, "swaps": swaps, "runs": []}
        if swaps["kept"] == swaps["host"]:
            info["skipped"] = "no two consecutive backward packs of one microbatch: nothing to keep on the GPU"
            atomic_write_json(out, info)
            log(f"handoff: {w.model} cap {cap / GB:.0f} GB: {info['skipped']}")
            continue
        hw = get_hardware(P.hardware, memory_cap=cap)
        for k, p in plans.items():
            p.save(d / f"ours-{k}.plan.json")
            tl = simulate(p, prof, hw, memory_cap=cap)
            info[f"simulated_{k}_s"] = tl.iteration_time
            info[f"sim_bytes_{k}"] = tl.bytes_moved()
        for r in range(rounds):
            for k in ("host", "kept"):
                job = {"method": "ours", "model": w.model, "overrides": dict(w.overrides), "batch": batch, "cap": cap,
                       "warmup": warmup, "steps": steps, "device": device, "plan": str(d / f"ours-{k}.plan.json")}
                res = _trial(job, d / f"ours-{k}.run{r}.json", timeout=600)
                info["runs"].append({"plan": k, "round": r, **{f: res.get(f) for f in (
                    "ok", "error", "step_s_mean", "step_s_median", "bytes_h2d_per_step", "bytes_d2h_per_step",
                    "peak_allocated", "loss_first", "loss_last")}})
                log(f"handoff: {w.model} cap {cap / GB:.0f} GB, gradients via {k}, round {r}: " + (
                    f"{res['step_s_mean']:.4f} s/step" if res.get("ok") else f"FAILED {res.get('error')}"))
        atomic_write_json(out, info)


def stage_report(P: Paths, workloads, caps, device_name: str) -> None:
    from .report import write_report

    write_report(P, workloads, caps, device_name)


def main(argv=None) -> int:
    """Bad input ends in one line and exit code 2, as the tool's own commands do.

    A time limit's SIGTERM unwinds like Ctrl-C: the run in flight is killed, finished results
    stay. The handler is put back on return, so that a caller's process (a test run) does not
    turn its own SIGTERM into a SystemExit inside whatever runs next."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _main(argv)
    except HarmonyOptError as e:
        print(f"python -m experiments.gpu: error: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="tiny models and caps: the logic, in seconds (tests)")
    ap.add_argument("--root", default=".", help="where profiles/ and experiments/results/ are (default: here)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--run-budget", type=float, default=60.0,
                    help="seconds of measured steps per run at the simulated speed; fewer steps when over")
    ap.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT planner's limit per case")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--models", default=None, help="comma list of models to keep (default all)")
    ap.add_argument("--gpu", default=None,
                    help="name of the GPU's profiles and hardware file (default: h100/h200 from the device); "
                         "e.g. --device cpu --gpu h100 --stages plan plans from a GPU's measurements on a CPU")
    ap.add_argument("--caps", default=None, help="comma list of caps in GB (default 11,24)")
    args = ap.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("no CUDA GPU here; use --device cpu (with --quick) to run the logic")
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    gpu = "h100" if "H100" in device_name else "h200" if "H200" in device_name else (
        "cpu" if args.device == "cpu" else device_name.split()[-1].lower())
    workloads = QUICK if args.quick else FULL
    if args.models:
        keep = set(args.models.split(","))
        if keep - {w.model for w in workloads}:
            raise UsageError(f"--models: unknown {', '.join(sorted(keep - {w.model for w in workloads}))}; this "
                             f"experiment's models are {', '.join(w.model for w in workloads)}")
        workloads = tuple(w for w in workloads if w.model in keep)
    caps = ([parse_bytes(f"{c.strip()}GB", "--caps") for c in args.caps.split(",")] if args.caps
            else [int(0.001 * GB), int(0.002 * GB)] if args.quick else [11 * GB, 24 * GB])
    methods = [m for m in args.methods.split(",") if m]
    stages = args.stages.split(",")
    for option, given, valid in (("--methods", methods, METHODS), ("--stages", stages, STAGES)):
        if set(given) - set(valid):
            raise UsageError(f"{option}: unknown {', '.join(sorted(set(given) - set(valid)))}; "
                             f"valid: {', '.join(valid)}")
    P = Paths(Path(args.root).resolve(), args.gpu or gpu)
    log(f"device {device_name}; stages {stages}; root {P.root}")
    if "probe" in stages:
        stage_probe(P, args.device)
    if "profile" in stages:
        stage_profile(P, args.device, workloads, repeats=2 if args.quick else 3)
    if "plan" in stages:
        stage_plan(P, workloads, caps, 2.0 if args.quick else args.time_limit)
    if "train" in stages:
        stage_train(P, workloads, caps, args.device, args.steps, args.warmup, args.run_budget, methods)
    if "correct" in stages:
        stage_correct(P, args.device, args.quick)
    if "handoff" in stages:
        stage_handoff(P, workloads, caps, args.device, max(3, args.steps // 2), args.warmup)
    if "report" in stages:
        recorded = P.raw / "device.json"     # the GPU the runs were measured on, when reported elsewhere
        stage_report(P, workloads, caps, read_result(recorded)["device"] if recorded.exists() and
                     args.device == "cpu" else device_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
