"""Calibration: fit the hardware's cost terms to measured steps, so that the simulator predicts
what the executor does.

The simulator prices a plan from the profile's times and the hardware's bandwidths; a real step
also pays what those leave out (a fixed cost per copy and per kernel launch, a device slower or
faster than the one profiled, the CPU optimizer's per-call overhead). :func:`fit_hardware` matches
measured Timelines (the traced steps of ``train(..., trace=N)``, each event at its median over them)
with the simulated one of the same plan and fits, by least squares over the matched events, the
Hardware terms the simulator charges:

* compute (forward; backward with its recompute): measured = compute_scale * profiled + issue_overhead_s
* host -> GPU copies (weights and activations): measured = bytes / h2d_bandwidth + h2d_latency_s;
  GPU -> host copies likewise with d2h_bandwidth, d2h_latency_s
* GPU -> GPU sends where the trace times them (the CPU device: the sends and receives between
  ranks, matched per rank and microbatch): measured = bytes / p2p_bandwidth + p2p_latency_s
* CPU optimizer steps: measured = cpu_optimizer_scale * profiled + cpu_optimizer_call_s
* optimizer steps on the GPU: measured = bytes / gpu_optimizer_bandwidth + gpu_optimizer_call_s (where
  matched, the fit holds what the probe's per-tensor cost held: gpu_optimizer_tensor_s is set to 0)
* the vDP all-reduce: measured = ring bytes / collective_bandwidth + collective_latency_s per call

A fixed cost is fitted only where the matched groups tell it from the slope (at least
``MIN_FIXED_GROUPS``, and a significant gain by an F-test); elsewhere the input's (what ``probe``
measured) is kept and the slope alone fitted.

The simulated side is priced with these terms neutral (:func:`neutral`: the profile's times and
bytes / bandwidth alone), so the fit is the same whatever terms the given hardware carried.
:func:`calibrate` runs the whole comparison for a plan; :func:`promise` is the per-kind comparison
``harmony-opt run`` prints after training.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import pandas as pd

from .core.errors import UsageError
from .core.hardware import Hardware
from .core.plan import backward_instructions, forward_instructions
from .sim.matching import WORK, anchors as _anchors, event_key as _key, work_of
from .sim.timeline import Timeline

#: The terms fitted, by what they price: (kinds of work, the fields a slope and a fixed cost set).
TERMS = {
    "compute": (("forward", "backward"), "compute_scale", "issue_overhead_s"),
    "host -> GPU": (("weights in", "activations in"), "h2d_bandwidth", "h2d_latency_s"),
    "GPU -> host": (("weights out", "activations out"), "d2h_bandwidth", "d2h_latency_s"),
    "CPU step": (("CPU step",), "cpu_optimizer_scale", "cpu_optimizer_call_s"),
    "GPU step": (("GPU step",), "gpu_optimizer_bandwidth", "gpu_optimizer_call_s"),
    "all-reduce": (("all-reduce",), "collective_bandwidth", "collective_latency_s"),
    "GPU to GPU": (("GPU to GPU",), "p2p_bandwidth", "p2p_latency_s"),
}
#: The terms priced per byte moved (the rest: per second of the neutral simulation's event), the kinds
#: of work they price, and the bandwidths they set (seconds per byte: the slope's inverse).
BYTE_TERMS = ("host -> GPU", "GPU -> host", "GPU to GPU")
BYTE_WORKS = frozenset(w for t in BYTE_TERMS for w in TERMS[t][0])
COPY_BANDWIDTHS = tuple(TERMS[t][1] for t in BYTE_TERMS)

#: The cost terms with their neutral values: the simulator then prices from the profile and bandwidths alone.
NEUTRAL_TERMS = {"compute_scale": 1.0, "issue_overhead_s": 0.0, "h2d_latency_s": 0.0, "d2h_latency_s": 0.0,
                 "p2p_latency_s": 0.0, "collective_latency_s": 0.0,
                 "cpu_optimizer_scale": 1.0, "cpu_optimizer_call_s": 0.0, "gpu_optimizer_call_s": 0.0,
                 "gpu_optimizer_tensor_s": 0.0, "collective_bandwidth": None,
                 "instruction_gap_s": 0.0, "host_instruction_s": 0.0}


def neutral(hardware: Hardware) -> Hardware:
    """``hardware`` with the fitted terms neutral (bandwidths and ``copy_overlap`` kept): the
    simulation :func:`fit_hardware` compares with."""
    return dataclasses.replace(hardware, **NEUTRAL_TERMS)


def _steps(measured: Timeline | Sequence[Timeline]) -> list[Timeline]:
    """One measured step or several (of the same plan) as a list."""
    return [measured] if isinstance(measured, Timeline) else list(measured)


def busy_by_work(timeline: Timeline | Sequence[Timeline]) -> dict[str, float]:
    """Busy seconds of each kind of work, summed over ranks; of several steps, the median per kind."""
    steps = _steps(timeline)
    if len(steps) > 1:
        each = [busy_by_work(t) for t in steps]
        return {w: float(np.median([b.get(w, 0.0) for b in each])) for w in dict.fromkeys(k for b in each for k in b)}
    out: dict[str, float] = defaultdict(float)
    ev = steps[0].events
    for s, k, a, b in zip(ev["stream"], ev["kind"], ev["start"], ev["end"]):
        w = work_of(str(s), str(k))
        if w is not None:
            out[w] += float(b) - float(a)
    return dict(out)


def _union(events: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """The union of the events' [start, end] intervals, as the sorted starts and ends of disjoint spans."""
    lo: list[float] = []
    hi: list[float] = []
    for a, b in sorted(zip(events["start"].astype(float), events["end"].astype(float))):
        if lo and a <= hi[-1]:
            hi[-1] = max(hi[-1], b)
        else:
            lo.append(a)
            hi.append(b)
    return np.array(lo), np.array(hi)


