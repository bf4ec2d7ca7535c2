"""harmony-opt: plan and run swap schedules for models larger than GPU memory.

The pipeline (docs/design.md): a Profile and a Hardware go into a planner, which
returns a Plan; the simulator scores any Plan as a Timeline; the compiler lowers a
Plan to a Program that the runtime executes.
"""
from .errors import (DataError, HardwareError, HarmonyOptError, InfeasibleError, PlanError, ProfileError,
                     ProgramError, RuntimeMemoryError, UsageError)
from .hardware import PRESETS, Hardware, get_hardware
from .plan import PackOptions, Plan
from .profile import PhaseCosts, Profile
from .bundled import bundled_names, load_profile

__version__ = "0.1.0"

__all__ = [
    "DataError", "HardwareError", "HarmonyOptError", "InfeasibleError", "PlanError", "ProfileError",
    "ProgramError", "RuntimeMemoryError", "UsageError", "PRESETS", "Hardware", "get_hardware",
    "PackOptions", "Plan", "PhaseCosts", "Profile", "bundled_names", "load_profile",
]

from .compiler import compile_plan  # noqa: E402
from .program import Program, validate_program  # noqa: E402
from .train import TrainResult, train  # noqa: E402

__all__ += ["compile_plan", "Program", "validate_program", "TrainResult", "train"]
