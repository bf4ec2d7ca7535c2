"""Starting points for the CP-SAT models: balanced packings and a local search on the model.

The vPP pipeline model (pipeline.py) has a weak LP relaxation, so CP-SAT needs a good
first solution. The recurrence it encodes is cheap to evaluate (``timing.evaluate``,
microseconds), so a few thousand steps of local search find one: starting from packs
balanced by compute time (and from the hint, e.g. Harmony's plan; for the best configurations
also from the packs that minimise the largest pack, ``partitioned``), move one pack boundary,
split a pack or merge two, and keep the change when the model says the iteration is no
slower. The random choices come from a seeded generator and the number of steps is fixed,
so the result is deterministic.
"""
from __future__ import annotations

import random

import numpy as np

from .tasks import B, C, F, Tasks, min_packs
from .timing import evaluate, sequence_of


def _cut_packs(cuts: list[int], lo: int, hi: int) -> list[tuple[int, int]]:
    """Packs [lo, hi] cut before each of ``cuts`` (sorted, inside (lo, hi])."""
    b = [lo] + [c for c in cuts if lo < c <= hi] + [hi + 1]
    return [(b[i], b[i + 1] - 1) for i in range(len(b) - 1)]


def _sequence(tasks: Tasks, fcuts, bcuts, s: int, opts=None) -> list[int] | None:
    """The task sequence of forward cuts, backward cuts and the criterion start s; None if a
    pack is not a candidate (too large, or not between candidate boundaries)."""
    R = tasks.num_layers
    fwd = _cut_packs(fcuts, 0, s - 1) if s > 0 else []
    bwd = (_cut_packs(bcuts, 0, s - 1) if s > 0 else []) + [(s, R - 1)]
    opts = opts or {}
    try:
        return sequence_of(tasks, fwd, bwd, [opts.get(p, (True, False)) for p in bwd])
    except KeyError:
        return None


def balanced(tasks: Tasks, profile, n_fwd: int, n_bwd: int, s: int) -> list[int] | None:
    """Forward and backward packs of about equal compute time over layers 0..s-1 (at the candidate
    boundaries nearest to equal shares), the criterion pack [s, R-1]."""
    return _sequence(tasks, _equal_cuts(tasks, profile, "FWD", n_fwd, s),
                     _equal_cuts(tasks, profile, "BWD", n_bwd, s), s)


def _equal_cuts(tasks: Tasks, profile, phase: str, k: int, s: int) -> list[int]:
    """The candidate boundaries nearest to k equal shares of layers 0..s-1's compute time."""
    if s <= 0 or k <= 1:
        return []
    u = tasks.cfg.u_fwd if phase == "FWD" else tasks.cfg.u_bwd
    t = profile.costs(phase, u).pack_time(0, np.arange(-1, s))     # prefix sums of the layer times
    cuts = tasks.cuts
    pos = np.clip(np.searchsorted(t, t[-1] * np.arange(1, k) / k), 1, s - 1)
    snapped = cuts[np.clip(np.searchsorted(cuts, pos), 0, len(cuts) - 1)]
    return sorted({int(c) for c in snapped if 0 < c < s})


def minmax_cuts(prefix: np.ndarray, most: int) -> np.ndarray:
    """``arg[k, i]``: where the last of k packs starts in the packing of blocks [0, i) into k packs
    that minimises the largest pack (``prefix[i]``: the time of blocks [0, i)); the classic linear
    partition DP, every k up to ``most`` at once (O(most M^2), vectorised). Read a packing off
    with :func:`_read_cuts`."""
    M = len(prefix)
    span = prefix[None, :] - prefix[:, None]            # span[j, i]: blocks [j, i)
    span[np.tril_indices(M)] = np.inf                   # a pack holds at least one block
    best = np.full(M, np.inf)
    best[0] = 0.0
    arg = np.zeros((most + 1, M), int)
    for k in range(1, most + 1):
        vals = np.maximum(best[:, None], span)
        arg[k] = np.argmin(vals, axis=0)
        best = vals[arg[k], np.arange(M)]
    return arg


def _read_cuts(arg: np.ndarray, i: int, k: int) -> list[int]:
    """The block boundaries inside [0, i) of ``minmax_cuts``'s packing into k packs."""
    out = []
    for kk in range(k, 0, -1):
        i = int(arg[kk, i])
        out.append(i)
    return sorted(b for b in out if b > 0)