def idle_time(timeline: Timeline | Sequence[Timeline], rank: int = 0) -> float:
    """Seconds of the step in which no event of ``rank`` runs on any stream: in a measured step the
    executor's own work between instructions (and waits), which no cost term prices. Of several
    steps, the median."""
    steps = _steps(timeline)
    if len(steps) > 1:
        return float(np.median([idle_time(t, rank) for t in steps]))
    timeline = steps[0]
    lo, hi = _union(timeline.events[timeline.events["rank"] == rank])
    return max(float(timeline.iteration_time) - float((hi - lo).sum()), 0.0)


#: The fixed costs a rank that runs its instructions one at a time pays between them as well.
GAP_FIELDS = ("issue_overhead_s", "h2d_latency_s", "d2h_latency_s", "p2p_latency_s", "collective_latency_s")


def instruction_gaps(measured: Timeline, rank: int = 0) -> np.ndarray:
    """Seconds in which nothing of ``rank`` runs between each two of its consecutive instructions (on
    its one thread: the CPU optimizer's worker thread aside, though its steps, like a wait for another
    rank, cover the time they run), in program order."""
    ev = measured.events[measured.events["rank"] == rank]
    main = ev[ev["stream"] != "cpu"].sort_values("start")
    starts, ends = main["start"].to_numpy(float), np.maximum.accumulate(main["end"].to_numpy(float))
    if len(starts) < 2:
        return np.zeros(0)
    # the time the union of every event's interval covers up to t is piecewise linear in t
    lo, hi = _union(ev)
    done = np.concatenate([[0.0], np.cumsum(hi - lo)])
    xs, ys = np.column_stack([lo, hi]).ravel(), np.column_stack([done[:-1], done[1:]]).ravel()
    a, b = ends[:-1], starts[1:]
    return np.maximum((b - a) - (np.interp(b, xs, ys) - np.interp(a, xs, ys)), 0.0)


def instruction_gap(measured: Timeline | Sequence[Timeline]) -> float:
    """The typical seconds between a rank's consecutive instructions where nothing overlaps (the CPU
    device): the median of :func:`instruction_gaps`, of every step given pooled, averaged over the
    ranks. On such a device every instruction pays it, whatever its kind, so it goes into each
    one's fixed cost.

    The median, not the step's idle time per instruction: a few gaps are long (the hand-off of a
    pack's gradients to the CPU optimizer, 0.2-0.3 ms against a typical 30-60 us on a 2-core VM), and
    the plans of a few large packs have a larger share of them. Their mean charged L2L's 142
    instructions on vgg-tiny 70-80 us each where it idled 50 us per instruction; the rest of the idle
    time is left to :func:`close_step`'s factor, which spreads it over the step's whole time.

    Pooled over steps, since a plan of a few large packs has few gaps: Harmony's on vgg-tiny at 4x
    its largest layer has 7-11, and their median moved by 15 us from one traced step to the next."""
    steps = _steps(measured)
    ranks = sorted(set(int(x) for t in steps for x in t.events["rank"]))
    per_rank = [np.concatenate([instruction_gaps(t, r) for t in steps]) for r in ranks]
    medians = [float(np.median(g)) for g in per_rank if len(g)]
    return float(np.mean(medians)) if medians else 0.0


# -- matching ---------------------------------------------------------------------------------------------

