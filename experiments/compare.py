"""Every planner on every shipped profile: a grid of minibatch sizes and GPU counts.

    python -m experiments compare [--time-limit S] [--models M,...] [--batches 16,64] [--gpus 1,2] [--jobs N]

The grid may run in parallel worker processes (``jobs``): it reports plan quality, not search time.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd

from harmony_opt.commands.planning import compare_table
from harmony_opt.core.bundled import bundled_names, load_profile
from harmony_opt.core.hardware import get_hardware
from harmony_opt.core.io import atomic_write_text
from harmony_opt.core.units import GiB
from harmony_opt.planners.registry import PLANNERS as REGISTRY
from harmony_opt.report import machine_description, markdown_table

from .common import COLORS, HARDWARE, LABELS, PLANNERS, save_figure, solver_columns, solver_notes

log = logging.getLogger("experiments.compare")

COMPARE_BATCHES = (16, 64, 256)
COMPARE_GPUS = (1, 2, 4)
#: the planners run once per mode of a cell (ours searches within the mode asked for, Harmony's plans in
#: it); the others always plan in vDP and run once per cell
SEARCHES = tuple(n for n, e in REGISTRY.items() if e.takes_mode)
#: naive-swap and l2l simulate every microbatch size they can run; ``--baseline-budget B`` skips them
#: where minibatch x layers > B. 0 (the default): never. Since the simulator's rewrite the heaviest
#: cell of the grid (vgg416, D = 256, 4 GPUs) takes about 20 s for both, so no cell is skipped.
BASELINE_BUDGET = 0
GANTT_CASE = ("gpt2_xl", 64, 4, "vPP")


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
                                  planners=SEARCHES)
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
    run = [p for p in REGISTRY if p not in SEARCHES and not (heavy and p in layerwise)]
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
    return save_figure(fig, path)


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

    def swapratio(a, b):
        return _spread(swap[a] / swap[b], ".2f") if {a, b} <= set(swap.columns) else "n/a"
    all_notes = ("`status`: ok, infeasible (the note says why), skipped, or bound (the lower bound over all "
                 "plans, harmony_opt.sim.bound: no plan can be faster). efficiency = lower bound / iteration time; "
                 "swap_GB = host->GPU + GPU->host bytes per iteration. This summary keeps the faster mode per "
                 "planner; compare.csv has both. Swap volume per cell, naive-swap / Harmony's: "
                 f"{swapratio('naive-swap', 'harmony')}; ours / Harmony's: {swapratio('cp-sat', 'harmony')} "
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


if __name__ == "__main__":
    import sys

    from .cli import main
    sys.exit(main(["compare", *sys.argv[1:]]))
