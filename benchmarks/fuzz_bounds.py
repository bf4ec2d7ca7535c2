"""Soak the planner's bounds: every bound against the exact optimum, every reported bound against what it bounds.

tests/test_bounds.py checks a fixed, derandomized set of examples on every CI run; this runs the same
checks on as many fresh draws as the time allows, on one to four GPUs, with and without the
hardware's execution terms (docs/cost_model.md), on two kinds of profile:

* CPU-like random profiles (tests/test_bounds.py's ``cpu_like_profile``: tiny layers beside large
  ones, an embedding larger than the rest together, times that rise and fall with the microbatch
  size, backward passes faster than their forward, buffers in the last layer);
* measured profiles (``--profiles DIR ...``, from ``harmony-opt profile --device cpu``): for the exact
  optimum, a few of their layers (the first, the last and some between, renumbered), as enumerating
  every plan of more than six layers takes minutes.

Two checks, each counted and each failure printed with the draw that replays it:

* ``exact``: compute_floor <= config_bound, and config_bound, pipeline_path_bound, pipeline_gpu_bound
  and vpp_bound at most the exact optimum of their configuration's model (every plan enumerated),
  stash variants on and off;
* ``planner``: ``plan()``'s bound for the chosen configuration at most its objective (and, for a vPP
  configuration of up to six layers, at most every plan of it, enumerated), its bound over every
  configuration at most the chosen objective, and its lower bound over all plans at most the
  simulated time.

    .venv/bin/python benchmarks/fuzz_bounds.py --part exact --minutes 10 --seed 1 \\
        --profiles DIR ... --out benchmarks/results/fuzz_bounds_exact.md
    .venv/bin/python benchmarks/fuzz_bounds.py --part planner --minutes 10 --seed 1 \\
        --profiles DIR ... --out benchmarks/results/fuzz_bounds_planner.md

Exit code 1 when any check failed.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import random
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))     # the checks and the profile generator of tests/test_bounds.py

from test_bounds import TERM_CHOICES, check_configuration, check_plan_bounds, instance, server  # noqa: E402

from harmony_opt.core.errors import HarmonyOptError  # noqa: E402
from harmony_opt.core.io import atomic_write_text  # noqa: E402
from harmony_opt.core.profile import Profile  # noqa: E402
from harmony_opt.report import markdown_table  # noqa: E402
from harmony_opt.solver_models.options import configurations  # noqa: E402
from harmony_opt.solver_models.planner import PlannerOptions  # noqa: E402

def some_layers(profile: Profile, keep: list[int]) -> Profile:
    """``profile`` cut down to the layers ``keep`` (sorted), renumbered from 0."""
    index = {old: new for new, old in enumerate(keep)}
    layers = profile.layers[profile.layers.layer.isin(keep)].copy()
    micro = profile.microbatch[profile.microbatch.layer.isin(keep)].copy()
    layers["layer"], micro["layer"] = layers.layer.map(index), micro.layer.map(index)
    return Profile(f"{profile.name}[{','.join(map(str, keep))}]", layers.reset_index(drop=True),
                   micro.reset_index(drop=True), dict(profile.meta))


def draw(rng: random.Random, measured: list[Profile], most_layers: int, exact: bool):
    """(label, profile, hardware, memory cap, batch) of one example."""
    batch = rng.choice([2, 4, 6, 8] if exact else [4, 8, 16])
    gpus, tight = rng.choice([1, 2, 3, 4]), rng.uniform(0.3, 2.0 if exact else 3.0)
    link, p2p = rng.choice([5e7, 5e8, 6e9, 5e10]), rng.choice([0.0, 1e10])
    if measured and rng.random() < 0.5:
        profile = rng.choice(measured)
        R = profile.num_layers
        if exact and R > most_layers:
            inner = sorted(rng.sample(range(1, R - 1), most_layers - 2))
            profile = some_layers(profile, [0, *inner, R - 1])
        R = profile.num_layers
        full = int(profile.costs("BWD", int(profile.sizes("BWD")[0])).pack_memory(0, R - 1))
        single = max(int(profile.costs(ph, int(profile.sizes(ph)[-1])).memory.max()) for ph in ("FWD", "BWD"))
        cap = max(single, int(full * tight))
        label = f"{profile.name} gpus={gpus} link={link:g} p2p={p2p:g} batch={batch} tight={tight:.4f}"
        return label, profile, server(gpus, link, cap, p2p), cap, batch
    R, seed = rng.randint(3, most_layers), rng.randrange(10**6)
    sizes = [sorted({1, *rng.sample([2, 3, 4, 6, 8], rng.randint(0, 3))}) for _ in range(2)] if exact \
        else [[1, 2, 4, 8]] * 2
    profile, hw, cap = instance(R, seed, *sizes, gpus, link, p2p, batch, tight)
    return f"instance({R}, {seed}, {sizes[0]}, {sizes[1]}, {gpus}, {link:g}, {p2p:g}, {batch}, {tight!r})", \
        profile, hw, cap, batch


def check_exact(rng, profile, hw, cap, batch) -> int:
    """Every bound of up to two configurations against the exact optimum; the checks made."""
    configs = configurations(profile, hw, batch, PlannerOptions(uneven=True))
    done = 0
    for cfg in rng.sample(configs, min(2, len(configs))):
        for stash in (False, True):
            check_configuration(profile, hw, batch, cfg, cap, stash)
            done += 1
    return done


def check_planner(rng, profile, hw, cap, batch) -> int:
    """The planner's reported bounds against what they bound; 1 if it planned, 0 if infeasible."""
    return int(check_plan_bounds(profile, hw, batch, cap, rng.choice(["auto", "vPP", "vPP", "vDP"])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("exact", "planner"), required=True)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-layers", type=int, default=None,
                    help="layers of a random profile at most (default: 5 for exact, 30 for planner)")
    ap.add_argument("--profiles", nargs="*", default=[], help="measured profile folders drawn from half the time")
    ap.add_argument("--out", default=None, help="write a markdown summary here")
    args = ap.parse_args(argv)
    if args.minutes <= 0:
        ap.error(f"--minutes {args.minutes}: give a positive time")
    exact = args.part == "exact"
    most = args.max_layers or (5 if exact else 30)
    if most < 3:
        ap.error(f"--max-layers {most}: give at least 3")
    try:
        measured = [Profile.load(p) for p in args.profiles]
    except HarmonyOptError as e:
        ap.error(f"--profiles: {e}")
    rng = random.Random(args.seed)
    counts, failures = collections.Counter(), []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 60 * args.minutes:
        label, profile, hw, cap, batch = draw(rng, measured, most, exact)
        terms = {k: rng.choice(v) for k, v in TERM_CHOICES.items()} if rng.random() < 0.5 else {}
        hw = dataclasses.replace(hw, **terms)
        kind = "measured" if label.startswith(tuple(p.name for p in measured)) else "random"
        try:
            done = (check_exact if exact else check_planner)(rng, profile, hw, cap, batch)
            counts[(kind, "checked")] += done
        except AssertionError as e:
            counts[(kind, "FAIL")] += 1
            failures.append((label, terms, repr(e)[:400]))
            print(f"FAIL {label} terms={terms}: {repr(e)[:400]}", flush=True)
    wall = time.perf_counter() - t0
    what = "configuration-and-stash checks against the exact optimum" if exact else "plans checked"
    rows = pd.DataFrame([dict(profiles=k, checked=counts[(k, "checked")], failed=counts[(k, "FAIL")])
                         for k in ("random", "measured")])
    print(f"{int(rows.checked.sum())} {what} in {wall:.0f} s, {len(failures)} failed")
    print(rows.to_string(index=False))
    if args.out:
        cmd = " ".join(["benchmarks/fuzz_bounds.py"] + (argv if argv is not None else sys.argv[1:]))
        lines = [f"# Bounds soak: {args.part}", "", f"Command: `.venv/bin/python {cmd}`", "",
                 f"{int(rows.checked.sum())} {what} in {wall:.0f} s (seed {args.seed}; random profiles of 3 to "
                 f"{most} layers; 1 to 4 GPUs; the hardware's execution terms drawn for half of the examples): "
                 f"**{len(failures)} failed**.", ""]
        if measured:
            lines += ["Measured profiles (`harmony-opt profile NAME --device cpu -u 1,2,4,8 --threads 1 -o NAME` on this "
                      "machine): " + ", ".join(f"{p.name} ({p.num_layers} layers)" for p in measured) + "."
                      + (f" Each example keeps the first, the last and {most - 2} layers between, renumbered." if exact
                         else ""), ""]
        lines += [markdown_table(rows), ""]
        for label, terms, err in failures:
            lines.append(f"- FAIL `{label}` terms `{terms}`: {err}")
        atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