def host_instruction(measured: Timeline | Sequence[Timeline], simulated: Timeline) -> float | None:
    """The issuing thread's seconds per instruction beyond a compute instruction's kernels
    (``Hardware.host_instruction_s``), from the measured steps' issue times (``Timeline.host``; None
    where none were recorded: the CPU device, older traces). Per step and rank: the median issue time
    of each kind of instruction that is not compute, summed over those instructions, plus the median
    gap between one issue and the next for every instruction (frees and the executor's own work
    included), over the simulated events :func:`~harmony_opt.sim.simulator.host_floor` counts on that
    rank. Medians, so the host's rare long waits (a CPU step it must wait for) stay out: the
    simulator times those itself. The median over steps of the mean over ranks."""
    per_step = []
    sim = simulated.events
    counted = sim[sim["stream"] != "cpu"].groupby("rank").size()
    for t in _steps(measured):
        if not len(t.host):
            continue
        ev = t.events
        compute = set(ev.loc[ev["stream"] == "compute", "task"].astype(str))
        per_rank = []
        for r, rows in t.host.groupby("rank"):
            rows = rows.sort_values("start")
            n = int(counted.get(r, 0))
            if n == 0 or len(rows) < 2:
                continue
            start, end = rows["start"].to_numpy(float), rows["end"].to_numpy(float)
            gap = float(np.median(np.clip(start[1:] - end[:-1], 0, None)))
            other = rows[~rows["instruction"].astype(str).isin(compute)]
            issue = (other["end"] - other["start"]).groupby(other["kind"]).transform("median").sum()
            per_rank.append((float(issue) + len(rows) * gap) / n)
        if per_rank:
            per_step.append(float(np.mean(per_rank)))
    return float(np.median(per_step)) if per_step else None


def _pooled(steps: list[Timeline], anchors: dict) -> dict[tuple, list[float]]:
    """:func:`_groups` of several measured steps: each key's median seconds over the steps it is in."""
    each = [_groups(t.events, anchors) for t in steps]
    if len(each) == 1:
        return each[0]
    out: dict[tuple, list[float]] = {}
    for key in dict.fromkeys(k for g in each for k in g):
        got = [g[key] for g in each if key in g]
        out[key] = [got[0][0], float(np.median([x[1] for x in got])), got[0][2]]
    return out


def _groups(events: pd.DataFrame, anchors: dict) -> dict[tuple, list[float]]:
    """(rank, work, pack, microbatch) -> [events, seconds, bytes] of a timeline's events."""
    out: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    for r, s, k, p, m, a, b, n in zip(events["rank"], events["stream"], events["kind"], events["pack"],
                                      events["microbatch"], events["start"], events["end"], events["bytes"]):
        w = work_of(str(s), str(k))
        if w is None:
            continue
        g = out[_key(r, w, p, m, anchors)]
        g[0] += 1
        g[1] += float(b) - float(a)
        g[2] += int(n)
    return out


# -- least squares ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Fit:
    """One fitted pair: measured = slope * x + fixed * (instructions: simulated events, a recomputing
    backward pack's counted twice, as the simulator charges them), over ``points`` matched groups."""
    name: str
    works: tuple[str, ...]
    slope: float | None          # None: nothing to fit it from (the input's is kept)
    fixed: float                 # seconds per instruction
    points: int
    note: str = ""


#: F(1, d) at 95 %: the fixed cost is fitted only where freeing it explains the matched groups
#: significantly better than the input's does (d = groups - 2; beyond the table, its last row).
_F95 = ((1, 161.4), (2, 18.51), (3, 10.13), (4, 7.71), (5, 6.61), (6, 5.99), (7, 5.59), (8, 5.32), (9, 5.12),
        (10, 4.96), (12, 4.75), (15, 4.54), (20, 4.35), (30, 4.17), (60, 4.00))


#: Fewest matched groups a fixed cost is fitted from. Harmony's plan at a large cap has 3 compute groups,
#: a forward and two recomputing backward packs (one instruction against two): where the executor ran
#: the two kinds at different ratios to the profile, a free fit reads that as a fixed cost (gpt2-tiny
#: at 12x its largest layer: 1.19 ms per instruction against the probed 69 us, L2L's plan then
#: predicted 1.6x slower than it ran), and with one or two residual degrees of freedom the F-test
#: passes such a misfit by chance.
MIN_FIXED_GROUPS = 5

#: Largest standard error of the free fit's slope, relative to the slope, at which its fixed cost is
#: taken: where the groups' work per instruction spans little against the noise (the profile's
#: own, across like layers) the slope is not told, and the fit trades it for a fixed cost. Harmony's
#: plan of a 12-layer BERT at 4x its largest layer has 14 compute groups of one block each (work per
#: instruction 2.2-2.8 ms; the like blocks' backward profiled 4.3-5.6 ms) whose measured times did not
#: follow the profile's noise: the free fit, F-test passed, read them as 3.0 ms per instruction and a
#: compute scale of 0.05 (its standard error 6x the slope), and every other plan was predicted up to 39 % off.
MAX_SLOPE_ERROR = 0.25


def _f95(d: int) -> float:
    return min(v for k, v in _F95 if k <= d)


def _gains(held: float, free: float, y: np.ndarray, d: int) -> bool:
    """Whether freeing the fixed cost lowers the squared residual from ``held`` to ``free``
    significantly (F-test at 95 %, ``d`` residual degrees of freedom); residuals below a
    billionth of ``y``'s scale count as none."""
    tiny = 1e-18 * float(y @ y)
    return held > tiny and (free <= tiny or (held - free) / (free / d) > _f95(d))


