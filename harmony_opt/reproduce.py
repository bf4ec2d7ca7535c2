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

from .bundled import bundled_names, load_profile
from .errors import HarmonyOptError
from .hardware import get_hardware
from .io import atomic_write_text
from .units import GiB

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
#: naive-swap and l2l simulate every sample through every layer at every microbatch size; the
#: simulator needs about 2-6 ms per (sample x layer), so cells above this many are not run by default.
BASELINE_BUDGET = 40_000
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


def write_table(df: pd.DataFrame, out_dir: Path, stem: str, title: str, notes: str = "",
                md_columns: list[str] | None = None) -> list[Path]:
    """``stem.csv`` (every column, full precision) and ``stem.md`` (a readable selection)."""
    out_dir = Path(out_dir)
    csv = atomic_write_text(out_dir / f"{stem}.csv", df.to_csv(index=False))
    shown = df[md_columns] if md_columns else df
    text = f"# {title}\n\n{markdown_table(shown)}\n{notes.strip()}\n\nMachine: {machine_description()}\n"
    md = atomic_write_text(out_dir / f"{stem}.md", text)
    return [csv, md]


def _solver_value(plan, key):
    v = (plan.solver or {}).get(key)
    return float(v) if isinstance(v, (int, float)) and v is not None else float("nan")


def _ratio(a, b) -> float:
    return a / b if a and b and math.isfinite(a) and math.isfinite(b) else float("nan")


# -- Table 1 -----------------------------------------------------------------------------------------
def table1_row(model: str, cap: int, time_limit: float, batch: int = TABLE1_BATCH, gpus: int = TABLE1_GPUS,
               mode: str = TABLE1_MODE) -> dict:
    """Harmony's search and ours on one Table 1 case, in this process, one after the other.

    Harmony's candidates are judged by our simulator (as are ours), so the speed-up compares
    plans under one cost model; ``harmony_own_model_s`` is what Harmony's own simulator says of
    its best candidate, for comparison with the paper."""
    from solver_models.planner import PlannerOptions, plan

    from .baselines import plan_harmony
    from .harmony_compat import harmony_search
    profile = load_profile(model)
    hw = get_hardware(HARDWARE, memory_cap=cap)
    t0 = time.perf_counter()
    hp = plan_harmony(profile, hw, batch, cap, mode=mode, gpus=gpus)
    h_search = time.perf_counter() - t0
    own = harmony_search(profile, batch, gpus, mode, cap, packing_fwd="published", packing_bwd="published",
                         topk=1, rank_fit_normally=True)
    t0 = time.perf_counter()
    op = plan(profile, hw, batch, PlannerOptions(mode=mode, gpus=gpus, time_limit=time_limit), memory_cap=cap)
    o_search = time.perf_counter() - t0
    h_t, o_t = hp.simulated_iteration_time_s, op.simulated_iteration_time_s
    lb = _solver_value(op, "lower_bound_s")
    return {
        "model": model, "layers": profile.num_layers, "batch": batch, "gpus": gpus, "mode": mode,
        "cap_bytes": int(cap),
        "harmony_space": hp.stats.get("search_space"), "harmony_configs": hp.stats.get("configs_evaluated"),
        "harmony_search_s": h_search,
        "harmony_u_fwd": hp.microbatch_fwd, "harmony_u_bwd": hp.microbatch_bwd,
        "harmony_packs_fwd": len(hp.packs_fwd), "harmony_packs_bwd": len(hp.packs_bwd),
        "harmony_methods": f"{hp.stats.get('method_fwd') or '-'}/{hp.stats.get('method_bwd')}",
        "harmony_time_s": h_t, "harmony_own_model_s": own.best.time,
        "ours_search_s": o_search, "ours_mode": op.mode,
        "ours_u_fwd": op.microbatch_fwd, "ours_u_bwd": op.microbatch_bwd,
        "ours_packs_fwd": len(op.packs_fwd), "ours_packs_bwd": len(op.packs_bwd),
        "ours_status": (op.solver or {}).get("status"), "ours_objective_s": _solver_value(op, "objective"),
        "ours_bound_s": _solver_value(op, "bound"), "ours_gap": _solver_value(op, "gap"),
        "ours_time_s": o_t, "lower_bound_s": lb, "ours_efficiency": _ratio(lb, o_t),
        "speedup": _ratio(h_t, o_t),
    }


