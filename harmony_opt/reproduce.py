"""The experiments: the paper's Table 1, every planner on the shipped models, and scaling.

Why a library module: ``harmony-opt reproduce`` and the thin scripts in ``experiments/``
both call these functions, so there is one implementation and one set of defaults.
Each experiment is a function from settings to a pandas table (no printing, no files);
``write_*`` functions turn tables into CSV, markdown and PNG files. Timings are taken
in this process, one search after the other, so ratios between planners are fair;
the compare grid may run in parallel worker processes (``jobs``) because it reports
plan quality, not search time.

    harmony-opt reproduce all            # everything into experiments/results/
    harmony-opt reproduce table1 --time-limit 20
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import platform
import time
from pathlib import Path

import numpy as np
import pandas as pd

from .commands.planning import compare_table
from .core.bundled import bundled_names, load_profile
from .core.errors import HarmonyOptError
from .core.hardware import get_hardware
from .core.io import atomic_write_bytes, atomic_write_text
from .core.units import GiB, fmt_bytes
from .harmony import harmony_search
from .measure.synthetic import GPT2_SCALING, gpt2_profile
from .planners.baselines import plan_harmony
from .sim.bound import lower_bound
from .sim.simulator import simulate

log = logging.getLogger("harmony_opt.reproduce")

RESULTS_DIR = Path(__file__).resolve().parent.parent / "experiments" / "results"
HARDWARE = "1080ti-x4"

#: Table 1 of the paper: (model, memory cap in bytes), D = 64, vPP, 4 GPUs (run_four_models__tab1.sh).
TABLE1_CASES = (("bert_96", int(9e9)), ("gpt2_xl", int(9e9)), ("vgg416", 10 * GiB), ("resnet1026", 10 * GiB))
TABLE1_BATCH, TABLE1_GPUS, TABLE1_MODE = 64, 4, "vPP"

COMPARE_BATCHES = (16, 64, 256)
COMPARE_GPUS = (1, 2, 4)
#: Planners in the order of every table and legend; "cp-sat" is ours.
PLANNERS = ("cp-sat", "harmony", "naive-swap", "l2l", "zero-offload")
LABELS = {"cp-sat": "ours (CP-SAT)", "harmony": "Harmony's search", "naive-swap": "naive swap (per microbatch)",
          "l2l": "L2L", "zero-offload": "ZeRO-Offload-like", "lower-bound": "lower bound"}
COLORS = {"cp-sat": "tab:blue", "harmony": "tab:orange", "naive-swap": "tab:red", "l2l": "tab:purple",
          "zero-offload": "tab:green", "lower-bound": "black"}
#: naive-swap and l2l simulate every microbatch size they can run; ``--baseline-budget B`` skips them
#: where minibatch x layers > B. 0 (the default): never. Since the simulator's rewrite the heaviest
#: cell of the grid (vgg416, D = 256, 4 GPUs) takes about 20 s for both, so no cell is skipped.
BASELINE_BUDGET = 0
GANTT_CASE = ("gpt2_xl", 64, 4, "vPP")

SCALING_MODELS = ("gpt2_10b", "gpt2_20b", "gpt2_40b", "gpt2_70b", "gpt2_100b")


# -- shared helpers -------------------------------------------------------------------------------
def machine_description() -> str:
    """One line naming the CPU, cores, memory and library versions, so results say where they ran."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    try:
        from ortools import __version__ as ortools_version
    except ImportError:
        ortools_version = "?"
    return (f"{cpu}, {os.cpu_count()} cores{mem}; {platform.system()} {platform.release()}; "
            f"Python {platform.python_version()}, OR-tools {ortools_version}, numpy {np.__version__}, "
            f"pandas {pd.__version__}")


def markdown_table(df: pd.DataFrame, floatfmt: str = ".4g") -> str:
    """A GitHub markdown table (no tabulate dependency); NaN prints as an empty cell."""
    def cell(v):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return ""
        if isinstance(v, (float, np.floating)):
            return format(float(v), floatfmt)
        return str(v).replace("|", "/")
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class Section:
    """One markdown table of a results file: a heading, the columns it shows, the notes under it."""

    heading: str
    columns: list[str] | None
    notes: str = ""


def write_table(df: pd.DataFrame, out_dir: Path, stem: str, title: str, sections: list[Section]) -> list[Path]:
    """``stem.csv`` (every column, full precision) and ``stem.md`` (one table per section)."""
    out_dir = Path(out_dir)
    csv = atomic_write_text(out_dir / f"{stem}.csv", df.to_csv(index=False))
    parts = [f"# {title}\n"]
    for s in sections:
        shown = df[[c for c in s.columns if c in df.columns]] if s.columns else df
        parts.append((f"## {s.heading}\n\n" if s.heading else "") + markdown_table(shown) + "\n" + s.notes.strip() + "\n")
    md = atomic_write_text(out_dir / f"{stem}.md", "\n".join(parts) + f"\nMachine: {machine_description()}\n")
    return [csv, md]


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else float("nan")


def _ratio(a, b) -> float:
    return a / b if a and b and math.isfinite(a) and math.isfinite(b) else float("nan")


def solver_columns(p, prefix: str) -> dict:
    """What the CP-SAT planner reports of its plan (``plan.solver``, docs/planner.md section 5), flat.

    ``model_s``: the planner's model of the simulator for the returned plan, ``fidelity`` its
    relative error against the simulated time; ``bound_s``/``gap``: the bound on the model over
    every configuration searched and the gap of ``model_s`` to it; ``config_*``: the chosen
    configuration (status OPTIMAL where the DP or CP-SAT proved the plan optimal for the model
    in it, the proof, its own gap); ``timeline_*``: the CP-SAT timeline model of the plan's
    events; ``found_by``: what found the plan (harmony-hint where Harmony's plan was kept)."""
    s = p.solver or {}
    conf, tl = s.get("configuration") or {}, s.get("timeline") or {}
    return {f"{prefix}{k}": v for k, v in {
        "found_by": s.get("source"),
        "model_s": _num(s.get("objective")), "fidelity": _num(s.get("fidelity")),
        "bound_s": _num(s.get("bound")), "gap": _num(s.get("gap")),
        "config_status": conf.get("status", s.get("status")), "config_proof": conf.get("proof") or "none",
        "config_gap": _num(conf.get("gap")),
        "timeline_status": tl.get("status", "not run"), "timeline_gap": _num(tl.get("gap")),
        "configs": s.get("configurations"), "configs_evaluated": s.get("evaluated"),
    }.items()}