def _line(x: np.ndarray, n: np.ndarray, y: np.ndarray, slope0: float, two: bool,
          fixed_first: bool = False, fixed0: float | None = None, kinds=None) -> tuple[float | None, float, str]:
    """Least squares of ``y = a * x + b * n`` with ``a > 0`` and ``b >= 0`` (``two=False``: ``b = 0``).

    ``b`` is fitted only where the groups tell it: otherwise ``b = fixed0`` (the input's, e.g. what
    probe measured) and ``a`` alone, since a few groups let noise and the kinds' different ratios to
    the profile set both (docs/cost_model.md; ``MIN_FIXED_GROUPS``). So with ``p`` groups both are
    fitted where ``p >= MIN_FIXED_GROUPS``, the free slope's standard error is within
    ``MAX_SLOPE_ERROR`` of it, and the F-test of the freed fixed cost against ``fixed0`` passes at
    95 %. A free fixed cost below 0 is clipped to 0 (the slope refitted
    through the origin) where the groups tell that from ``fixed0`` the same way, and ``fixed0``
    is kept where they do not: Harmony's plan of vgg-tiny at 1.6x its largest layer (microbatch
    8) has one forward and two backward groups, whose clipped fixed cost (10 us per compute
    instruction against the probed 40-54 us) had predicted L2L and naive swapping 1.18x and 1.15x
    fast, against 1.09x and 1.06x with the probed cost kept (three calibrations each).
    Where the points cannot tell ``a`` from ``b`` (fewer than two distinct ratios x / n) ``a``
    alone with ``b = fixed0``, or with ``fixed_first`` ``a = slope0`` and ``b`` alone (messages
    small enough that their fixed cost is most of their time); where y does not
    grow with x, ``a = slope0`` (the input's) and ``b`` alone. ``fixed0=None``: ``b`` free wherever the
    points can tell it, and 0 where they cannot (``fit_hardware(..., prior=False)``).

    ``kinds`` (one label per group: forward, backward, ...): the fixed cost must also show within the
    kinds, against a slope of each kind's own (:func:`_told_within`), so that kinds run at different
    ratios to the profile are not read as a fixed cost. Harmony's plan of a 12-layer BERT at 12x
    its largest layer has one forward and four backward groups; their medians over nine traced
    steps passed the one-slope test with 0.67-0.70 ms per instruction against the probed 38 us, and
    L2L was then predicted 1.5x slower than it ran."""
    if not len(y):
        return None, 0.0, "no matched events: kept"
    if not (x > 0).any():
        if not two:
            return None, 0.0, "no work to scale: kept"
        return None, max(float(n @ y / (n @ n)), 0.0), "only fixed costs (nothing to scale): slope kept"
    through_origin = float(x @ y / (x @ x))
    if not two:
        return through_origin, 0.0, ""
    kept = 0.0 if fixed0 is None else float(x @ (y - fixed0 * n) / (x @ x))  # the slope with the input's fixed cost
    scale = np.array([np.abs(x).max(), np.abs(n).max()])
    a_mat = np.column_stack([x, n]) / scale
    if np.linalg.matrix_rank(a_mat, tol=1e-9 * np.abs(a_mat).max()) < 2:
        if fixed_first and slope0 > 0:
            return slope0, max(float(n @ (y - slope0 * x) / (n @ n)), 0.0), (
                f"{len(y)} matched group(s) of one shape: the fixed cost alone, the slope kept (the slope "
                f"needs events of different sizes)")
        if kept > 0 and fixed0:
            return kept, fixed0, (f"{len(y)} matched group(s) of one shape: the slope alone, the fixed cost kept "
                                  f"at the input's {fixed0 * 1e6:.1f} us (it needs events of different sizes)")
        return through_origin, 0.0, (f"{len(y)} matched group(s) of one shape: the slope alone, through the "
                                     f"origin (the fixed cost needs events of different sizes)")
    (a, b), *_ = np.linalg.lstsq(a_mat, y, rcond=None)
    a, b = float(a / scale[0]), float(b / scale[1])
    if a <= 0:
        b = max(float(n @ (y - slope0 * x) / (n @ n)), 0.0)
        return slope0, b, "the measured time does not grow with the work: slope kept, fixed cost fitted"
    negative = b < 0
    if negative:            # the free fit with its fixed cost clipped to 0
        a, b = through_origin, 0.0
        if not kept > 0:
            return a, b, "the fixed cost came out negative: clipped to 0, slope refitted"
    if kept > 0:
        p = len(y)
        free = float(((y - a * x - b * n) ** 2).sum())
        held = float(((y - kept * x - fixed0 * n) ** 2).sum())
        # (a clipped fit has no free slope to doubt: it tells 0 from fixed0 by the F-test alone)
        error = 0.0 if negative else _slope_error(a_mat, free, p, scale[0]) / a
        told = p >= MIN_FIXED_GROUPS and error <= MAX_SLOPE_ERROR and _gains(held, free, y, p - 2)
        labels = sorted(set(kinds)) if kinds is not None else []
        if told and not negative and len(labels) > 1:    # and within the kinds, each with a slope of its own?
            told = _told_within(np.column_stack([np.where(np.asarray(kinds) == k, x, 0.0) for k in labels]),
                                n, y, fixed0)
        if not told:
            why = (f"fewer than {MIN_FIXED_GROUPS}" if p < MIN_FIXED_GROUPS else
                   f"freed, the slope's standard error is {100 * error:.0f} % of it"
                   if error > MAX_SLOPE_ERROR else "no significant gain, F-test at 95 %")
            return kept, fixed0, (f"{p} matched group(s) do not tell the fixed cost from the slope ({why}): "
                                  f"the input's {fixed0 * 1e6:.1f} us kept, the slope fitted")
    if negative:
        return a, b, "the fixed cost came out negative: clipped to 0, slope refitted"
    return a, b, ""