def partitioned(tasks: Tasks, profile, counts: list[int], crit_starts: list[int]) -> tuple[list, int]:
    """Sequences whose forward and backward packs over layers [0, s - 1] minimise the largest pack's
    compute time for the given pack counts (at candidate boundaries; ``balanced`` snaps equal shares
    to the nearest ones, which can leave some packs a block heavier than their neighbours, and in
    vPP the heaviest pack of each round of N sets the round's length). Returns [(model value,
    sequence)], work."""
    cuts = tasks.cuts
    most = max(counts)
    args = {}
    for phase, u in (("FWD", tasks.cfg.u_fwd), ("BWD", tasks.cfg.u_bwd)):
        t = profile.costs(phase, u).pack_time(0, np.arange(-1, tasks.num_layers))
        args[phase] = minmax_cuts(t[cuts], min(most, len(cuts) - 1))
    pos = {int(c): i for i, c in enumerate(cuts)}
    out, work = [], 0
    for s in crit_starts:
        i = pos.get(int(s))
        if not i:
            continue
        for nf in counts:
            for nb in counts:
                if max(nf, nb) > i:
                    continue
                f = [int(cuts[b]) for b in _read_cuts(args["FWD"], i, nf)]
                b = [int(cuts[b]) for b in _read_cuts(args["BWD"], i, nb)]
                seq = _sequence(tasks, f, b, int(s))
                if seq is not None:
                    work += len(seq)
                    out.append((evaluate(tasks, seq), seq))
    return [o for o in out if np.isfinite(o[0])], work


def partition_grid(tasks: Tasks, seq: list[int]) -> tuple[list[int], list[int]]:
    """Pack counts and criterion starts around a sequence's, for :func:`partitioned`: its own
    counts scaled by a few factors and multiples of N; its criterion start, the candidate start
    either side and the largest (a small criterion pack shortens vPP's serial path)."""
    t = tasks.table
    nf = sum(1 for k in seq if t.kind[k] == F)
    nb = len(seq) - nf - 1
    n = tasks.cfg.ranks
    counts = sorted({max(1, int(round(x * f))) for x in (max(nf, 1), max(nb, 1)) for f in (0.75, 1, 1.5)}
                    | {n * k for k in (2, 4, 8, 16)})
    crit = np.unique(t.start[t.kind == C]).tolist()
    s = int(t.start[seq[nf]])
    i = crit.index(s) if s in crit else len(crit) - 1
    return counts, sorted({crit[j] for j in range(max(0, i - 1), min(len(crit), i + 2))} | {crit[-1]})


