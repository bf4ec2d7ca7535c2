"""One exception hierarchy for the whole library.

Every error a user can cause derives from :class:`HarmonyOptError`; the CLI turns
each into one line on stderr and exit code 2. Anything else escaping is a bug
(exit code 1). Messages say what was wrong, where, and what to do.
"""
from __future__ import annotations


def first_line(e: BaseException) -> str:
    """``Type: first line of its message``: another library's or the user's code's error, shown in
    one of ours."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


class HarmonyOptError(Exception):
    """Base class of every error caused by the user's input or request."""


class UsageError(HarmonyOptError):
    """A command-line argument or API argument is malformed."""


class UnsupportedModelError(UsageError):
    """A model whose layout the decomposer does not know (it names what it looked for and did not find)."""


class ProfileError(HarmonyOptError):
    """A profile folder or table is missing, malformed or inconsistent."""


class HardwareError(HarmonyOptError):
    """A hardware preset or file is unknown, malformed or physically impossible."""


class PlanError(HarmonyOptError):
    """A plan is malformed, or does not fit the profile, hardware or model it is used with."""


class InfeasibleError(HarmonyOptError):
    """No plan exists for the request; ``explanation`` names the smallest piece that fails."""

    def __init__(self, message: str, *, layer: int | None = None, microbatch: int | None = None,
                 needed_bytes: int | None = None, cap_bytes: int | None = None):
        super().__init__(message)
        self.layer = layer
        self.microbatch = microbatch
        self.needed_bytes = needed_bytes
        self.cap_bytes = cap_bytes

    @property
    def explanation(self) -> str:
        return str(self)


class ProgramError(HarmonyOptError):
    """A compiled program is invalid: a tensor used before it arrives, a send without receive, ..."""


class RuntimeMemoryError(HarmonyOptError):
    """The executor's memory guard stopped an instruction that would exceed the device cap."""


class ContractError(HarmonyOptError, AssertionError):
    """A planner broke the contract :mod:`harmony_opt.fuzzing` checks: a bug in the planner, not in
    the input. Raised explicitly so that ``python -O`` keeps the checks; also an ``AssertionError``,
    so code that treats a broken promise as a failed assertion keeps working."""


class DistributedError(HarmonyOptError):
    """Under torchrun: the process group could not be joined, or another rank died or stopped
    answering within the timeout (that rank's own output says why)."""


class DataError(HarmonyOptError):
    """Training data or a checkpoint does not match the model or plan."""


class OutputError(HarmonyOptError, OSError):
    """A file could not be written where the user asked (``errno`` is the system's); also an
    ``OSError``, so code that handles failed writes in general keeps working."""

    def __str__(self):
        return self.strerror or super().__str__()