def plan_columns(p, prefix: str) -> dict:
    """A plan's shape: mode, GPUs, microbatch sizes, number of packs."""
    return {f"{prefix}mode": p.mode, f"{prefix}gpus": p.gpus, f"{prefix}u_fwd": p.microbatch_fwd,
            f"{prefix}u_bwd": p.microbatch_bwd, f"{prefix}packs_fwd": len(p.packs_fwd),
            f"{prefix}packs_bwd": len(p.packs_bwd)}


# -- Table 1 -----------------------------------------------------------------------------------------
def table1_row(model: str, cap: int, time_limit: float, batch: int = TABLE1_BATCH, gpus: int = TABLE1_GPUS,
               mode: str = TABLE1_MODE) -> dict:
    """Harmony's search and ours on one Table 1 case, in this process, one after the other.

    Three searches: Harmony's (its published packing methods), ours at Harmony's settings
    (``ours_*``: the same mode and GPUs, so the two searches face the same question) and ours
    with the mode, the GPU count and uneven microbatch splits free (``ours_free_*``). Every plan
    is judged by our simulator, so the speed-ups compare plans under one cost model;
    ``harmony_own_model_s`` is what Harmony's own simulator says of its best candidate, for
    comparison with the paper."""
    from harmony_opt.solver_models.planner import PlannerOptions, plan

    profile = load_profile(model)
    hw = get_hardware(HARDWARE, memory_cap=cap)
    t0 = time.perf_counter()
    hp = plan_harmony(profile, hw, batch, cap, mode=mode, gpus=gpus)
    h_search = time.perf_counter() - t0
    h_t = hp.simulated_iteration_time_s
    own = harmony_search(profile, batch, gpus, mode, cap, packing_fwd="published", packing_bwd="published",
                         topk=1, rank_fit_normally=True)
    row = {"model": model, "layers": profile.num_layers, "batch": batch, "gpus": gpus, "mode": mode,
           "cap_bytes": int(cap), "harmony_space": hp.stats.get("search_space"),
           "harmony_configs": hp.stats.get("configs_evaluated"), "harmony_search_s": h_search,
           **plan_columns(hp, "harmony_"),
           "harmony_methods": f"{hp.stats.get('method_fwd') or '-'}/{hp.stats.get('method_bwd')}",
           "harmony_time_s": h_t, "harmony_own_model_s": own.best.time}
    runs = (("ours_", PlannerOptions(mode=mode, gpus=gpus, time_limit=time_limit)),
            ("ours_free_", PlannerOptions(mode="auto", gpus=None, uneven=True, time_limit=time_limit)))
    for prefix, opts in runs:
        t0 = time.perf_counter()
        op = plan(profile, hw, batch, opts, memory_cap=cap)
        search = time.perf_counter() - t0
        o_t = op.simulated_iteration_time_s
        row.update({f"{prefix}search_s": search, f"{prefix}search_ratio": _ratio(search, h_search),
                    **plan_columns(op, prefix), f"{prefix}time_s": o_t, **solver_columns(op, prefix)})
        solver = op.solver or {}
        if prefix == "ours_":
            row["speedup"] = _ratio(h_t, o_t)
            row["lower_bound_s"] = _num(solver.get("lower_bound_s"))
            row["ours_efficiency"] = _ratio(row["lower_bound_s"], o_t)
            if solver.get("harmony_time_s") is not None and not math.isclose(solver["harmony_time_s"], h_t,
                                                                             rel_tol=1e-9):
                log.warning("table1 %s: the planner's Harmony run gave %.6g s, ours %.6g s", model,
                            solver["harmony_time_s"], h_t)
        else:
            # the free planner's own reference: Harmony's search in both modes on every GPU
            row["harmony_any_mode_time_s"] = _num(solver.get("harmony_time_s"))
            row["ours_free_speedup"] = _ratio(h_t, o_t)
            row["ours_free_speedup_any_mode"] = _ratio(row["harmony_any_mode_time_s"], o_t)
            row["ours_free_efficiency"] = _ratio(row["lower_bound_s"], o_t)
    return row


def table1(time_limit: float = 20.0, models: list[str] | None = None) -> pd.DataFrame:
    """Table 1: one row per model (see :func:`table1_row`)."""
    rows = []
    for model, cap in TABLE1_CASES:
        if models and model not in models:
            continue
        r = table1_row(model, cap, time_limit)
        log.info("table1 %s: Harmony %.3f s/iter (%d configs, %.2f s search); ours %.3f s/iter (%.2f s search, "
                 "%.3fx); ours free %.3f s/iter (%s x%d, %.2f s search, %.3fx)", model, r["harmony_time_s"],
                 r["harmony_configs"], r["harmony_search_s"], r["ours_time_s"], r["ours_search_s"], r["speedup"],
                 r["ours_free_time_s"], r["ours_free_mode"], r["ours_free_gpus"], r["ours_free_search_s"],
                 r["ours_free_speedup"])
        rows.append(r)
    return pd.DataFrame(rows)


#: the markdown tables of table1.md: Harmony's search, ours at its settings, ours with mode and GPUs free
TABLE1_HARMONY_MD = ["model", "layers", "harmony_space", "harmony_configs", "harmony_search_s", "harmony_u_fwd",
                     "harmony_u_bwd", "harmony_packs_fwd", "harmony_packs_bwd", "harmony_time_s",
                     "harmony_own_model_s"]