def _slope_error(a_mat: np.ndarray, free: float, p: int, scale: float) -> float:
    """The standard error of the slope of the least squares over ``a_mat`` (columns: work and
    instructions, each divided by its ``scale``) with squared residual ``free`` over ``p`` points
    (infinite with no residual degree of freedom)."""
    if p <= 2:
        return math.inf
    cov = np.linalg.pinv(a_mat.T @ a_mat) * free / (p - 2)
    return math.sqrt(max(float(cov[0, 0]), 0.0)) / scale


def _told_within(per: np.ndarray, n: np.ndarray, y: np.ndarray, fixed0: float) -> bool:
    """Whether the groups tell a fixed cost (above 0) from ``fixed0`` with a slope per kind (the
    columns of ``per``), by the F-test at 95 %."""
    p, q = len(y), per.shape[1] + 1
    free_mat = np.column_stack([per, n])
    scale = np.abs(free_mat).max(axis=0)
    scale[scale == 0] = 1.0
    if p < MIN_FIXED_GROUPS or p - q < 1 or np.linalg.matrix_rank(free_mat / scale) < q:
        return False
    coef, *_ = np.linalg.lstsq(free_mat / scale, y, rcond=None)
    b = float(coef[-1] / scale[-1])
    free = float(((y - (free_mat / scale) @ coef) ** 2).sum())
    rest = y - fixed0 * n
    held_coef, *_ = np.linalg.lstsq(per / scale[:-1], rest, rcond=None)
    held = float(((rest - (per / scale[:-1]) @ held_coef) ** 2).sum())
    return b > 0 and _gains(held, free, y, p - q)


# -- the fit ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Calibration:
    """What :func:`fit_hardware` found: the fitted Hardware, each fit, and busy seconds by kind of work."""
    hardware: Hardware
    fits: dict[str, Fit]
    measured: dict[str, float]      # the measured step, all ranks
    simulated: dict[str, float]     # the simulation fitted against (the terms neutral)
    fitted: dict[str, float]        # its events priced with the fitted terms
    unmatched: dict[str, float]     # measured seconds with no simulated event of their key (not fitted)
    notes: list[str] = dataclasses.field(default_factory=list)
    table: pd.DataFrame | None = None           # calibrate(): by kind, before and after
    iteration: dict[str, float] = dataclasses.field(default_factory=dict)  # measured, before, after (calibrate)

    def terms(self) -> dict[str, object]:
        """The fields the fit sets, with their fitted values."""
        names = [f for _, a, b in TERMS.values() for f in (a, b) if f] + ["link_bandwidth"]
        return {f: getattr(self.hardware, f) for f in names}


