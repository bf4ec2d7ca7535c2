"""What the experiments share: the paper's server and settings, planner labels and colours, the
columns every table takes from a plan and from ``plan.solver``, and writing tables and figures."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pandas as pd

from harmony_opt.core.io import atomic_write_figure, atomic_write_text
from harmony_opt.core.units import GiB
from harmony_opt.planners.registry import PLANNERS as REGISTRY
from harmony_opt.report import machine_description, markdown_table

#: where the experiments write by default (``--out`` changes it)
RESULTS_DIR = Path(__file__).resolve().parent / "results"
HARDWARE = "1080ti-x4"

#: Table 1 of the paper: (model, memory cap in bytes), D = 64, vPP, 4 GPUs (run_four_models__tab1.sh);
#: the scaling experiment keeps the same minibatch, mode and GPUs, the servers experiment the minibatch and caps
TABLE1_CASES = (("bert_96", int(9e9)), ("gpt2_xl", int(9e9)), ("vgg416", 10 * GiB), ("resnet1026", 10 * GiB))
TABLE1_BATCH, TABLE1_GPUS, TABLE1_MODE = 64, 4, "vPP"

#: Planners in the order of every table and legend: the registry's, "cp-sat" (ours) first
PLANNERS = tuple(REGISTRY)
LABELS = {"cp-sat": "ours (CP-SAT)", "harmony": "Harmony's search", "naive-swap": "naive swap (per microbatch)",
          "l2l": "L2L", "zero-offload": "ZeRO-Offload-like", "lower-bound": "lower bound"}
COLORS = {"cp-sat": "tab:blue", "harmony": "tab:orange", "naive-swap": "tab:red", "l2l": "tab:purple",
          "zero-offload": "tab:green", "lower-bound": "black"}


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


def save_figure(fig, path: Path) -> Path:
    """Write a matplotlib figure as PNG in one step (no half-written file) and close it."""
    return atomic_write_figure(path, fig, dpi=100)


def num(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else float("nan")


def ratio(a, b) -> float:
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
        "model_s": num(s.get("objective")), "fidelity": num(s.get("fidelity")),
        "bound_s": num(s.get("bound")), "gap": num(s.get("gap")),
        "config_status": conf.get("status", s.get("status")), "config_proof": conf.get("proof") or "none",
        "config_gap": num(conf.get("gap")),
        "timeline_status": tl.get("status", "not run"), "timeline_gap": num(tl.get("gap")),
        "configs": s.get("configurations"), "configs_evaluated": s.get("evaluated"),
    }.items()}


def plan_columns(p, prefix: str) -> dict:
    """A plan's shape: mode, GPUs, microbatch sizes, number of packs."""
    return {f"{prefix}mode": p.mode, f"{prefix}gpus": p.gpus, f"{prefix}u_fwd": p.microbatch_fwd,
            f"{prefix}u_bwd": p.microbatch_bwd, f"{prefix}packs_fwd": len(p.packs_fwd),
            f"{prefix}packs_bwd": len(p.packs_bwd)}


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