TABLE1_OURS_MD = ["model", "ours_search_s", "ours_search_ratio", "ours_u_fwd", "ours_u_bwd", "ours_packs_fwd",
                  "ours_packs_bwd", "ours_time_s", "speedup", "ours_model_s", "ours_fidelity", "ours_bound_s",
                  "ours_gap", "ours_config_status", "ours_config_proof", "ours_config_gap", "ours_timeline_gap",
                  "lower_bound_s", "ours_efficiency"]
TABLE1_FREE_MD = ["model", "ours_free_search_s", "ours_free_search_ratio", "ours_free_mode", "ours_free_gpus",
                  "ours_free_u_fwd", "ours_free_u_bwd", "ours_free_packs_fwd", "ours_free_packs_bwd",
                  "ours_free_time_s", "ours_free_speedup", "harmony_any_mode_time_s", "ours_free_speedup_any_mode",
                  "ours_free_fidelity", "ours_free_bound_s", "ours_free_gap", "ours_free_config_status",
                  "ours_free_config_proof", "ours_free_timeline_gap"]
#: what `harmony-opt reproduce table1` prints: the columns the issue asks for, and the free variant's
TABLE1_PRINT = ["model", "layers", "harmony_configs", "harmony_search_s", "harmony_time_s", "ours_search_s",
                "ours_time_s", "ours_bound_s", "ours_gap", "speedup", "ours_free_mode", "ours_free_gpus",
                "ours_free_search_s", "ours_free_time_s", "ours_free_speedup"]

def solver_notes(prefix: str) -> str:
    """What the columns of :func:`solver_columns` mean, named with ``prefix``."""
    def c(name):
        return f"`{prefix}{name}`"
    return (
        f"The planner's columns come from `plan.solver` (docs/planner.md, section 5). {c('model_s')}: the planner's "
        f"model of the simulator for the returned plan; {c('fidelity')} = |model - simulated| / simulated. "
        f"{c('bound_s')}, {c('gap')}: a bound on the model's iteration time over every configuration searched "
        "(the DP's or CP-SAT's bound where they solved a configuration, the cheap configuration bound elsewhere) "
        f"and the relative gap of {c('model_s')} to it: a bound on the model, not on the simulated time, and as "
        f"weak as the weakest configuration left unsolved. {c('config_status')}: OPTIMAL where the DP or CP-SAT "
        "proved the plan optimal for the model within its configuration (mode, GPUs, microbatch sizes), "
        f"FEASIBLE otherwise, NOT_SOLVED where Harmony's plan was kept ({c('found_by')} harmony-hint); "
        f"{c('config_proof')}: dp, cp-sat or none; {c('config_gap')}: the gap within that configuration. "
        f"{c('timeline_gap')}: the gap of the CP-SAT timeline model that schedules the plan's own events in the "
        "simulator's stream order (what another dispatcher of the same events could still gain; blank where "
        "the planner's budget left no time for that model).")


def write_table1(df: pd.DataFrame, out_dir: Path, time_limit: float) -> list[Path]:
    harmony = (f"Settings of the paper's Table 1: minibatch {TABLE1_BATCH}, {TABLE1_MODE}, {TABLE1_GPUS} GPUs "
               f"({HARDWARE}), memory cap 9e9 bytes (bert_96, gpt2_xl) or 10 GiB (vgg416, resnet1026). Harmony's "
               "search with its published packing methods (forward balanced-by-time and reuse, backward "
               "balanced-by-time), every candidate judged by our simulator (default cost model): "
               "`harmony_space` is the grid of microbatch-size pairs it walks, `harmony_configs` the valid "
               "candidates it scores, `harmony_search_s` its search time, `harmony_time_s` its best plan's "
               "simulated iteration time and `harmony_own_model_s` that plan's time in Harmony's own simulator. "
               "Times in seconds.")
    ours = ("Our planner at the same settings (vPP, 4 GPUs, same caps), so its search answers the question "
            f"Harmony's does; time limit {time_limit:g} work seconds. `ours_search_s` is its wall time, which "
            "includes a run of Harmony's search (its incumbent and warm start); `ours_search_ratio` = "
            "ours_search_s / harmony_search_s. `ours_time_s`: the simulated iteration time of its plan, judged by "
            "the same simulator as Harmony's; `speedup` = harmony_time_s / ours_time_s (>= 1: the planner "
            "starts from Harmony's plan). `lower_bound_s`: the physical lower bound over all plans "
            "(harmony_opt.sim.bound), `ours_efficiency` = lower_bound_s / ours_time_s. " + solver_notes("ours_"))
    free = ("Our planner with the mode, the GPU count (1 to 4) and uneven microbatch splits free "
            f"(`PlannerOptions(mode=\"auto\", gpus=None, uneven=True)`, time limit {time_limit:g} work "
            "seconds), in the same process after the two searches above. `ours_free_speedup` = harmony_time_s "
            "(Harmony's vPP plan of the first table) / ours_free_time_s; `harmony_any_mode_time_s` is the best "
            "of Harmony's search in vPP and vDP on 4 GPUs (the free planner's incumbent) and "
            "`ours_free_speedup_any_mode` the speed-up over it. The other columns as above, named `ours_free_*`.")
    return write_table(df, out_dir, "table1", "Table 1: Harmony's schedule search vs the CP-SAT planner", [
        Section("Harmony's search", TABLE1_HARMONY_MD, harmony),
        Section("Ours at Harmony's settings", TABLE1_OURS_MD, ours),
        Section("Ours with the mode and GPU count free", TABLE1_FREE_MD, free)])


# -- compare: every planner on the shipped models -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CompareCell:
    """One (model, minibatch, GPUs) cell of the grid; both modes where they differ (N > 1)."""

    model: str
    batch: int
    gpus: int
    time_limit: float = 5.0
    baseline_budget: int = BASELINE_BUDGET     # max batch x layers for naive-swap and l2l; 0: no limit
    keep_timelines: bool = False

    @property
    def modes(self) -> tuple[str, ...]:
        return ("vPP",) if self.gpus == 1 else ("vPP", "vDP")   # vDP on one GPU is vPP