def fit_hardware(measured: Timeline | Sequence[Timeline], simulated: Timeline, hardware: Hardware, plan=None,
                 prior: bool = True) -> Calibration:
    """Fit ``hardware``'s cost terms so that ``simulated`` (the same plan simulated on
    :func:`neutral` ``(hardware)``) prices its events as ``measured`` (one traced step, or several:
    each event's median over them) took them.

    Events are matched by (rank, kind of work, pack, microbatch) (``plan``, when given, names the
    forward and backward pack each compute event belongs to); each key's measured seconds are fitted
    against its simulated events' neutral seconds (compute, CPU steps) or bytes (copies) and count.
    A fixed cost the groups cannot tell from the slope is kept at ``hardware``'s (:func:`_line`;
    ``prior=False``: fitted freely, 0 where it cannot be). Returns the fitted Hardware
    (``dataclasses.replace``; ``copy_overlap`` and the rest kept)."""
    anchors = _anchors(plan)
    got, sim = _pooled(_steps(measured), anchors), _groups(simulated.events, anchors)
    unmatched: dict[str, float] = defaultdict(float)
    for key, (_, secs, _) in got.items():
        if key not in sim:
            unmatched[key[1]] += secs
    changes: dict[str, object] = {}
    fits: dict[str, Fit] = {}
    price: dict[str, tuple[float, float]] = {}      # work -> (seconds per unit of x, seconds per event)
    notes = []
    gap = 0.0 if hardware.copy_overlap else instruction_gap(measured)
    if gap:
        notes.append(f"{gap * 1e6:.0f} us between consecutive instructions (the executor's own work and its "
                     f"untimed frees; the median gap) is added to every instruction's fixed cost: "
                     f"{', '.join(GAP_FIELDS[:-1])} and {GAP_FIELDS[-1]}")
    ev = simulated.events
    issues = _issues(plan, set(ev.loc[(ev["stream"] == "compute") & (ev["kind"] == "REC"), "pack"].astype(str)))
    for name, (works, slope_field, fixed_field) in TERMS.items():
        keys = [k for k in sim if k[1] in works and k in got]
        bytes_x = name in BYTE_TERMS
        x = np.array([sim[k][2] if bytes_x else sim[k][1] for k in keys], dtype=float)
        n = np.array([sim[k][0] * issues.get(k[1:3], 1) for k in keys], dtype=float)
        y = np.array([got[k][1] for k in keys], dtype=float)
        old = _neutral_slope(hardware, slope_field)
        slope, fixed, note = _line(x, n, y, old, fixed_field is not None, fixed_first=name == "GPU to GPU",
                                   fixed0=_prior(hardware, fixed_field) if prior else None,
                                   kinds=[k[1] for k in keys])
        fits[name] = Fit(name, works, slope, fixed, len(keys), note)
        if slope is None and not keys:
            if any(k[1] in works for k in sim):
                notes.append(f"{name}: no measured event matches a simulated one: kept as it was")
            continue
        if fixed_field in GAP_FIELDS:
            fixed += gap
        used = old if slope is None else slope
        price.update({w: (used, fixed) for w in works})
        changes.update(_fields(hardware, slope_field, used, fixed_field, fixed))
        if name == "GPU step":      # fitted against steps without it: the fit's fixed cost and slope hold it
            changes["gpu_optimizer_tensor_s"] = 0.0
        if note:
            notes.append(f"{name}: {note}")
    changes["instruction_gap_s"] = gap
    host = host_instruction(measured, simulated)
    if host is not None:
        changes["host_instruction_s"] = host
        notes.append(f"the host spends {host * 1e6:.0f} us per instruction besides the compute kernels it launches "
                     f"(its issue times, medians): the step lasts at least its issuing thread's time")
    new = _keep_link_slots(hardware, dataclasses.replace(hardware, **changes))
    measured_busy, simulated_busy = busy_by_work(measured), busy_by_work(simulated)
    fitted: dict[str, float] = defaultdict(float)
    for (_, work, pack, _), (count, secs, nbytes) in sim.items():
        if work in price:
            a, b = price[work]
            x = nbytes if work in BYTE_WORKS else secs
            fitted[work] += a * x + b * count * issues.get((work, pack), 1)
        else:
            fitted[work] += secs
    return Calibration(new, fits, measured_busy, simulated_busy, dict(fitted), dict(unmatched), notes)


def _prior(hw: Hardware, fixed_field: str | None) -> float:
    """The input's fixed cost of one event, what a fit keeps where its groups cannot tell it: without
    the time between instructions a calibration added to it (``instruction_gap_s``), which this fit
    measures and adds again."""
    if fixed_field is None:
        return 0.0
    v = getattr(hw, fixed_field)
    return max(v - hw.instruction_gap_s, 0.0) if fixed_field in GAP_FIELDS else v


def _issues(plan, split: set[str] = frozenset()) -> dict[tuple[str, str], int]:
    """(work, pack) -> instructions the executor issues per simulated compute event, as the simulator
    charges ``issue_overhead_s``: a recomputing backward pack's recompute and backward, 2 (1 each
    where the simulator gives its recompute an event of its own: the packs ``split``); a forward
    pack's pieces (``forward_instructions``)."""
    if plan is None:
        return {}
    pieces = forward_instructions(plan.packs_fwd, plan.packs_bwd)
    return {**{("backward", f"{a}-{b}"): 1 if f"{a}-{b}" in split else backward_instructions(o.recompute)
               for (a, b), o in zip(plan.packs_bwd, plan.options)},
            **{("forward", f"{a}-{b}"): n for (a, b), n in pieces.items()}}


def _neutral_slope(hw: Hardware, field: str) -> float:
    """The slope the neutral simulation already prices with: seconds per byte of a copy, 1 for times."""
    if field in COPY_BANDWIDTHS:
        return 1.0 / getattr(hw, field) if getattr(hw, field) else 0.0
    return 1.0


def _fields(hw: Hardware, slope_field: str, slope: float, fixed_field: str | None, fixed: float) -> dict:
    """The Hardware fields a fitted slope and fixed cost set."""
    out: dict[str, object] = {} if fixed_field is None else {fixed_field: fixed}
    if slope_field in COPY_BANDWIDTHS:
        out[slope_field] = 1.0 / slope
    elif slope_field == "gpu_optimizer_bandwidth":
        out[slope_field] = hw.gpu_optimizer_bandwidth / slope
    elif slope_field == "collective_bandwidth":
        out[slope_field] = hw.p2p_bandwidth / slope
    else:
        out[slope_field] = slope
    return out