def table1(time_limit: float = 20.0, models: list[str] | None = None) -> pd.DataFrame:
    """Table 1: one row per model (see :func:`table1_row`)."""
    rows = []
    for model, cap in TABLE1_CASES:
        if models and model not in models:
            continue
        row = table1_row(model, cap, time_limit)
        log.info("table1 %s: Harmony %.3f s/iter (%d configs, %.2f s search); ours %.3f s/iter (%s, %.2f s "
                 "search); speed-up %.3fx", model, row["harmony_time_s"], row["harmony_configs"],
                 row["harmony_search_s"], row["ours_time_s"], row["ours_status"], row["ours_search_s"],
                 row["speedup"])
        rows.append(row)
    return pd.DataFrame(rows)


TABLE1_MD = ["model", "layers", "harmony_space", "harmony_configs", "harmony_search_s", "harmony_u_fwd",
             "harmony_u_bwd", "harmony_packs_fwd", "harmony_packs_bwd", "harmony_time_s", "harmony_own_model_s",
             "ours_search_s", "ours_u_fwd", "ours_u_bwd", "ours_packs_fwd", "ours_packs_bwd", "ours_status",
             "ours_time_s", "ours_bound_s", "ours_gap", "lower_bound_s", "speedup"]


def write_table1(df: pd.DataFrame, out_dir: Path, time_limit: float) -> list[Path]:
    notes = (f"Settings of the paper's Table 1: minibatch {TABLE1_BATCH}, {TABLE1_MODE}, {TABLE1_GPUS} GPUs "
             f"({HARDWARE}), memory cap 9e9 bytes (bert_96, gpt2_xl) or 10 GiB (vgg416, resnet1026). "
             "Harmony: its search with its published packing methods (forward balanced-by-time and reuse, "
             "backward balanced-by-time), every candidate judged by our simulator; `harmony_space` is the grid "
             "it walks, `harmony_configs` the valid candidates it scores, `harmony_own_model_s` its best "
             "candidate's time in Harmony's own simulator. Ours: the CP-SAT planner (time limit "
             f"{time_limit:g} s; its search time includes Harmony's search, its warm start), scored by the same "
             "simulator. `ours_bound_s`/`ours_gap`: CP-SAT's proven bound and relative gap on the chosen "
             "configuration's objective; `lower_bound_s`: the bound over all plans (harmony_opt.bound). "
             "`speedup` = harmony_time_s / ours_time_s. Times in seconds; both searches ran in one process "
             "on one machine.")
    return write_table(df, out_dir, "table1", "Table 1: Harmony's schedule search vs the CP-SAT planner", notes,
                       TABLE1_MD)


# -- compare: every planner on the shipped models -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CompareCell:
    """One (model, minibatch, GPUs) cell of the grid; both modes where they differ (N > 1)."""

    model: str
    batch: int
    gpus: int
    time_limit: float = 3.0
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
    from .commands.planning import compare_table
    profile = load_profile(cell.model)
    hw = get_hardware(HARDWARE, gpus=cell.gpus)
    t0 = time.perf_counter()
    frames, timelines = [], {}
    for mode in cell.modes:
        df, plans = compare_table(profile, hw, cell.batch, mode, cell.gpus, cell.time_limit,
                                  planners=("cp-sat", "harmony"))
        frames.append(df.assign(mode_requested=mode))
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
                                             f"budget {cell.baseline_budget} (simulation would take minutes)"}
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
            "peak_GiB_per_gpu", "search_s", "note"]
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

    from .io import atomic_write_bytes
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())