def compare_cells(models=None, batches=COMPARE_BATCHES, gpus=COMPARE_GPUS, gantt=GANTT_CASE,
                  **kw) -> list[CompareCell]:
    """The grid; the cell of the ``gantt`` case keeps its timelines for the Gantt charts."""
    return [CompareCell(m, d, n, keep_timelines=(m, d, n) == tuple(gantt[:3]), **kw)
            for m in (models or bundled_names()) for d in batches for n in gpus]


def run_cell(cell: CompareCell) -> tuple[list[dict], dict]:
    """Rows (one per planner and mode, plus the lower bound) and, if asked, the timelines by (planner, mode)."""
    profile = load_profile(cell.model)
    hw = get_hardware(HARDWARE, gpus=cell.gpus)
    t0 = time.perf_counter()
    frames, timelines = [], {}
    for mode in cell.modes:
        df, plans = compare_table(profile, hw, cell.batch, mode, cell.gpus, cell.time_limit,
                                  planners=("cp-sat", "harmony"))
        rows = df.assign(mode_requested=mode).to_dict("records")
        if "cp-sat" in plans:
            harmony = plans["harmony"][1].iteration_time if "harmony" in plans else float("nan")
            ours = plans["cp-sat"][1].iteration_time
            for r in rows:
                if r["planner"] == "cp-sat":
                    r.update(solver_columns(plans["cp-sat"][0], "solver_"), speedup_vs_harmony=harmony / ours)
        frames.append(pd.DataFrame(rows))
        if cell.keep_timelines:
            timelines.update({(name, mode): tl for name, (_, tl) in plans.items()})
    layerwise = ("naive-swap", "l2l")
    heavy = cell.baseline_budget and cell.batch * profile.num_layers > cell.baseline_budget
    run = [p for p in ("naive-swap", "l2l", "zero-offload") if not (heavy and p in layerwise)]
    df, _ = compare_table(profile, hw, cell.batch, "vDP", cell.gpus, cell.time_limit, planners=run)
    frames.append(df[df.planner != "lower-bound"].assign(mode_requested="vDP"))
    if heavy:
        frames.append(pd.DataFrame([{"planner": p, "iteration_s": float("nan"), "mode_requested": "vDP",
                                     "note": f"skipped: batch x layers = {cell.batch * profile.num_layers} > "
                                             f"--baseline-budget {cell.baseline_budget}"}
                                    for p in layerwise]))
    out = pd.concat(frames, ignore_index=True)
    out = out[~(out.planner.eq("lower-bound") & out.duplicated("planner"))]
    out.insert(0, "model", cell.model)
    out.insert(1, "layers", profile.num_layers)
    out.insert(2, "batch", cell.batch)
    out.insert(3, "gpus_requested", cell.gpus)
    out["status"] = np.where(out.iteration_s.notna(), "ok",
                             np.where(out.note.fillna("").str.startswith("skipped"), "skipped", "infeasible"))
    out.loc[out.planner == "lower-bound", "status"] = "bound"
    log.info("compare %s D=%d N=%d: %.1f s", cell.model, cell.batch, cell.gpus, time.perf_counter() - t0)
    return out.to_dict("records"), timelines


def _log_to_stderr(level: int) -> None:
    """Worker processes report progress like the parent."""
    logging.basicConfig(level=level, format="%(message)s")


#: what compare.csv keeps of ``plan.solver`` for our plans (see :func:`solver_columns`)
COMPARE_SOLVER_COLUMNS = ["solver_found_by", "solver_model_s", "solver_fidelity", "solver_bound_s", "solver_gap",
                          "solver_config_status", "solver_config_proof", "solver_config_gap",
                          "solver_timeline_status", "solver_timeline_gap"]


def compare(cells: list[CompareCell], jobs: int = 1) -> tuple[pd.DataFrame, dict]:
    """Run the cells (``jobs`` worker processes; heaviest first), return the table and kept timelines."""
    order = sorted(cells, key=lambda c: -c.batch * load_profile(c.model).num_layers)
    results = {}
    if jobs <= 1:
        for c in order:
            results[c] = run_cell(c)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_log_to_stderr, initargs=(logging.getLogger().getEffectiveLevel(),)) as pool:
            futures = {c: pool.submit(run_cell, c) for c in order}
            results = {c: f.result() for c, f in futures.items()}
    rows, timelines = [], {}
    for c in cells:
        r, tls = results[c]
        rows += r
        timelines.update({(c.model, c.batch, c.gpus, *k): v for k, v in tls.items()})
    cols = ["model", "layers", "batch", "gpus_requested", "mode_requested", "planner", "status", "mode", "gpus",
            "u_fwd", "u_bwd", "packs_fwd", "packs_bwd", "iteration_s", "efficiency", "swap_GB",
            "peak_GiB_per_gpu", "search_s", "speedup_vs_harmony", *COMPARE_SOLVER_COLUMNS, "note"]
    df = pd.DataFrame(rows)
    return df[[c for c in cols if c in df.columns]], timelines


