"""Small planner instances shared by the planner's test files: synthetic profiles, a cap, a configuration, and every plan of one (the exact optimum by enumeration)."""
from __future__ import annotations


from harmony_opt import get_hardware
from harmony_opt.solver_models.tasks import Config
from harmony_opt.solver_models.timing import evaluate

from conftest import synthetic_profile


def instance(R, seed, uf, ub, tight, gpus=1, mode=None, act_scale=1):
    prof = synthetic_profile(R=R, seed=seed, act_scale=act_scale)
    hw = get_hardware("1080ti-x4").with_gpus(gpus)
    full = int(prof.costs("BWD", ub).pack_memory(0, R - 1))
    single = max(int(prof.costs(ph, u).memory.max()) for ph, u in (("BWD", ub), ("FWD", uf)))
    cap = max(single, int(full * tight))
    cfg = Config(mode or ("vDP" if gpus > 1 else "vPP"), gpus, uf, ub)
    return prof, hw, cap, cfg


def every_plan(tasks):
    """Every plan of a small configuration (either mode), as task sequences in chain order: each
    criterion pack that fits,
    every packing of the layers before it into forward packs and into backward packs, every variant
    of every backward pack."""
    import itertools
    t, R = tasks.table, tasks.num_layers
    rows = {}
    for k in range(len(t)):
        rows.setdefault((int(t.kind[k]), int(t.start[k]), int(t.end[k])), []).append(k)

    def packings(kind, s):
        for k in range(s):
            for inner in itertools.combinations(range(1, s), k):
                cuts = [0, *inner, s]
                packs = [(kind, a, c - 1) for a, c in zip(cuts, cuts[1:])]
                if all(p in rows for p in packs):
                    yield packs
        if s == 0:
            yield []
    for s in range(R):
        for crit in rows.get((1, s, R - 1), []):
            for fwd in packings(0, s):
                for bwd in packings(2, s):
                    for variants in itertools.product(*(rows[p] for p in reversed(bwd))):
                        yield [rows[p][0] for p in fwd] + [crit, *variants]


def stashed(tasks, seq):
    """``seq`` with each backward pack switched to its stash variant where one exists and fits."""
    idx, t = tasks.table.index(), tasks.table
    out = list(seq)
    for p, k in enumerate(out):
        kind, a, b, _, gpu = t.key(k)
        alt = idx.get((kind, a, b, False, gpu))
        if alt is not None:
            trial = out[:p] + [alt] + out[p + 1:]
            if evaluate(tasks, trial) < float("inf"):
                out = trial
    return out


def stash_friendly(R=8, saved_scale=1):
    """Forward-heavy layers whose saved activations are small: stashing beats recomputing (unless
    ``saved_scale`` makes them large)."""
    prof = synthetic_profile(R=R, seed=2)
    micro = prof.microbatch.copy()
    micro["saved_bytes"] = micro["input_bytes"] * saved_scale     # saved == the input: cheap to move
    fwd = micro.phase == "FWD"
    micro.loc[fwd, "gpu_time_s"] *= 20                   # the recompute is expensive
    micro.loc[~fwd, "gpu_time_s"] = micro.loc[~fwd, "gpu_time_s"] + micro.loc[fwd, "gpu_time_s"].to_numpy()
    return type(prof)(prof.name, prof.layers, micro, prof.meta)