def _keep_link_slots(old: Hardware, new: Hardware) -> Hardware:
    """Scale a shared link's total bandwidth with the per-copy ones, so that as many copies run at
    once as before (a slower copy is not a wider link)."""
    if old.link_bandwidth is None:
        return new
    was, now = max(old.h2d_bandwidth, old.d2h_bandwidth), max(new.h2d_bandwidth, new.d2h_bandwidth)
    return dataclasses.replace(new, link_bandwidth=old.link_bandwidth * now / was)


# -- the whole comparison ---------------------------------------------------------------------------------

#: What a plan's simulation does of each kind of work, for the message when a trace has none of it.
_DOES = {"forward": "runs {n} forward computations", "backward": "runs {n} backward computations",
         "GPU step": "steps {n} packs' optimizer on the GPU", "CPU step": "steps {n} packs' optimizer on the CPU",
         "weights in": "moves {n} weight packs to the device", "activations in": "moves {n} activations to the device",
         "weights out": "moves {n} weight packs (gradients) to the host",
         "activations out": "moves {n} activations to the host", "all-reduce": "all-reduces {n} packs' gradients"}


def check_measured(measured: Timeline, simulated: Timeline, plan, where: str = "the measured step") -> None:
    """Refuse a measured step that cannot be this plan's: another plan's identity, another rank count,
    or no event of a kind of work the plan's simulation has (GPU-to-GPU copies excepted: a GPU run
    does not time them)."""
    from .compile.program import plan_identity
    made = measured.meta.get("plan_identity")
    if made and plan is not None and made != plan_identity(plan):
        raise UsageError(f"{where} was traced from another plan (identity {made}, this plan's is "
                         f"{plan_identity(plan)}); trace a run of this plan")
    if plan is not None and measured.ranks != plan.gpus:
        raise UsageError(f"{where} has {measured.ranks} rank(s) but the plan runs on {plan.gpus} GPU(s): was it "
                         f"traced from this plan?")
    have: dict[str, int] = defaultdict(int)
    for s, k in zip(measured.events["stream"], measured.events["kind"]):
        have[work_of(str(s), str(k))] += 1
    wanted: dict[str, int] = defaultdict(int)
    for s, k in zip(simulated.events["stream"], simulated.events["kind"]):
        wanted[work_of(str(s), str(k))] += 1
    for work in WORK:
        if work in _DOES and wanted.get(work) and not have.get(work):
            raise UsageError(f"{where} has no {work} events but the plan {_DOES[work].format(n=wanted[work])}: "
                             f"was it traced from this plan?")


def calibrate(plan, profile, hardware: Hardware, measured: Timeline | Sequence[Timeline],
              where: str = "the measured step", step_time: float | None = None, prior: bool = True) -> Calibration:
    """Simulate ``plan`` on ``hardware`` (before), on its neutral terms (fitted against) and on the
    fitted hardware; fit to ``measured`` (one traced step or several, pooled); close the step
    (:func:`close_step`) on ``step_time`` (the median of the measured steps' own times when not
    given; better, of more steps, as ``calibrate`` takes every step after the first); return the
    Calibration with its table by kind of work and the iteration times (of several measured steps,
    the median; ``iteration["settled"]``: the step was closed on ``step_time``)."""
    from .sim.simulator import simulate

    base = neutral(hardware)
    simulated = simulate(plan, profile, base)
    steps = _steps(measured)
    if not steps:
        raise UsageError(f"{where}: no traced step to fit")
    for t in steps:
        check_measured(t, simulated, plan, where)
    measured = steps
    traced = float(np.median([t.iteration_time for t in steps]))
    before = simulated if base == hardware else simulate(plan, profile, hardware)
    cal = fit_hardware(measured, simulated, hardware, plan, prior)
    target = float(step_time) if step_time else traced
    fitted = simulate(plan, profile, cal.hardware, with_timeline=False).iteration_time
    cal.hardware, factor, note = close_step(plan, profile, cal.hardware, target)
    if note:
        cal.notes.append(note)
    after = simulate(plan, profile, cal.hardware)
    cal.table = kind_table(measured, before, cal.fitted, after)
    cal.iteration = {"measured": traced, "traced_steps": len(steps), "target": target, "settled": bool(step_time),
                     "before": before.iteration_time,
                     "fitted": fitted, "after": after.iteration_time, "scale": factor,
                     "measured_idle": idle_time(measured), "before_idle": idle_time(before),
                     "after_idle": idle_time(after)}
    return cal


#: Relative step-time error below which :func:`close_step` leaves the fitted terms as they are.
CLOSE_TOLERANCE = 1e-3


#: Hardware fields that time something, by how: multiplied (seconds, factors on seconds) or divided
#: (bandwidths) by :func:`scaled`'s factor.
TIME_FIELDS = ("compute_scale", "issue_overhead_s", "h2d_latency_s", "d2h_latency_s", "p2p_latency_s",
               "collective_latency_s", "cpu_optimizer_scale", "cpu_optimizer_call_s", "gpu_optimizer_call_s",
               "gpu_optimizer_tensor_s", "instruction_gap_s", "host_instruction_s")
