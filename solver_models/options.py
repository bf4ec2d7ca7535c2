"""What a user asks of the planner (PlannerOptions) and the configurations it then searches."""
from __future__ import annotations

import dataclasses
import math


from harmony_opt.planners.baselines import feasible_sizes
from harmony_opt.core.errors import UsageError
from harmony_opt.core.hardware import Hardware
from harmony_opt.core.plan import data_shares
from harmony_opt.core.profile import Profile

from .tasks import Config


@dataclasses.dataclass
class PlannerOptions:
    mode: str = "auto"              # auto | vPP | vDP
    gpus: int | None = None         # None: try 1 .. hardware.gpus
    time_limit: float = 10.0        # work seconds for the whole search (deterministic accounting, see Budget)
    wall_limit: float | None = None  # wall-clock seconds at most (None: none); plans depend on the machine
                                     # where it binds (plan.solver["stopped_by_wall"] says so)
    seed: int = 0
    workers: int = 1                # CP-SAT workers; >1 runs interleaved (deterministic) search
    processes: int = 1              # processes for Harmony's hint, the first solutions, the local search and
                                    # the simulator's descent: the same plan, sooner (processes)
    rel_gap: float = 1e-3
    harmony_space: bool = False     # Harmony's space: its mode and GPUs, u_fwd >= u_bwd, sizes dividing the batch
    uneven: bool = True             # also microbatch sizes that do not divide the batch (searched after those
                                    # that do: first_solutions' tiers); False: dividing sizes only
    hint: bool = True               # warm start from Harmony's search
    options: bool = True            # search per-pack recompute/stash and CPU/GPU optimizer (off in harmony_space)
    cost_model: str = "default"     # the simulator that judges candidates: default | harmony
    gpu_handoff: bool = True        # may keep gradients between single-microbatch backward packs on the GPU
    shapes: bool = True             # solve small vPP configurations shape by shape (steps/improve.py exact_shapes);
                                    # False: CP-SAT's position model and the local search only


def validate(opts: PlannerOptions, hw: Hardware, batch: int) -> None:
    if opts.mode not in ("auto", "vPP", "vDP"):
        raise UsageError(f"--mode must be auto, vPP or vDP, got {opts.mode!r}")
    if opts.gpus is not None and not 1 <= opts.gpus <= hw.gpus:
        raise UsageError(f"--gpus {opts.gpus}: hardware {hw.name!r} has {hw.gpus} GPU(s)")
    if batch < 1:
        raise UsageError(f"--batch must be >= 1, got {batch}")
    if not 0 < opts.time_limit < math.inf:
        raise UsageError(f"--time-limit must be > 0 seconds, got {opts.time_limit}")
    if opts.processes < 1:
        raise UsageError(f"--processes must be >= 1, got {opts.processes}")
    if opts.wall_limit is not None and not 0 < opts.wall_limit < math.inf:
        raise UsageError(f"--wall-limit must be > 0 seconds, got {opts.wall_limit}")
    if opts.cost_model not in ("default", "harmony"):
        raise UsageError(f"--cost-model must be default or harmony, got {opts.cost_model!r}")


def _sizes(sizes: list[int], share: int) -> list[int]:
    """Of the sizes giving the same number of microbatches, the smallest (= the most even split):
    a larger one only adds memory and makes the last microbatch smaller."""
    best = {}
    for u in sorted(sizes):
        best.setdefault(-(-share // u), u)
    return sorted(best.values())


def configurations(profile: Profile, hw: Hardware, batch: int, opts: PlannerOptions) -> list[Config]:
    modes = ("vPP", "vDP") if opts.mode == "auto" else (opts.mode,)
    if opts.harmony_space:
        gpu_counts = [opts.gpus or hw.gpus]
    else:
        gpu_counts = [opts.gpus] if opts.gpus else list(range(1, hw.gpus + 1))
    out = []
    for mode in modes:
        for n in gpu_counts:
            if mode == "vDP" and n > batch:
                continue
            if mode == "vDP" and n == 1 and "vPP" in modes:
                continue        # identical to vPP on one GPU
            if mode == "vDP" and n > 1 and hw.servers_used(n) > 1 and not hw.can_allreduce(n):
                continue        # replicas on several servers need GPU links to all-reduce (Plan.check_against)
            share = batch if mode == "vPP" else min(data_shares(batch, n))
            div = not opts.uneven or opts.harmony_space
            ub = _sizes(feasible_sizes(profile, batch, mode, n, "BWD", divisors_only=div), share)
            uf = _sizes(feasible_sizes(profile, batch, mode, n, "FWD", divisors_only=div), share)
            out += [Config(mode, n, f, b) for b in ub for f in uf if not (opts.harmony_space and f < b)]
    return out
