"""Which contiguous packs fit in GPU memory: the basis of every planner.

``pack_memory(a, b)`` is Harmony's compute memory of a pack (sum of the layers' peak
memory minus the inner layers' inputs), and it only grows as the pack grows, so the
largest pack starting at each layer follows from one vectorized ``searchsorted`` over
prefix sums.

The device memory a plan really takes is what its compiled Program keeps live on each rank,
instruction by instruction in issue order: the caching allocator reserves a tensor when the
instruction that makes it is issued and reuses it once it is freed. What each instruction
allocates and frees is :func:`harmony_opt.program.effects`, the sizes a :class:`LayerBytes`;
the compiler's validator and the executor's memory guard count exactly this. Pack memory is
the model the planners search with; every plan they return is checked by
:func:`program_memory` with the profile's sizes (which ``harmony-opt profile`` measures as the
runtime sees them), so a returned plan is not refused at run time by the guard.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .errors import InfeasibleError, PlanError
from .plan import Plan
from .profile import PhaseCosts, Profile
from .program import LayerBytes, replay_memory
from .units import fmt_bytes


def max_pack_end(costs: PhaseCosts, cap: int, reserve: int = 0, strict: bool = False,
                 last_layer: int | None = None) -> np.ndarray:
    """``end[i]`` = the largest ``j`` such that pack ``[i, j]`` fits: ``pack_memory(i, j) + reserve <= cap``
    (``<`` with ``strict``), or ``i - 1`` where layer ``i`` alone does not fit.

    Layers after ``last_layer`` (default: the last) are not considered.
    """
    R = costs.num_layers if last_layer is None else last_layer + 1
    pm, px = costs._pm[: R + 1], costs._px[: R + 1]
    # pack_memory(i, j) = G[j + 1] - H[i], with G non-decreasing in j.
    g = pm[1:] - px[1:]
    h = pm[:R] - px[1: R + 1]
    budget = cap - reserve - (1 if strict else 0) + h
    end = np.searchsorted(g, budget, side="right") - 1
    return np.maximum(end, np.arange(R) - 1)


def check_layers_fit(profile: Profile, phase: str, u: int, cap: int, reserve: int = 0) -> None:
    """Raise InfeasibleError naming the first layer that alone needs more than ``cap`` at ``u``."""
    c = profile.costs(phase, u)
    single = c.memory.astype(np.int64) + reserve
    over = np.flatnonzero(single > cap)
    if len(over):
        l = int(over[0])
        what = "forward" if phase == "FWD" else "recompute + backward"
        raise InfeasibleError(
            f"layer {l} of {profile.name} alone needs {fmt_bytes(single[l])} ({single[l]} bytes) for its {what} "
            f"at microbatch {u}, more than the memory cap of {fmt_bytes(cap)} ({cap} bytes); "
            + ("use a smaller microbatch or a larger --memory-cap" if u > profile.size_range(phase)[0] else
               "no smaller microbatch is profiled, so use a larger --memory-cap"),
            layer=l, microbatch=u, needed_bytes=int(single[l]), cap_bytes=int(cap))


def explain_infeasible(profile: Profile, cap: int, sizes_fwd, sizes_bwd, reserve_of=lambda phase, u: 0) -> InfeasibleError:
    """The smallest infeasible piece: at the smallest microbatch size, the layer that does not fit.

    With no size to search in a phase, its smallest profiled size stands in: a layer too large
    there is too large at every size, which is the more useful thing to say."""
    for phase, sizes in (("BWD", sizes_bwd), ("FWD", sizes_fwd)):
        u = int(min(sizes)) if len(sizes) else profile.size_range(phase)[0]
        try:
            check_layers_fit(profile, phase, u, cap, reserve_of(phase, u))
        except InfeasibleError as e:
            return e
    if len(sizes_fwd) == 0 or len(sizes_bwd) == 0:
        (fl, fh), (bl, bh) = profile.size_range("FWD"), profile.size_range("BWD")
        return InfeasibleError(f"no microbatch size of {profile.name} to search: sizes must be profiled (FWD {fl}..{fh}, "
                               f"BWD {bl}..{bh}) and divide the samples per GPU; change the batch or the GPU count")
    return InfeasibleError(f"no plan of {profile.name} fits a memory cap of {fmt_bytes(cap)} with the "
                           f"requested options; every layer fits alone, so try another mode, more GPUs or "
                           f"a larger cap", cap_bytes=int(cap))


# -- the program's memory ------------------------------------------------------------------------

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
    from .compiler import issue_order

    cap = int(cap if cap is not None else plan.memory_cap)
    sizes = sizes or layer_bytes(plan, profile)
    drafts, _ = issue_order(plan, sizes, cap)
    peaks, over = [], None
    for r, ranks in enumerate(drafts):
        peak, first = replay_memory(ranks, plan.num_layers, sizes, cap)
        peaks.append(peak)
        if first is not None and over is None:
            over = (r, str(ranks[first[0]]), first[1])
    return ProgramMemory(tuple(peaks), cap, over)


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