def write_compare(df: pd.DataFrame, timelines: dict, out_dir: Path, time_limit: float,
                  baseline_budget: int, gantt_case=GANTT_CASE) -> list[Path]:
    """compare.csv/.md, the three bar-chart figures and the gpt2_xl Gantt charts."""
    out_dir = Path(out_dir)
    best = best_per_cell(df)
    cap = get_hardware(HARDWARE).gpu_memory_bytes
    notes = (f"Every planner on every shipped profile, {HARDWARE} (memory cap {cap / GiB:g} GiB per GPU), "
             f"minibatch D in {{16, 64, 256}}, N in {{1, 2, 4}} GPUs; ours and Harmony's search in both modes "
             f"(vPP only on one GPU, where vDP is the same), the baselines in vDP. All plans are judged by the "
             f"same simulator (default cost model). CP-SAT time limit {time_limit:g} s per case. naive-swap and "
             f"l2l are skipped where D x layers > {baseline_budget} (their exhaustive microbatch-size search "
             f"would take minutes of simulation per case); `status` says ok, infeasible (the note says why), "
             f"skipped, or bound (the lower bound over all plans). efficiency = lower bound / iteration time. "
             f"This summary keeps the faster mode per planner; compare.csv has every row.")
    summary = best[["model", "batch", "gpus_requested", "planner", "status", "mode", "u_fwd", "u_bwd",
                    "packs_fwd", "packs_bwd", "iteration_s", "efficiency", "swap_GB", "note"]].copy()
    summary["note"] = summary.note.fillna("").str.slice(0, 70)
    paths = [atomic_write_text(out_dir / "compare.csv", df.to_csv(index=False))]
    text = (f"# Every planner on the shipped models\n\n{notes}\n\n{markdown_table(summary)}\n"
            f"Machine: {machine_description()}\n")
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
def scaling_row(name: str, time_limit: float, batch: int = TABLE1_BATCH, gpus: int = TABLE1_GPUS,
                mode: str = TABLE1_MODE) -> dict:
    """Search time and plan quality of Harmony's search and ours on one synthetic GPT-2."""
    from solver_models.planner import PlannerOptions, plan

    from .baselines import plan_harmony
    from .synthetic import GPT2_SCALING, gpt2_profile
    shape = GPT2_SCALING[name]
    profile = gpt2_profile(shape, name=name)
    hw = get_hardware(HARDWARE)
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
    row.update(time_limit_s=time_limit, ours_status=(op.solver or {}).get("status"),
               ours_u_fwd=op.microbatch_fwd, ours_u_bwd=op.microbatch_bwd, ours_packs_fwd=len(op.packs_fwd),
               ours_packs_bwd=len(op.packs_bwd), ours_time_s=op.simulated_iteration_time_s,
               ours_gap=_solver_value(op, "gap"), lower_bound_s=_solver_value(op, "lower_bound_s"))
    row["speedup"] = _ratio(row["harmony_time_s"], row["ours_time_s"])
    return row