def best_per_cell(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, batch, GPUs, planner): the faster mode for ours and Harmony's (a user
    would pick it), the bound, and a NaN row for a planner with no plan."""
    keys = ["model", "batch", "gpus_requested", "planner"]
    ok = df[df.iteration_s.notna()].sort_values("iteration_s")
    best = ok.drop_duplicates(keys)
    missing = df[~df.set_index(keys).index.isin(best.set_index(keys).index)].drop_duplicates(keys)
    out = pd.concat([best, missing], ignore_index=True)
    rank = out.planner.map({p: i for i, p in enumerate((*PLANNERS, "lower-bound"))})
    return out.assign(_r=rank).sort_values(keys[:3] + ["_r"]).drop(columns="_r").reset_index(drop=True)


def _cell_label(d, n):
    return f"D={d}\nN={n}"


def _grid_figure(best: pd.DataFrame, value: str, ylabel: str, title: str, path: Path, log_y: bool,
                 with_bound: bool = False, ylim=None) -> Path:
    """One panel per model; per (D, N) cell a group of bars, one per planner; x marks no plan."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(best.model))
    ncols = min(3, len(models))
    nrows = math.ceil(len(models) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.2 * ncols, 4.3 * nrows + 0.8), squeeze=False)
    width = 0.8 / len(PLANNERS)
    for ax, model in zip(axes.flat, models):
        sub = best[best.model == model]
        cells = sorted({(int(d), int(n)) for d, n in zip(sub.batch, sub.gpus_requested)})
        x = np.arange(len(cells))
        missing = []
        for k, planner in enumerate(PLANNERS):
            vals = []
            for d, n in cells:
                r = sub[(sub.batch == d) & (sub.gpus_requested == n) & (sub.planner == planner)]
                vals.append(float(r[value].iloc[0]) if len(r) and pd.notna(r[value].iloc[0]) else float("nan"))
            vals = np.array(vals)
            xs = x - 0.4 + width * (k + 0.5)
            ax.bar(xs, vals, width, color=COLORS[planner], label=LABELS[planner])
            missing += list(xs[np.isnan(vals)])
        if with_bound:
            lb = [sub[(sub.batch == d) & (sub.gpus_requested == n) & (sub.planner == "lower-bound")][value]
                  for d, n in cells]
            ax.hlines([float(v.iloc[0]) if len(v) else np.nan for v in lb], x - 0.45, x + 0.45, color="black",
                      lw=1.5, zorder=3, label=LABELS["lower-bound"])
        if log_y:
            from matplotlib.ticker import FuncFormatter
            ax.set_yscale("log")
            plain = FuncFormatter(lambda v, _: f"{v:g}")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.1g}"[0] in "25" else ""))
        if ylim:
            ax.set_ylim(*ylim)
        lo = ax.get_ylim()[0]
        ax.scatter(missing, [lo * (1.15 if log_y else 1) + (0 if log_y else 0.02 * (ax.get_ylim()[1] - lo))]
                   * len(missing), marker="x", color="gray", s=25, zorder=3, label="no plan (infeasible/skipped)")
        ax.set_xticks(x)
        ax.set_xticklabels([_cell_label(d, n) for d, n in cells], fontsize=8)
        ax.set_title(f"{model} ({int(sub.layers.iloc[0])} layers)")
        ax.set_ylabel(ylabel)
        ax.set_xlabel("minibatch D, GPUs N")
        ax.grid(axis="y", alpha=0.3, which="both" if log_y else "major")
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    fig.legend(uniq.values(), uniq.keys(), loc="lower center", ncol=len(uniq), fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())


def speedups(df: pd.DataFrame) -> pd.DataFrame:
    """Per (model, D, N): our plan and Harmony's, each in its faster mode, and ``speedup`` =
    Harmony's iteration time / ours; with what the planner reports of its plan."""
    best = best_per_cell(df)
    keys = ["model", "batch", "gpus_requested"]
    ours = best[best.planner == "cp-sat"].set_index(keys)
    harmony = best[best.planner == "harmony"].set_index(keys)
    out = ours[["mode", "gpus", "u_fwd", "u_bwd", "packs_fwd", "packs_bwd", "iteration_s", "search_s",
                *[c for c in COMPARE_SOLVER_COLUMNS if c in ours.columns]]].copy()
    out.insert(0, "harmony_mode", harmony["mode"].reindex(out.index))
    out.insert(1, "harmony_s", harmony["iteration_s"].reindex(out.index))
    out.insert(out.columns.get_loc("iteration_s") + 1, "speedup", out.harmony_s / out.iteration_s)
    return out.rename(columns={"iteration_s": "ours_s"}).reset_index()


def _spread(values: pd.Series, fmt: str = ".3f") -> str:
    v = values.dropna()
    if not len(v):
        return "n/a"
    return f"median {v.median():{fmt}} (min {v.min():{fmt}}, max {v.max():{fmt}}, {len(v)} values)"


