"""Harmony's layer-packing heuristics and candidate microbatch sizes, to the letter.

Part of the Harmony-compatible mode (:mod:`harmony_opt.harmony`); semantics are
HARMONY_REFERENCE.md sections 2 and 3. Every packer is a pure function over per-layer
numpy arrays (section 1.4):

* ``m[l] = M(u, l) - X(u, l)``: peak memory of layer ``l`` without its input (int64),
* ``x[l] = X(u, l)``: bytes of the layer's input (int64),
* ``t[l]``: GPU time of the layer (float64; only ``balanced_time`` reads it),

and returns a tuple of inclusive ``(first, last)`` packs, or ``None`` when the method
finds no valid packing ("invalid"; the search drops it). The memory a packer compares with
the cap is ``sum(m over P) + x[first(P)]``, which equals Harmony's ``Cmem(P, u)``. The
comparisons keep Harmony's mix of strict and non-strict tests and its floor division on
integer arrays, since they decide which packs exist at the cap's edge.

Usage::

    packs = get_packer("balanced_time")(m, x, t, cap)
    fwd, bwd = packing_methods("published")
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from ..core.errors import UsageError

Pack = tuple[int, int]
Packs = tuple[Pack, ...]
Packer = Callable[..., "Packs | None"]


def _runs_to_packs(starts: Sequence[int], n: int) -> Packs:
    """Inclusive packs from ascending start layers of ``n`` layers."""
    ends = list(starts[1:]) + [n]
    return tuple((int(a), int(b) - 1) for a, b in zip(starts, ends))


# -- greedy (3.1, 3.2) --------------------------------------------------------------------

def _greedy_forward(m, x, cap) -> Packs | None:
    """Fill packs from layer 0 up; the leftover ends in the last pack."""
    m, x = m.tolist(), x.tolist()
    s = m[0] + x[0]
    if s >= cap:
        return None
    starts = [0]
    for l in range(1, len(m)):
        if s + m[l] < cap:
            s += m[l]
        else:
            starts.append(l)
            s = m[l] + x[l]
            if s >= cap:
                return None
    return _runs_to_packs(starts, len(m))


def _greedy_reverse(m, x, cap) -> Packs | None:
    """Fill packs from the last layer down; the leftover ends in the first pack.

    The input x of a pack's lowest layer counts, so each test adds the candidate's x.
    """
    m, x = m.tolist(), x.tolist()
    last = len(m) - 1
    s = m[last]
    if s + x[last] >= cap:
        return None
    starts = []
    for l in range(last - 1, -1, -1):
        if s + m[l] + x[l] < cap:
            s += m[l]
        else:
            starts.append(l + 1)
            s = m[l]
            if s + x[l] >= cap:
                return None
    starts.append(0)
    return _runs_to_packs(starts[::-1], len(m))


def greedy(m, x, t, cap, reuse_packs=None) -> Packs | None:
    """Greedy forward by memory, ignoring every pack's input."""
    return _greedy_forward(m, np.zeros_like(m), cap)


def greedy_addx(m, x, t, cap, reuse_packs=None) -> Packs | None:
    """Greedy forward by memory, counting each pack's first input."""
    return _greedy_forward(m, x, cap)


def greedy_reverse(m, x, t, cap, reuse_packs=None) -> Packs | None:
    """Greedy from the last layer down, ignoring every pack's input."""
    return _greedy_reverse(m, np.zeros_like(m), cap)


def greedy_reverse_addx(m, x, t, cap, reuse_packs=None) -> Packs | None:
    """Greedy from the last layer down, counting each pack's first input."""
    return _greedy_reverse(m, x, cap)


# -- balanced (3.3 - 3.5) -----------------------------------------------------------------

def balanced_split(a: np.ndarray, s: int) -> np.ndarray:
    """Start layers of ``s`` packs of ~equal sum of ``a`` (Harmony's split; packs may be empty).

    Integer arrays use floor division for the target per-pack sum, float arrays true
    division; each cut element starts the next pack.
    """
    p = np.cumsum(a)
    if s <= 1:
        cuts = np.zeros(0, dtype=np.int64)
    else:
        q = p[-1] // s if a.dtype == np.int64 else p[-1] / s
        cuts = np.searchsorted(p, np.arange(1, s, dtype=np.int64) * q, side="left")
    return np.concatenate([[0], cuts]).astype(np.int64)


def _first_pack_count(m, cap) -> int:
    """Harmony's initial guess of the number of packs: ceil(sum(m) / cap) (at least 1)."""
    return max(math.ceil(int(m.sum()) / float(cap)), 1)


def _balanced(m, x, cap, split_on, addx: bool) -> Packs | None:
    """Try S = ceil(sum m / cap) .. L packs; return the first split without empty packs that fits."""
    n = len(m)
    pm = np.concatenate([[0], np.cumsum(m)])
    for s in range(_first_pack_count(m, cap), n + 1):
        starts = balanced_split(split_on, s)
        bounds = np.append(starts, n)
        if (np.diff(bounds) == 0).any() or bounds[-2] >= n:
            continue
        sums = pm[bounds[1:]] - pm[bounds[:-1]]
        if addx:
            ok = not (sums + x[starts] > cap).any()     # equality accepted
        else:
            ok = sums.max() < cap
        if ok:
            return _runs_to_packs(starts.tolist(), n)
    return None