def scaling(time_limit: float = 20.0, models=SCALING_MODELS) -> pd.DataFrame:
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
    notes = (f"Synthetic GPT-2 profiles (n_embd 4096, 32 heads, 50 to 500 blocks; harmony_opt.synthetic, "
             f"calibrated on gpt2_xl's measured profile), minibatch {TABLE1_BATCH}, {TABLE1_MODE}, "
             f"{TABLE1_GPUS} GPUs, {HARDWARE} (10 GiB cap). Search times in seconds, measured in one process "
             f"one after the other; our search includes Harmony's (its warm start) and has a time limit of "
             f"{time_limit:g} s for the solver. `packings_log10`: log10 of the ways to cut the layers into "
             f"contiguous packs for one phase, 2^(layers-1): what an enumeration of packings would face; "
             f"Harmony walks only its few heuristics, and each candidate costs a simulation.")
    cols = ["model", "params_B", "layers", "packings_log10", "harmony_configs", "harmony_search_s",
            "harmony_time_s", "ours_search_s", "ours_status", "ours_u_fwd", "ours_u_bwd", "ours_packs_fwd",
            "ours_packs_bwd", "ours_time_s", "ours_gap", "lower_bound_s", "speedup"]
    paths = write_table(df, out_dir, "scaling", "Planner search time as GPT-2 grows", notes,
                        [c for c in cols if c in df.columns])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    a1.plot(df.layers, df.ours_search_s, "o-", color=COLORS["cp-sat"], label=LABELS["cp-sat"])
    a1.plot(df.layers, df.harmony_search_s, "s-", color=COLORS["harmony"], label=LABELS["harmony"])
    a1.set_yscale("log")
    a1.set_xlabel("layers (GPT-2 10B to 100B parameters)")
    a1.set_ylabel("search time (s, log)")
    a1.set_title("Search time")
    a1.grid(alpha=0.3, which="both")
    a1.legend()
    for x, y, p in zip(df.layers, df.ours_search_s, df.params_B):
        a1.annotate(f"{p:.0f}B", (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    a2.plot(df.layers, df.ours_time_s, "o-", color=COLORS["cp-sat"], label=LABELS["cp-sat"])
    a2.plot(df.layers, df.harmony_time_s, "s-", color=COLORS["harmony"], label=LABELS["harmony"])
    a2.plot(df.layers, df.lower_bound_s, "k--", label=LABELS["lower-bound"])
    a2.set_xlabel("layers (GPT-2 10B to 100B parameters)")
    a2.set_ylabel("simulated iteration time (s)")
    a2.set_title(f"Plan quality (D={TABLE1_BATCH}, {TABLE1_MODE}, {TABLE1_GPUS} GPUs)")
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


def two_servers(time_limit: float = 5.0, model: str = "gpt2_xl", batch: int = TABLE1_BATCH) -> pd.DataFrame:
    """Harmony's search (vPP and vDP) and ours on one server and on two, all simulated."""
    from solver_models.planner import PlannerOptions, plan

    from .baselines import plan_harmony
    from .bound import lower_bound
    from .simulator import simulate
    profile = load_profile(model)
    rows = []
    for label, hw in two_server_hardware().items():
        cap = hw.gpu_memory_bytes
        lb = lower_bound(profile, hw, batch, cap)["bound_s"]
        runs = [(f"harmony {m}", lambda m=m: plan_harmony(profile, hw, batch, cap, mode=m, gpus=hw.gpus))
                for m in ("vPP", "vDP")]
        runs.append(("ours", lambda: plan(profile, hw, batch, PlannerOptions(mode="auto", gpus=hw.gpus,
                                                                              time_limit=time_limit))))
        for name, run in runs:
            try:
                p = run()
            except HarmonyOptError as e:
                rows.append({"hardware": label, "planner": name, "note": str(e)[:80]})
                continue
            tl = simulate(p, profile, hw)
            moved = tl.bytes_moved()
            rows.append({"hardware": label, "planner": name, "mode": p.mode, "gpus": p.gpus,
                         "u_fwd": p.microbatch_fwd, "u_bwd": p.microbatch_bwd, "packs_fwd": len(p.packs_fwd),
                         "packs_bwd": len(p.packs_bwd), "iteration_s": tl.iteration_time,
                         "samples_per_s": batch / tl.iteration_time, "swap_GB": (moved["h2d"] + moved["d2h"]) / 1e9,
                         "p2p_GB": moved["p2p"] / 1e9, "lower_bound_s": lb, "efficiency": lb / tl.iteration_time})
        log.info("two servers: %s done", label)
    return pd.DataFrame(rows)


def write_two_servers(df: pd.DataFrame, out_dir: Path, time_limit: float) -> list[Path]:
    notes = ("gpt2_xl, minibatch 64, memory cap 10 GiB per GPU, simulated with the default cost model. Two "
             "servers are one 8-GPU Hardware whose shared host link carries two transfers per direction (one per "
             "server's PCIe switch); GPU<->GPU traffic (vPP activations, vDP all-reduce) runs at one bandwidth "
             "for every pair, so the two rows bracket a real 4 + 4 split: PCIe P2P speed for every pair "
             "(optimistic) and 25 Gb/s Ethernet for every pair (pessimistic). Ours: CP-SAT planner, mode "
             f"chosen, time limit {time_limit:g} s. See docs/scaling.md for what this does not model.")
    return write_table(df, out_dir, "two_servers", "Beyond one server: two simulated 4-GPU servers", notes)