def write_compare(df: pd.DataFrame, timelines: dict, out_dir: Path, time_limit: float,
                  baseline_budget: int, gantt_case=GANTT_CASE) -> list[Path]:
    """compare.csv/.md, the three bar-chart figures and the gpt2_xl Gantt charts."""
    out_dir = Path(out_dir)
    best = best_per_cell(df)
    cap = get_hardware(HARDWARE).gpu_memory_bytes
    skipped = df[df.status == "skipped"]
    skip_note = ("no cell was skipped" if not len(skipped) else
                 f"naive-swap and l2l were skipped in {len(skipped) // 2} cells where D x layers > "
                 f"{baseline_budget} (`--baseline-budget`)")
    sp = speedups(df)
    ours_rows = df[(df.planner == "cp-sat") & df.iteration_s.notna()]
    same_mode = ours_rows.speedup_vs_harmony if "speedup_vs_harmony" in ours_rows else pd.Series(dtype=float)
    worst = ours_rows.loc[ours_rows.solver_fidelity.idxmax()] if ours_rows.solver_fidelity.notna().any() else None
    faster = int((sp.speedup > 1.01).sum())
    intro = (f"Every planner on every shipped profile, {HARDWARE} (memory cap {cap / GiB:g} GiB per GPU), "
             f"minibatch D in {{16, 64, 256}}, N in {{1, 2, 4}} GPUs; ours (the CP-SAT planner, time limit "
             f"{time_limit:g} work seconds per search) and Harmony's search in both modes (vPP only on one GPU, "
             f"where vDP is the same), the baselines (naive-swap, l2l, zero-offload) in vDP. All plans are "
             f"judged by the same simulator (default cost model); {skip_note}. compare.csv has every row.")
    pivot = sp.assign(cell=[f"D={d} N={n}" for d, n in zip(sp.batch, sp.gpus_requested)]).pivot(
        index="model", columns="cell", values="speedup")
    order = [f"D={d} N={n}" for d in sorted(set(sp.batch)) for n in sorted(set(sp.gpus_requested))]
    pivot = pivot[[c for c in order if c in pivot.columns]].reset_index()
    speed_notes = (f"speed-up = Harmony's simulated iteration time / ours, each planner in its faster mode: "
                   f"{_spread(sp.speedup)}; ours is more than 1% faster in {faster} of {sp.speedup.notna().sum()} "
                   f"cells and slower in {int((sp.speedup < 1 - 1e-9).sum())}. "
                   f"Mode by mode (ours and Harmony's in the same mode): {_spread(same_mode)}.")
    fid = (f"{_spread(ours_rows.solver_fidelity, '.4f')}" +
           (f"; the largest is {worst.model}, D={worst.batch}, N={worst.gpus_requested}, {worst.mode_requested}"
            if worst is not None else ""))
    ours_notes = ("Ours in its faster mode per cell, next to Harmony's best (`harmony_s`, `harmony_mode`); "
                  "`search_s`: the wall time of our search, including its run of Harmony's search. "
                  + solver_notes("solver_") + f" Fidelity over every plan of ours in compare.csv (both modes): {fid}.")
    swap = best.pivot_table(index=["model", "batch", "gpus_requested"], columns="planner", values="swap_GB")

    def swap_ratio(a, b):
        return _spread(swap[a] / swap[b], ".2f") if {a, b} <= set(swap.columns) else "n/a"
    all_notes = ("`status`: ok, infeasible (the note says why), skipped, or bound (the lower bound over all "
                 "plans, harmony_opt.sim.bound: no plan can be faster). efficiency = lower bound / iteration time; "
                 "swap_GB = host->GPU + GPU->host bytes per iteration. This summary keeps the faster mode per "
                 "planner; compare.csv has both. Swap volume per cell, naive-swap / Harmony's: "
                 f"{swap_ratio('naive-swap', 'harmony')}; ours / Harmony's: {swap_ratio('cp-sat', 'harmony')} "
                 "(ours may stash activations to host instead of recomputing them, and use smaller microbatches, "
                 "where the simulator rates that faster).")
    summary = best[["model", "batch", "gpus_requested", "planner", "status", "mode", "u_fwd", "u_bwd",
                    "packs_fwd", "packs_bwd", "iteration_s", "efficiency", "swap_GB", "note"]].copy()
    summary["note"] = summary.note.fillna("").str.slice(0, 70)
    ours_cols = ["model", "batch", "gpus_requested", "harmony_mode", "harmony_s", "mode", "gpus", "u_fwd", "u_bwd",
                 "packs_fwd", "packs_bwd", "ours_s", "speedup", "search_s", "solver_found_by", "solver_fidelity",
                 "solver_gap", "solver_config_status", "solver_config_proof", "solver_config_gap",
                 "solver_timeline_gap"]
    paths = [atomic_write_text(out_dir / "compare.csv", df.to_csv(index=False))]
    text = "\n".join([
        "# Every planner on the shipped models\n", intro + "\n",
        "## Speed-up of ours over Harmony's search\n", markdown_table(pivot), speed_notes + "\n",
        "## Our planner per cell\n", markdown_table(sp[[c for c in ours_cols if c in sp.columns]]), ours_notes + "\n",
        "## Every planner\n", markdown_table(summary), all_notes + "\n",
        f"Machine: {machine_description()}\n"])
    paths.append(atomic_write_text(out_dir / "compare.md", text))
    paths.append(_grid_figure(best, "iteration_s", "iteration time (s, log)",
                              "Simulated iteration time per planner (lower is better; bar = faster mode)",
                              out_dir / "compare_iteration_time.png", log_y=True, with_bound=True))
    swap = best[best.planner != "lower-bound"].copy()
    swap.loc[swap.swap_GB <= 0, "swap_GB"] = np.nan   # log scale: a plan that swaps nothing has no bar
    paths.append(_grid_figure(swap, "swap_GB", "bytes swapped host<->GPU per iteration (GB, log)",
                              "Swap volume per planner: host->GPU + GPU->host per iteration (lower is better)",
                              out_dir / "compare_swap_volume.png", log_y=True))
    eff = best[best.planner != "lower-bound"]
    paths.append(_grid_figure(eff, "efficiency", "efficiency = lower bound / iteration time",
                              "Efficiency against the lower bound over all plans (1.0 = provably optimal)",
                              out_dir / "compare_efficiency.png", log_y=False, ylim=(0, 1.05)))
    paths += write_gantt(timelines, out_dir, gantt_case)
    return paths


def write_gantt(timelines: dict, out_dir: Path, case=GANTT_CASE) -> list[Path]:
    """Gantt + memory charts of our plan and Harmony's on one case, on one time axis."""
    model, batch, gpus, mode = case
    ours, harmony = timelines.get((model, batch, gpus, "cp-sat", mode)), timelines.get(
        (model, batch, gpus, "harmony", mode))
    if ours is None or harmony is None:
        return []
    cap = get_hardware(HARDWARE).gpu_memory_bytes
    xmax = 1.02 * max(ours.iteration_time, harmony.iteration_time)
    out = []
    for name, tl in (("ours", ours), ("harmony", harmony)):
        who = "our CP-SAT plan" if name == "ours" else "Harmony's best plan"
        out.append(tl.plot(Path(out_dir) / f"gantt_{model}_{name}.png", cap=cap, xmax=xmax,
                           title=f"{model}, D={batch}, {mode} on {gpus} GPUs: {who}, "
                                 f"{tl.iteration_time:.2f} s/iteration, "
                                 f"{tl.swap_bytes() / 1e9:.1f} GB swapped"))
    return out


# -- scaling -----------------------------------------------------------------------------------------
#: Host memory of the scaling experiments' server (and pinnable part): more than the preset's 256 GiB
SCALING_HOST_MEMORY, SCALING_PINNED_MEMORY = 2 * 2**40, 3 * 2**39


def scaling_hardware():
    """The paper's server with the host memory GPT-2 100B needs: 1.6 TiB (0.9 TiB pinned) for its
    weights, gradients, Adam state and stashed inputs (harmony_opt.sim.host_memory)."""
    return dataclasses.replace(get_hardware(HARDWARE), name=f"{HARDWARE}-2tib-host",
                               host_memory_bytes=SCALING_HOST_MEMORY, pinned_memory_bytes=SCALING_PINNED_MEMORY)