def starts(tasks: Tasks, profile, hint: list[int] | None = None, tries: int = 6) -> tuple[list, int]:
    """Candidate first solutions, best first: the hint and balanced packings over a grid of
    pack counts and criterion-pack sizes; and the work done (tasks evaluated)."""
    t = tasks.table
    crit = np.unique(t.start[t.kind == C])
    out = []
    if hint is not None:
        out.append((evaluate(tasks, hint), list(hint)))
    fewest_f, fewest_b = min_packs(tasks, F), min_packs(tasks, B)
    idx = tasks.table.index()
    for s in sorted({int(crit[0]), int(crit[min(len(crit) - 1, 1)]), int(crit[len(crit) // 4])}):
        out += _grid_at(tasks, profile, s, fewest_f, fewest_b, idx)
    work = sum(len(seq) for _, seq in out)
    out = [o for o in out if np.isfinite(o[0])]
    out.sort(key=lambda o: o[0])
    uniq, seen = [], set()
    for v, seq in out:
        if tuple(seq) not in seen:
            seen.add(tuple(seq))
            uniq.append((v, seq))
    return uniq[:tries], work


def _grid_at(tasks: Tasks, profile, s: int, fewest_f, fewest_b, idx) -> list:
    """[(value, sequence)] of the balanced packings with the criterion pack [s, R-1], over a grid of
    pack counts (powers of 2, multiples of N) and those around the fewest packs memory allows
    (equal-time packs may need a few more)."""
    n = tasks.cfg.ranks
    grid = {1, 2, 4, 8, 16, 32, n, 2 * n, 3 * n, 4 * n}
    least = [int(m) for m in (fewest_f[s], fewest_b[s]) if 0 < m < 10**9]
    counts = sorted(grid | {int(np.ceil(m * f)) for m in least for f in (1, 1.25, 1.5, 2)})
    return [(evaluate(tasks, seq), seq) for _, _, seq in balanced_grid(tasks, profile, counts, s, idx)]


def short_path_start(tasks: Tasks, profile) -> tuple[float, list[int] | None, int]:
    """The best of the balanced packings with the smallest criterion pack and of one pack per candidate
    boundary: where as many microbatches as GPUs pass a vPP pipeline, the serial path is shortest
    there, and the descents from ``starts`` (their criterion packs the largest) stay near theirs.
    (value, sequence or None, work: tasks evaluated)."""
    t = tasks.table
    s = int(t.start[t.kind == C].max(initial=0))
    if s <= 0:
        return float("inf"), None, 0
    out = _grid_at(tasks, profile, s, min_packs(tasks, F), min_packs(tasks, B), tasks.table.index())
    inner = [int(c) for c in tasks.cuts if 0 < c < s]
    fine = _sequence(tasks, inner, inner, s)
    if fine is not None:
        out.append((evaluate(tasks, fine), fine))
    work = sum(len(seq) for _, seq in out)
    return (*min(out, key=lambda o: o[0]), work) if out else (float("inf"), None, work)


def balanced_grid(tasks: Tasks, profile, counts: list[int], s: int, idx: dict | None = None):
    """(n_fwd, n_bwd, ``balanced(tasks, profile, n_fwd, n_bwd, s)``) for every pair of counts where
    that is a sequence, each phase's packs computed and looked up once per count."""
    idx = tasks.table.index() if idx is None else idx

    def rows(kind, phase):          # {count: its packs' rows, None if one is not a candidate}
        return {n: _rows(idx, kind, _cut_packs(_equal_cuts(tasks, profile, phase, n, s), 0, s - 1) if s > 0 else [])
                for n in counts}
    fwd, bwd = rows(F, "FWD"), rows(B, "BWD")
    crit_row = idx.get((C, s, tasks.num_layers - 1, True, False))
    if crit_row is None:
        return
    for nf in counts:
        for nb in counts:
            if fwd[nf] is not None and bwd[nb] is not None:
                yield nf, nb, fwd[nf] + [crit_row] + bwd[nb][::-1]


def _rows(idx: dict, kind: int, packs: list[tuple[int, int]]) -> list[int] | None:
    """The rows of ``packs`` of one kind (recomputed, optimizer on the CPU), None if one is not a candidate."""
    rows = [idx.get((kind, a, b, True, False)) for a, b in packs]
    return None if None in rows else rows


def _parts(tasks: Tasks, seq: list[int]):
    """(forward cuts, backward cuts, criterion start, options by pack) of a sequence."""
    t = tasks.table
    fwd = [int(t.start[k]) for k in seq if t.kind[k] == F][1:]
    bks = [k for k in seq if t.kind[k] != F]
    bwd = sorted(int(t.start[k]) for k in bks[1:])
    opts = {(int(t.start[k]), int(t.end[k])): (bool(t.recompute[k]), bool(t.gpu_opt[k])) for k in bks}
    return fwd, bwd, int(t.start[bks[0]]), opts


def neighbours(tasks: Tasks, seq: list[int]):
    """Every sequence one step away, in a fixed order: one pack boundary (forward, backward, or the
    criterion pack's start) moved to the next candidate boundary either way, or one backward
    pack's optimizer placement toggled. For a descent judged by the simulator."""
    cuts = tasks.cuts.tolist()
    pos = {c: i for i, c in enumerate(cuts)}
    fwd, bwd, s, opts = _parts(tasks, seq)
    seen = {tuple(seq)}

    def emit(f, b, s0, o):
        cand = _sequence(tasks, sorted(set(f)), sorted(set(b)), s0, o)
        if cand is not None and tuple(cand) not in seen:
            seen.add(tuple(cand))
            return cand
        return None
    for step in (-1, 1):
        i = pos[s] + step
        if 0 < i < len(cuts) - 1 and (cand := emit(fwd, bwd, cuts[i], opts)) is not None:
            yield cand
    for which in ("f", "b"):
        lst = fwd if which == "f" else bwd
        for j in range(len(lst)):
            for step in (-1, 1):
                i = pos[lst[j]] + step
                if not 0 < i < len(cuts) - 1:
                    continue
                moved = lst[:j] + [cuts[i]] + lst[j + 1:]
                cand = emit(moved, bwd, s, opts) if which == "f" else emit(fwd, moved, s, opts)
                if cand is not None:
                    yield cand
    if tasks.table.gpu_opt.any():
        for p in _cut_packs(bwd, 0, s - 1) + [(s, tasks.num_layers - 1)]:
            rec, gpu = opts.get(p, (True, False))
            cand = emit(fwd, bwd, s, {**opts, p: (rec, not gpu)})
            if cand is not None:
                yield cand


def held_firsts(tasks: Tasks, seq: list[int], s: int) -> list[list[int]]:
    """First packings for a descent with the criterion start held at ``s``: ``seq``'s packs cut below
    it (its options kept), and one pack per candidate boundary; those whose packs are candidates."""
    fwd, bwd, _, opts = _parts(tasks, seq)
    fine = [int(c) for c in tasks.cuts if 0 < c < s]
    firsts = (_sequence(tasks, [c for c in fwd if c < s], [c for c in bwd if c < s], s, opts),
              _sequence(tasks, fine, fine, s))
    return [q for q in firsts if q is not None]


def starts_around(tasks: Tasks, seq: list[int], steps: int, seed: int = 0, around: int = 3):
    """Per criterion start within ``around`` candidate boundaries of ``seq``'s (nearest first), the
    better of two descents with that start held: from ``seq``'s packs cut below it, and from one pack
    per candidate boundary. Yields (start, model value, sequence, work: tasks evaluated, descents run).

    The descent moves the start one step at a time and keeps no move the model rates slower, but a
    moved start pays off only once the packs around it are dealt again (gpt2_medium D=64 vPP x4
    u=4/8: 10.90 s at its start 25; held at 26, 10.80 s, simulated 1.1 % faster)."""
    cuts = tasks.cuts.tolist()
    i0 = cuts.index(_parts(tasks, seq)[2])
    for i in sorted(range(max(1, i0 - around), min(len(cuts) - 1, i0 + around + 1)), key=lambda i: (abs(i - i0), i)):
        s = cuts[i]
        if i == i0:
            continue
        best, work, runs = (float("inf"), None), 0, 0
        for first in held_firsts(tasks, seq, s):
            v, q, w = improve(tasks, first, steps, seed=seed, hold_start=True)
            work, runs = work + w, runs + 1
            if v < best[0]:
                best = (v, q)
        yield s, best[0], best[1], work, runs


def improve(tasks: Tasks, seq: list[int], steps: int, seed: int = 0, hold_start: bool = False
            ) -> tuple[float, list[int], int]:
    """Local search from ``seq``: move, add or remove one pack boundary (or toggle a backward pack's
    optimizer placement); keep changes the model rates no slower. Deterministic for a seed.
    ``hold_start``: the criterion pack's start stays (to weigh a bound per start against the plans
    of that start). Returns (model value, sequence, work: tasks evaluated)."""
    rng = random.Random(seed)
    t = tasks.table
    cuts = tasks.cuts.tolist()
    pos = {c: i for i, c in enumerate(cuts)}
    fwd, bwd, s, opts = _parts(tasks, seq)
    best_v, best = evaluate(tasks, seq), list(seq)
    cur = (fwd, bwd, s)
    work = len(seq)
    if len(cuts) < 3:
        return best_v, best, work       # one layer: a single plan, nothing to search
    for _ in range(steps):
        f, b, s0 = list(cur[0]), list(cur[1]), cur[2]
        r = rng.random()
        if r < 0.1 and hold_start:
            continue
        if r < 0.1:        # move the criterion pack's start
            i = pos.get(s0, 0) + rng.choice((-2, -1, 1, 2))
            if not 0 < i < len(cuts) - 1:
                continue
            s0 = cuts[i]
        else:
            lst = f if r < 0.5 else b
            op = rng.random()
            if op < 0.6 and lst:
                j = rng.randrange(len(lst))
                i = pos[lst[j]] + rng.choice((-1, 1)) * rng.choice((1, 1, 2, 3, 5))
                if not 0 < i < len(cuts):
                    continue
                lst[j] = cuts[i]
            elif op < 0.8:
                lst.append(cuts[rng.randrange(1, len(cuts) - 1)])
            elif lst:
                lst.pop(rng.randrange(len(lst)))
            lst[:] = sorted(set(lst))
        new_opts = dict(opts)
        if rng.random() < 0.15 and t.gpu_opt.any():
            packs = _cut_packs(b, 0, s0 - 1) + [(s0, tasks.num_layers - 1)]
            p = packs[rng.randrange(len(packs))]
            rec, gpu = new_opts.get(p, (True, False))
            new_opts[p] = (rec, not gpu)
        cand = _sequence(tasks, f, b, s0, new_opts)
        if cand is None:
            continue
        v = evaluate(tasks, cand)
        work += len(cand)
        if v <= best_v:
            cur, opts = (f, b, s0), new_opts
            best_v, best = v, cand
    return best_v, best, work
