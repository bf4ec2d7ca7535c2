"""harmony-opt: plan and run swap schedules for models larger than GPU memory.

The pipeline (docs/design.md): a Profile and a Hardware go into a planner, which
returns a Plan; the simulator scores any Plan as a Timeline; the compiler lowers a
Plan to a Program that the runtime executes.
"""
from .core.errors import (DataError, HardwareError, HarmonyOptError, InfeasibleError, PlanError, ProfileError,
                     ProgramError, RuntimeMemoryError, UnsupportedModelError, UsageError)
from .core.hardware import PRESETS, Hardware, get_hardware
from .core.plan import PackOptions, Plan
from .core.profile import PhaseCosts, Profile
from .core.bundled import bundled_names, load_profile

__version__ = "0.1.0"

__all__ = [
    "DataError", "HardwareError", "HarmonyOptError", "InfeasibleError", "PlanError", "ProfileError",
    "ProgramError", "RuntimeMemoryError", "UnsupportedModelError", "UsageError", "PRESETS", "Hardware",
    "get_hardware", "PackOptions", "Plan", "PhaseCosts", "Profile", "bundled_names", "load_profile",
]

# The runtime side imports torch (about a second): loaded on first use, so that planning,
# simulating and the other torch-free commands start fast.
_LAZY = {"compile_plan": "compile.compiler", "Program": "compile.program", "validate_program": "compile.validate",
         "TrainResult": "training", "train": "training", "decompose_hf": "measure.hf",
         "LayeredModel": "measure.decompose", "decompose": "measure.decompose", "profile_model": "measure.profiler",
         "plan": "solver_models.planner", "PlannerOptions": "solver_models.options", "simulate": "sim.simulator"}
__all__ += list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
