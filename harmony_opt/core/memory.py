"""Which contiguous packs fit in GPU memory: the basis of every planner.

``pack_memory(a, b)`` is Harmony's compute memory of a pack (sum of the layers' peak
memory minus the inner layers' inputs), and it only grows as the pack grows, so the
largest pack starting at each layer follows from one vectorized ``searchsorted`` over
prefix sums. Pack memory is the model the planners search with; the memory a plan really
takes is its compiled program's (:mod:`harmony_opt.compile.program_memory`), against which
every plan a planner returns is checked.
"""
from __future__ import annotations


import numpy as np

from .errors import InfeasibleError
from .profile import PhaseCosts, Profile
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
