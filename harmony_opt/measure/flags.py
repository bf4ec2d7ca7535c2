"""Flags on profiles whose times cannot be trusted, and what makes two layers identical.

A plan is only as good as its profile's times, and a noisy machine can make them wrong by
an order of magnitude without any error. Two checks need nothing but the profile:

* **non-monotonic**: a layer measured faster at a larger microbatch than at a smaller one, by
  more than ``tolerance`` (and more than ``floor`` seconds: tiny layers jitter);
* **identical layers apart**: layers with the same signature (:func:`layer_signature`: module
  classes, parameter and buffer shapes and dtypes, and input shape, so a VGG conv at another
  resolution is not "identical") whose times at one phase and size differ by more than ``ratio``.

Signatures are in the profile's ``meta["layer_signatures"]`` (the profiler records them); a
profile without them gets the first check only. A third flag reads the meta: the machine's load
average when profiling began above its usable cores (other processes competed for them).
The profiler re-measures the flagged layers once before it records the flags
(``meta["warnings"]``); ``harmony-opt profile``, ``check`` and ``show`` print them.
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch
from torch import nn

from ..core.profile import PHASES, Profile

#: Identical layers whose times differ by more than this factor are flagged.
IDENTICAL_RATIO = 2.0
#: A larger microbatch measured faster than a smaller one by more than this share is flagged.
MONOTONIC_TOLERANCE = 0.10
#: Differences below this many seconds are never flagged.
FLOOR_S = 1e-5


@dataclasses.dataclass(frozen=True)
class Flag:
    """One suspicious finding: its kind, the (layer, microbatch) measurements it casts doubt on, its text."""

    kind: str
    suspects: tuple[tuple[int, int], ...]
    text: str


def layer_signature(layer: nn.Module, x: torch.Tensor) -> str:
    """``Class:hash`` of the layer's structure and input: equal for layers that do the same work."""
    parts = [type(m).__name__ for m in layer.modules()]
    parts += [f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}" for n, p in layer.named_parameters()]
    parts += [f"{n}:{tuple(b.shape)}:{b.dtype}" for n, b in layer.named_buffers()]
    parts.append(f"input:{tuple(x.shape[1:])}:{x.dtype}")
    return f"{type(layer).__name__}:{hashlib.sha1('|'.join(parts).encode()).hexdigest()[:10]}"


def profile_flags(profile: Profile, *, ratio: float = IDENTICAL_RATIO, tolerance: float = MONOTONIC_TOLERANCE,
                  floor: float = FLOOR_S) -> list[Flag]:
    """Every flag of ``profile`` (module docstring), in layer order: non-monotonic, identical, busy."""
    times = _times(profile)
    flags = _non_monotonic(profile, times, tolerance, floor) + _identical_apart(profile, times, ratio, floor)
    busy = _busy(profile.meta)
    return flags + ([busy] if busy else [])


def profile_warnings(profile: Profile) -> list[str]:
    """The flags' texts, one line each."""
    return [f.text for f in profile_flags(profile)]


def _times(profile: Profile) -> dict[str, dict[int, np.ndarray]]:
    """{phase: {u: per-layer seconds}} at the profiled sizes."""
    return {ph: {int(u): profile.costs(ph, int(u)).time for u in profile.sizes(ph)} for ph in PHASES}


def _ms(t: float) -> str:
    return f"{t * 1e3:.3g} ms"


def _non_monotonic(profile: Profile, times, tolerance: float, floor: float) -> list[Flag]:
    out = []
    for l in range(profile.num_layers):
        for ph in PHASES:
            sizes = sorted(times[ph])
            worst = None
            for a, b in zip(sizes, sizes[1:]):
                ta, tb = times[ph][a][l], times[ph][b][l]
                if tb < ta * (1 - tolerance) and ta - tb > floor and (worst is None or ta / tb > worst[0]):
                    worst = (ta / tb, a, b, ta, tb)
            if worst:
                _, a, b, ta, tb = worst
                out.append(Flag("non-monotonic", ((l, a), (l, b)),
                                f"layer {l} {ph}: microbatch {b} measured faster than microbatch {a} "
                                f"({_ms(tb)} < {_ms(ta)}); a larger microbatch cannot take less time"))
    return out


def _identical_apart(profile: Profile, times, ratio: float, floor: float) -> list[Flag]:
    sigs = profile.meta.get("layer_signatures")
    if not isinstance(sigs, list) or len(sigs) != profile.num_layers:
        return []
    groups: dict[str, list[int]] = {}
    for l, s in enumerate(sigs):
        groups.setdefault(str(s), []).append(l)
    out = []
    for sig, members in groups.items():
        if len(members) < 2:
            continue
        idx = np.array(members)
        for ph in PHASES:
            bad = []
            for u, t in times[ph].items():
                lo, hi = float(t[idx].min()), float(t[idx].max())
                if hi > ratio * lo and hi - lo > floor:
                    bad.append((hi / max(lo, 1e-300), u, int(idx[t[idx].argmin()]), lo,
                                int(idx[t[idx].argmax()]), hi))
            if bad:
                r, u, fast, lo, slow, hi = max(bad)
                sizes = sorted(b[1] for b in bad)
                out.append(Flag("identical-apart", tuple((l, v) for l in members for v in sizes),
                                f"layers {_ranges(members)} ({sig.split(':')[0]}, identical) {ph} at microbatch {u}: "
                                f"{_ms(lo)} (layer {fast}) to {_ms(hi)} (layer {slow}), {r:.1f}x apart"
                                + (f" (also at microbatch {', '.join(map(str, (s for s in sizes if s != u)))})"
                                   if len(sizes) > 1 else "")))
    return sorted(out, key=lambda f: f.suspects[0])


def _busy(meta: dict) -> Flag | None:
    load, cores = meta.get("load_average"), meta.get("cores")
    if not isinstance(load, (int, float)) or not isinstance(cores, int) or load <= cores:
        return None
    threads = meta.get("threads")
    advice = ("; with more than one thread a busy CPU can make every operator wait for a descheduled "
              "thread: profile and run with OMP_NUM_THREADS=1" if isinstance(threads, int) and threads > 1 else "")
    return Flag("busy", (), f"the machine was busy when profiling began: load average {load:.1f} on {cores} "
                            f"usable cores, {threads if threads is not None else 'unknown'} profiling thread(s): "
                            f"times may be inflated{advice}")


def _ranges(xs: list[int]) -> str:
    """[1, 2, 3, 5] -> "1-3, 5"."""
    parts, start = [], xs[0]
    for a, b in zip(xs, xs[1:] + [None]):
        if b != a + 1:
            parts.append(f"{start}-{a}" if a != start else str(a))
            start = b
    return ", ".join(parts)


def thread_note(meta: dict, device: str, world: int) -> str | None:
    """One line when a run's ranks would use another intra-op thread count than the profile recorded
    (``meta["threads"]``); ``None`` when they match or the profile does not say."""
    from harmony_opt.runtime.optim import host_threads

    recorded = meta.get("threads")
    if not isinstance(recorded, int):
        return None
    used = host_threads(1, device, torch.get_num_threads()) if world == 1 else host_threads(world, device)
    if used == recorded:
        return None
    return (f"the profile was measured with {recorded} intra-op thread(s), but each of this run's {world} rank(s) "
            f"uses {used}: its CPU times (and on a CPU device, its compute times) may not match the plan's")
