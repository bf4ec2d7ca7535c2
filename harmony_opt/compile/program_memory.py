"""The device memory a plan really takes: what its compiled Program keeps live on each rank.

Instruction by instruction in issue order, the caching allocator reserves a tensor when the
instruction that makes it is issued and reuses it once it is freed. What each instruction
allocates and frees is :func:`harmony_opt.compile.program.effects`, the sizes a :class:`LayerBytes`;
the compiler's validator and the executor's memory guard count exactly this. Pack memory
(:mod:`harmony_opt.core.memory`) is the model the planners search with; every plan they return
is checked by :func:`program_memory` with the profile's sizes (which ``harmony-opt profile``
measures as the runtime sees them), so a returned plan is not refused at run time by the guard.
"""
from __future__ import annotations

import dataclasses

from ..core.errors import InfeasibleError, PlanError
from ..core.plan import Plan
from ..core.profile import Profile
from ..core.units import fmt_bytes
from .compiler import issue_order
from .program import LayerBytes, replay_memory


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Peak live device bytes per rank, and the first instruction over the cap (None if none)."""

    peaks: tuple[int, ...]
    cap: int
    over: tuple[int, str, int] | None = None      # (rank, instruction, bytes it would hold)

    @property
    def fits(self) -> bool:
        return self.over is None


def layer_bytes(plan: Plan, profile: Profile) -> LayerBytes:
    """Sizes of every tensor of ``plan``'s program, from the profile at the plan's backward size."""
    return LayerBytes.from_profile(profile, plan.microbatch_bwd)


def program_memory(plan: Plan, profile: Profile, cap: int | None = None,
                   sizes: LayerBytes | None = None) -> ProgramMemory:
    """Compile ``plan`` with ``sizes`` (default: the profile's) and replay its live device bytes."""
    return compiled_memory(plan, profile, cap, sizes)[0]


def compiled_memory(plan: Plan, profile: Profile, cap: int | None = None, sizes: LayerBytes | None = None):
    """:func:`program_memory`, with the per-rank instructions in issue order and the sizes it replayed."""
    cap = int(cap if cap is not None else plan.memory_cap)
    sizes = sizes or layer_bytes(plan, profile)
    drafts, _ = issue_order(plan, sizes, cap)
    peaks, over = [], None
    for r, ranks in enumerate(drafts):
        peak, first = replay_memory(ranks, plan.num_layers, sizes, cap)
        peaks.append(peak)
        if first is not None and over is None:
            over = (r, str(ranks[first[0]]), first[1])
    return ProgramMemory(tuple(peaks), cap, over), drafts, sizes


def check_plan_memory(plan: Plan, profile: Profile, cap: int | None = None, *, who: str = "the plan") -> ProgramMemory:
    """:func:`program_memory`, raising InfeasibleError (one line: the instruction, its bytes, the cap)
    where the program would exceed the cap."""
    mem = program_memory(plan, profile, cap)
    if not mem.fits:
        r, ins, need = mem.over
        raise InfeasibleError(
            f"{who} does not fit at run time: on GPU {r}, instruction {ins} would hold {fmt_bytes(need)} ({need} "
            f"bytes), over the cap of {fmt_bytes(mem.cap)} ({mem.cap} bytes); raise --memory-cap or use a "
            f"smaller microbatch", needed_bytes=need, cap_bytes=mem.cap)
    return mem


def fit_to_program(make, plan_cap: int, profile: Profile, *, who: str, tries: int = 4) -> Plan:
    """``make(cap)`` under ``plan_cap``; where its program exceeds ``plan_cap``, search again with the
    planner's cap lowered by the excess (the plan keeps ``plan_cap`` as its cap), a few times, then
    refuse with the figures. Every plan a planner returns passes through here."""
    cap = plan_cap
    for attempt in range(tries):
        plan = make(cap)
        if cap != plan_cap:
            plan = plan.replace(memory_cap=plan_cap)
        try:
            mem = program_memory(plan, profile, plan_cap)
        except PlanError as e:      # a plan the simulator plays but no program can run
            raise InfeasibleError(f"{who} cannot run: {e}") from None
        if mem.fits or attempt == tries - 1:
            break
        cap -= mem.over[2] - plan_cap
        if cap <= 0:
            break
    check_plan_memory(plan, profile, plan_cap, who=who)
    return plan