def scaling_row(name: str, time_limit: float, batch: int = TABLE1_BATCH, gpus: int = TABLE1_GPUS,
                mode: str = TABLE1_MODE, shape=None) -> dict:
    """Search time and plan quality of Harmony's search and ours on one synthetic GPT-2
    (``shape``: a :class:`~harmony_opt.measure.synthetic.GPT2Shape`, default the named one of the series)."""
    from harmony_opt.solver_models.planner import PlannerOptions, plan

    shape = shape or GPT2_SCALING[name]
    profile = gpt2_profile(shape, name=name)
    hw = scaling_hardware()
    cap = hw.gpu_memory_bytes
    R = profile.num_layers
    row = {"model": name, "params_B": shape.parameters() / 1e9, "layers": R, "batch": batch, "gpus": gpus,
           "mode": mode, "packings_log10": (R - 1) * math.log10(2)}
    t0 = time.perf_counter()
    try:
        hp = plan_harmony(profile, hw, batch, cap, mode=mode, gpus=gpus)
        row.update(harmony_configs=hp.stats.get("configs_evaluated"), harmony_time_s=hp.simulated_iteration_time_s)
    except HarmonyOptError as e:
        row.update(harmony_configs=0, harmony_time_s=float("nan"), harmony_note=str(e)[:100])
    row["harmony_search_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    op = plan(profile, hw, batch, PlannerOptions(mode=mode, gpus=gpus, time_limit=time_limit), memory_cap=cap)
    row["ours_search_s"] = time.perf_counter() - t0
    row.update(time_limit_s=time_limit, ours_search_ratio=_ratio(row["ours_search_s"], row["harmony_search_s"]),
               **plan_columns(op, "ours_"), ours_time_s=op.simulated_iteration_time_s,
               **solver_columns(op, "ours_"), lower_bound_s=_num((op.solver or {}).get("lower_bound_s")))
    row["speedup"] = _ratio(row["harmony_time_s"], row["ours_time_s"])
    row["ours_efficiency"] = _ratio(row["lower_bound_s"], row["ours_time_s"])
    return row


def scaling(time_limit: float = 35.0, models=SCALING_MODELS) -> pd.DataFrame:
    rows = []
    for name in models:
        row = scaling_row(name, time_limit)
        log.info("scaling %s (%d layers): Harmony %.1f s search, ours %.1f s search; %.2f vs %.2f s/iter",
                 name, row["layers"], row["harmony_search_s"], row["ours_search_s"], row["harmony_time_s"],
                 row["ours_time_s"])
        rows.append(row)
    return pd.DataFrame(rows)


def write_scaling(df: pd.DataFrame, out_dir: Path, time_limit: float) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out_dir = Path(out_dir)
    notes = (f"Synthetic GPT-2 profiles (n_embd 4096, 32 heads, 50 to 500 blocks; harmony_opt.measure.synthetic, "
             f"calibrated on gpt2_xl's measured profile), minibatch {TABLE1_BATCH}, {TABLE1_MODE}, "
             f"{TABLE1_GPUS} GPUs, {HARDWARE} (10 GiB cap) with {fmt_bytes(SCALING_HOST_MEMORY)} of host memory "
             f"(GPT-2 20B to 100B keep 0.3 to 1.6 TiB there: weights, gradients, Adam state, stashed inputs; "
             f"harmony_opt.sim.host_memory). Search times in seconds, measured in one process "
             f"one after the other; our search has a time limit of {time_limit:g} work seconds and includes a "
             f"run of Harmony's search (its incumbent); `ours_search_ratio` = ours_search_s / harmony_search_s. "
             f"`packings_log10`: log10 of the ways to cut the layers into contiguous packs for one phase, "
             f"2^(layers-1): what an enumeration of packings would face; Harmony walks only its few heuristics "
             f"(`harmony_configs` candidates, each costing a simulation). `speedup` = harmony_time_s / "
             f"ours_time_s; `lower_bound_s`: the bound over all plans (harmony_opt.sim.bound), `ours_efficiency` = "
             f"lower_bound_s / ours_time_s. " + solver_notes("ours_"))
    cols = ["model", "params_B", "layers", "packings_log10", "harmony_configs", "harmony_search_s",
            "harmony_time_s", "ours_search_s", "ours_search_ratio", "ours_u_fwd", "ours_u_bwd", "ours_packs_fwd",
            "ours_packs_bwd", "ours_time_s", "speedup", "ours_found_by", "ours_fidelity", "ours_gap",
            "ours_config_status", "ours_config_proof", "ours_config_gap", "ours_timeline_gap", "lower_bound_s",
            "ours_efficiency"]
    paths = write_table(df, out_dir, "scaling", "Planner search time as GPT-2 grows",
                        [Section("", cols, notes)])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    a1.plot(df.layers, df.ours_search_s, "o-", color=COLORS["cp-sat"], label=LABELS["cp-sat"])
    a1.plot(df.layers, df.harmony_search_s, "s-", color=COLORS["harmony"], label=LABELS["harmony"])
    a1.set_yscale("log")
    a1.set_xlabel("layers (GPT-2 10B to 100B parameters)")
    a1.set_ylabel("search time (s, log)")
    a1.set_title("Search time")
    a1.axhline(time_limit, color=COLORS["cp-sat"], ls=":", lw=1, label=f"our time limit ({time_limit:g} work s)")
    top = float(np.nanmax([time_limit, df.ours_search_s.max(), df.harmony_search_s.max()]))
    a1.set_ylim(top=2.5 * top)      # room for the labels above the points and the limit
    a1.grid(alpha=0.3, which="both")
    a1.legend()
    for x, y, p in zip(df.layers, df.ours_search_s, df.params_B):
        a1.annotate(f"{p:.0f}B", (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    # iteration time over the lower bound: the two planners differ by a few %, which a plot of
    # seconds (270 to 2650) would hide
    a2.plot(df.layers, df.ours_time_s / df.lower_bound_s, "o-", color=COLORS["cp-sat"], label=LABELS["cp-sat"])
    a2.plot(df.layers, df.harmony_time_s / df.lower_bound_s, "s-", color=COLORS["harmony"], label=LABELS["harmony"])
    a2.axhline(1.0, color="black", ls="--", label=f"{LABELS['lower-bound']} (no plan below 1)")
    for x, y, t in zip(df.layers, df.ours_time_s / df.lower_bound_s, df.ours_time_s):
        a2.annotate(f"{t:.0f} s", (x, y), textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
    a2.set_ylim(0.95, 1.05 * float(np.nanmax([(df.harmony_time_s / df.lower_bound_s).max(),
                                                (df.ours_time_s / df.lower_bound_s).max()])))
    a2.set_xlabel("layers (GPT-2 10B to 100B parameters)")
    a2.set_ylabel("simulated iteration time / lower bound (ratio)")
    a2.set_title(f"Plan quality (D={TABLE1_BATCH}, {TABLE1_MODE}, {TABLE1_GPUS} GPUs; labels: ours, s/iteration)")
    a2.grid(alpha=0.3)
    a2.legend()
    fig.suptitle("Scaling: synthetic GPT-2 profiles on 4 x 1080 Ti (10 GiB cap)")
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "scaling.png"))
    return paths


# -- beyond one server (docs/scaling.md) -------------------------------------------------------------------
#: 25 Gb/s Ethernet between the servers, bytes/s
INTER_SERVER_25GBE = 25e9 / 8


def two_server_hardware() -> dict:
    """One paper server, and two of them as one 8-GPU Hardware: each server's PCIe switch adds a host
    link (two transfers per direction at once), GPU<->GPU traffic at PCIe P2P speed (optimistic: as
    if every pair were in one server) or at 25 GbE speed (pessimistic: as if every pair crossed servers).
    The simulator has one GPU<->GPU bandwidth, so these two bracket a real 4 + 4 split."""
    one = get_hardware(HARDWARE)
    two = dataclasses.replace(one, gpus=8, link_bandwidth=2 * one.link_bandwidth,
                              host_memory_bytes=2 * one.host_memory_bytes,
                              pinned_memory_bytes=2 * one.pinned_memory_bytes)
    return {"1 server, 4 GPUs": one,
            "2 servers, 8 GPUs, P2P 8.2 GiB/s everywhere": dataclasses.replace(two, name="2x1080ti-x4-p2p"),
            "2 servers, 8 GPUs, 25 GbE everywhere": dataclasses.replace(two, name="2x1080ti-x4-25gbe",
                                                                      p2p_bandwidth=INTER_SERVER_25GBE)}


def two_servers(time_limit: float = 10.0, model: str = "gpt2_xl", batch: int = TABLE1_BATCH) -> pd.DataFrame:
    """Harmony's search (vPP and vDP) and ours on one server and on two, all simulated."""
    from harmony_opt.solver_models.planner import PlannerOptions, plan

    profile = load_profile(model)
    rows = []
    for label, hw in two_server_hardware().items():
        cap = hw.gpu_memory_bytes
        lb = lower_bound(profile, hw, batch, cap)["bound_s"]
        runs = [(f"harmony {m}", plan_harmony, {"mode": m, "gpus": hw.gpus}) for m in ("vPP", "vDP")]
        runs.append(("ours", plan, {"options": PlannerOptions(mode="auto", gpus=hw.gpus, time_limit=time_limit),
                                    "memory_cap": cap}))
        for name, planner, kw in runs:
            t0 = time.perf_counter()
            try:
                p = planner(profile, hw, batch, **kw) if planner is plan else planner(profile, hw, batch, cap, **kw)
            except HarmonyOptError as e:
                rows.append({"hardware": label, "planner": name, "note": str(e)[:80]})
                continue
            search = time.perf_counter() - t0
            tl = simulate(p, profile, hw)
            moved = tl.bytes_moved()
            rows.append({"hardware": label, "planner": name, **plan_columns(p, ""), "iteration_s": tl.iteration_time,
                         "samples_per_s": batch / tl.iteration_time, "swap_GB": (moved["h2d"] + moved["d2h"]) / 1e9,
                         "p2p_GB": moved["p2p"] / 1e9, "lower_bound_s": lb, "efficiency": lb / tl.iteration_time,
                         "search_s": search, **(solver_columns(p, "solver_") if p.solver else {})})
        log.info("two servers: %s done", label)
    return pd.DataFrame(rows)


def write_two_servers(df: pd.DataFrame, out_dir: Path, time_limit: float) -> list[Path]:
    notes = ("gpt2_xl, minibatch 64, memory cap 10 GiB per GPU, simulated with the default cost model. Two "
             "servers are one 8-GPU Hardware whose shared host link carries two transfers per direction (one per "
             "server's PCIe switch); GPU<->GPU traffic (vPP activations, vDP all-reduce) runs at one bandwidth "
             "for every pair, so the two variants bracket a real 4 + 4 split: PCIe P2P speed for every pair "
             "(optimistic) and 25 Gb/s Ethernet for every pair (pessimistic). Harmony's search in vPP and in vDP "
             "on every GPU; ours: the CP-SAT planner on every GPU, mode chosen, time limit "
             f"{time_limit:g} work seconds (its search includes Harmony's in both modes, its incumbent). "
             "swap_GB: host->GPU + GPU->host bytes per iteration; p2p_GB: GPU<->GPU bytes; efficiency = "
             "lower_bound_s / iteration_s. " + solver_notes("solver_") + " See docs/scaling.md for what this "
             "does not model.")
    cols = ["hardware", "planner", "mode", "gpus", "u_fwd", "u_bwd", "packs_fwd", "packs_bwd", "iteration_s",
            "samples_per_s", "swap_GB", "p2p_GB", "lower_bound_s", "efficiency", "search_s", "solver_fidelity",
            "solver_gap", "solver_config_status", "solver_config_proof", "solver_timeline_gap", "note"]
    return write_table(df, out_dir, "two_servers", "Beyond one server: two simulated 4-GPU servers",
                       [Section("", cols, notes)])