RATE_FIELDS = ("h2d_bandwidth", "d2h_bandwidth", "link_bandwidth", "p2p_bandwidth", "host_copy_bandwidth",
               "gpu_optimizer_bandwidth", "collective_bandwidth", "network_bandwidth")


def scaled(hardware: Hardware, factor: float) -> Hardware:
    """``hardware`` with every event taking ``factor`` times as long: each time term multiplied, each
    bandwidth divided (one left out, None, or 0 stays so). The simulator then plays every plan's
    schedule stretched by ``factor``: same order, same memory, every duration scaled."""
    changes = {f: getattr(hardware, f) * factor for f in TIME_FIELDS}
    changes.update({f: getattr(hardware, f) / factor for f in RATE_FIELDS if getattr(hardware, f)})
    return dataclasses.replace(hardware, **changes)


def close_step(plan, profile, hardware: Hardware, target: float, tolerance: float = CLOSE_TOLERANCE
               ) -> tuple[Hardware, float, str]:
    """Scale every time term (:func:`scaled`) by one factor so that ``plan``'s simulated step takes
    ``target`` seconds; return the hardware, the factor and a note ("" when none was needed).

    The per-event fit prices each kind of work as one traced step timed it; the step to close on is
    the median of the untraced ones, and on a shared machine the two differ by what the machine did
    meanwhile (5-15 % over minutes on a 2-core VM), which slows every kind of work alike. So the
    residual is closed by a factor on every term, which keeps the fitted terms' proportions: a shift of
    each instruction's fixed cost instead (tried first) took the per-instruction cost to 0 where the
    traced step happened to be slow, and plans of many instructions (naive swapping, L2L) were then
    predicted fast (benchmarks/bench_closing.py: 24 of 30 plans within 10 % with the shift, 28 with
    the factor, on the same measurements)."""
    from .sim.simulator import simulate

    now = simulate(plan, profile, hardware, with_timeline=False).iteration_time
    if not target > 0 or not now > 0 or abs(now / target - 1) <= tolerance:
        return hardware, 1.0, ""
    factor = target / now
    for _ in range(5):          # exact up to the simulator's float sums; checked, never assumed
        t = simulate(plan, profile, scaled(hardware, factor), with_timeline=False).iteration_time
        if abs(t / target - 1) <= tolerance / 10:
            break
        factor *= target / t
    return (scaled(hardware, factor), factor, f"the step: {now * 1e3:.3f} ms simulated after the per-event fit "
            f"against {target * 1e3:.3f} ms measured; every time term scaled by {factor:.4f} to close it")


def kind_table(measured: Timeline | Sequence[Timeline], before: Timeline, fitted: dict[str, float] | None = None,
               after: Timeline | None = None) -> pd.DataFrame:
    """Busy seconds by kind of work (all ranks): measured, simulated before, and where given the fitted
    formulas' prediction and the simulation on the fitted hardware; with measured / predicted (of
    several measured steps, the median per kind)."""
    m, b = busy_by_work(measured), busy_by_work(before)
    a = busy_by_work(after) if after is not None else {}
    rows = []
    for work in WORK:
        if work not in m and work not in b:
            continue
        row = {"kind": work, "measured_s": m.get(work, 0.0), "simulated_s": b.get(work, 0.0)}
        row["ratio"] = _ratio(row["measured_s"], row["simulated_s"])
        if fitted is not None:
            row["fitted_s"] = fitted.get(work, 0.0)
            row["fitted_ratio"] = _ratio(row["measured_s"], row["fitted_s"])
        if after is not None:
            row["simulated_after_s"] = a.get(work, 0.0)
            row["after_ratio"] = _ratio(row["measured_s"], row["simulated_after_s"])
        rows.append(row)
    return pd.DataFrame(rows)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def promise(measured: Timeline, simulated: Timeline) -> pd.DataFrame:
    """Whether a run kept its plan's promise: busy seconds by kind of work, measured against simulated."""
    return kind_table(measured, simulated)


def format_table(table: pd.DataFrame) -> str:
    """A kind table for the terminal: milliseconds and ratios, blanks where there is nothing to divide."""
    heads = {"kind": "kind", "measured_s": "measured ms", "simulated_s": "simulated ms", "ratio": "ratio",
             "fitted_s": "fitted ms", "fitted_ratio": "ratio", "simulated_after_s": "re-simulated ms",
             "after_ratio": "ratio"}
    cols = [c for c in heads if c in table]
    cells = [[heads[c] for c in cols]]
    for row in table.itertuples(index=False):
        out = []
        for c in cols:
            v = getattr(row, c)
            if c == "kind":
                out.append(str(v))
            elif c.endswith("ratio"):
                out.append("" if math.isnan(v) else f"{v:.2f}")
            else:
                out.append(f"{v * 1e3:.3f}")
        cells.append(out)
    widths = [max(len(r[i]) for r in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in cells)