def balanced(m, x, t, cap, reuse_packs=None) -> Packs | None:
    """Balance memory over S packs; accept when every pack's memory is < cap (x ignored)."""
    return _balanced(m, x, cap, np.asarray(m, dtype=np.int64), addx=False)


def balanced_addx(m, x, t, cap, reuse_packs=None) -> Packs | None:
    """Balance memory over S packs; reject when a pack's memory plus first input is > cap."""
    return _balanced(m, x, cap, np.asarray(m, dtype=np.int64), addx=True)


def balanced_time(m, x, t, cap, reuse_packs=None) -> Packs | None:
    """Balance GPU time over S packs (S from the memory guess); accept with the addx rule."""
    return _balanced(m, x, cap, np.asarray(t, dtype=np.float64), addx=True)


# -- reuse (3.6) --------------------------------------------------------------------------

def reuse(m, x, t, cap, reuse_packs=None) -> Packs | None:
    """Reuse the given (BWD) packs as they are if each is strictly under the cap with FWD memory."""
    if reuse_packs is None:
        raise UsageError("packing method reuse needs the backward packs to reuse; it is a forward-only method")
    if not reuse_packs:
        return ()
    pm = np.concatenate([[0], np.cumsum(m)])
    for a, b in reuse_packs:
        if not int(pm[b + 1] - pm[a]) + int(x[a]) < cap:
            return None
    return tuple((int(a), int(b)) for a, b in reuse_packs)


PACKERS: dict[str, Packer] = {
    "greedy": greedy,
    "greedy_addx": greedy_addx,
    "greedy_reverse": greedy_reverse,
    "greedy_reverse_addx": greedy_reverse_addx,
    "balanced": balanced,
    "balanced_addx": balanced_addx,
    "balanced_time": balanced_time,
    "reuse": reuse,
}

#: Named method lists: (fwd, bwd). "published" is what Harmony's run scripts pass;
#: "defaults" (alias "all") is the scheduler's own default (sched_args.py).
PACKING_SETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "published": (("balanced_time", "reuse"), ("balanced_time",)),
    "defaults": (("greedy_reverse_addx", "balanced_addx", "reuse", "balanced_time"),
                 ("greedy_reverse_addx", "balanced_addx", "balanced_time")),
}
PACKING_SETS["all"] = PACKING_SETS["defaults"]


def get_packer(name: str) -> Packer:
    """The packer called ``name`` (case-insensitive)."""
    key = str(name).strip().lower()
    if key not in PACKERS:
        raise UsageError(f"unknown packing method {name!r}; valid: {', '.join(PACKERS)} "
                         f"(or a set: {', '.join(PACKING_SETS)})")
    return PACKERS[key]


def packing_methods(spec, phase: str) -> tuple[str, ...]:
    """Method names for a phase ("FWD"/"BWD") from a set name, a comma list or a sequence.

    Names are checked and lower-cased; repeats are dropped (Harmony keys results by method).
    ``reuse`` is rejected for BWD, which has nothing to reuse.
    """
    fwd = phase.upper() == "FWD"
    if isinstance(spec, str):
        key = spec.strip().lower()
        if key in PACKING_SETS:
            return PACKING_SETS[key][0 if fwd else 1]
        spec = [s for s in key.split(",") if s.strip()]
    names: list[str] = []
    for s in spec:
        get_packer(s)
        n = str(s).strip().lower()
        if n == "reuse" and not fwd:
            raise UsageError("packing method reuse is forward-only (it reuses the backward packs)")
        if n not in names:
            names.append(n)
    if not names:
        raise UsageError(f"no {phase.upper()} packing method given; valid: {', '.join(PACKERS)}")
    return tuple(names)


# -- candidate microbatch sizes (2) -------------------------------------------------------

def data_shares(batch: int, gpus: int) -> list[int]:
    """vDP samples per GPU: floor(D/N) plus one for the first D % N GPUs."""
    return [batch // gpus + (1 if n < batch % gpus else 0) for n in range(gpus)]


def candidate_sizes(profiled: Sequence[int], batch: int, gpus: int, mode: str,
                    step: int = 1, inequal: bool = False) -> list[int]:
    """Harmony's searchable microbatch sizes for one phase (ascending).

    ``range(min K, min(max K, Dcap) + 1, step)`` with Dcap = D (vPP) or floor(D/N) (vDP);
    unless ``inequal``, only sizes that split every GPU's batch evenly are kept.
    """
    lo, hi = int(min(profiled)), int(max(profiled))
    dcap = batch if mode == "vPP" else batch // gpus
    sizes = range(lo, min(hi, dcap) + 1, step)
    if inequal:
        return sorted(sizes)
    shares = [batch] if mode == "vPP" else data_shares(batch, gpus)
    return sorted(u for u in sizes if all(s % u == 0 for s in shares))


def split_microbatches(total: int, u: int) -> list[int]:
    """``[u] * (total // u)`` plus the remainder, if any (Harmony's ``ubatchszs``)."""
    return [u] * (total // u) + ([total % u] if total % u else [])
