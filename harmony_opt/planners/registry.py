"""Every planner by name, ours (cp-sat) first, behind one calling convention.

    planner = get_planner("cp-sat")
    plan = planner(profile, hw, batch, cap, gpus=None, **options)

so the CLI, the fuzzer, the experiments and the benchmarks name a planner instead of
special-casing ours. ``options`` are the planner's own: for cp-sat the fields of
``PlannerOptions`` (mode, time_limit, processes, seed, workers, ...), for harmony ``mode``,
``cost_model`` and its packers; the layer-wise baselines take none.

Why entries are "module:function" strings: the CP-SAT planner lives in solver_models, a layer
above this one (tests/test_layers.py), so this table may not import it; the string is resolved
with importlib on first use, as an entry point is. Every planner's plan is held to the live bytes
of its compiled program: the baselines are wrapped in ``fit_to_program`` here, ours does it
itself (``fits_itself``).
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

from ..compile.program_memory import fit_to_program
from ..core.errors import UsageError
from ..core.plan import Plan


@dataclasses.dataclass(frozen=True)
class PlannerEntry:
    """One planner: its name, where its function lives, what it does and how it treats the mode.

    ``modes``: "auto" where one run searches vPP and vDP itself (a ``mode`` option may pin one),
    "per-mode" where a run plans in the one ``mode`` it is given (one run per mode to compare
    both), "vDP" where the planner always plans in that mode and takes no ``mode``."""

    name: str
    target: str                 # "module:function", resolved on first use
    description: str
    modes: str
    fits_itself: bool = False   # the function already holds its plan to the compiled program's memory

    def load(self) -> Callable[..., Plan]:
        """The function ``target`` names (imported on first use)."""
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)

    @property
    def takes_mode(self) -> bool:
        return self.modes != "vDP"


_ENTRIES = (
    PlannerEntry("cp-sat", "harmony_opt.solver_models.planner:plan_under_cap",
                 "ours, CP-SAT over mode, GPUs, microbatch sizes, packs and per-pack options, with a bound",
                 "auto", fits_itself=True),
    PlannerEntry("harmony", "harmony_opt.planners.baselines:plan_harmony",
                 "Harmony's search over every microbatch-size pair x its packing heuristics, in one mode",
                 "per-mode"),
    PlannerEntry("naive-swap", "harmony_opt.planners.baselines:plan_naive_swap",
                 "per-microbatch swapping as vDNN and LMS do, every layer's weights in and out per microbatch",
                 "vDP"),
    PlannerEntry("l2l", "harmony_opt.planners.baselines:plan_l2l",
                 "layer-to-layer, one layer resident at a time, optimizer on the CPU", "vDP"),
    PlannerEntry("zero-offload", "harmony_opt.planners.baselines:plan_zero_offload",
                 "all weights resident, gradients and optimizer on the CPU; infeasible when they do not fit",
                 "vDP"),
)

#: name -> entry, in the order of every table and legend (ours first)
PLANNERS: dict[str, PlannerEntry] = {e.name: e for e in _ENTRIES}
#: the baselines every comparison includes: every planner but ours
BASELINES: tuple[str, ...] = tuple(n for n in PLANNERS if n != "cp-sat")


def planner_entry(name: str) -> PlannerEntry:
    """The entry of ``name`` (case and ``_``/``-`` insensitive); UsageError naming the valid ones."""
    key = str(name).lower().replace("_", "-")
    if key not in PLANNERS:
        raise UsageError(f"unknown planner {name!r}; valid: {', '.join(PLANNERS)}")
    return PLANNERS[key]


def get_planner(name: str) -> Callable[..., Plan]:
    """``planner(profile, hw, batch, cap, *, gpus=None, **options) -> Plan`` for ``name``; its
    plan's compiled program fits ``cap`` (harmony_opt.compile.program_memory.fit_to_program)."""
    entry = planner_entry(name)
    make = entry.load()
    if entry.fits_itself:
        return make

    def planner(profile, hw, batch, cap, *, gpus=None, **options):
        return fit_to_program(lambda c: make(profile, hw, batch, c, gpus=gpus, **options), int(cap), profile,
                              who=f"{entry.name}'s plan of {profile.name}")
    return planner


__all__ = ["PlannerEntry", "PLANNERS", "BASELINES", "planner_entry", "get_planner"]
