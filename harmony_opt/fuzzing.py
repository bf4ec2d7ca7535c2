"""Random but valid inputs for the planners, and the contract every planner must keep.

Shared by the property tests (tests/test_fuzz_planners.py, hypothesis draws the
:class:`FuzzCase`) and the soak (benchmarks/fuzz_planners.py, plain seeds), so a
failure found by either is replayed by ``check_case(FuzzCase(...))``.

The contract: every planner either returns a plan that validates, matches
the profile and hardware, round-trips through JSON, simulates under the memory cap
with the iteration time it claims, compiles to a program that holds no more than the cap
(harmony_opt.compile.program_memory.program_memory: what the runtime's guard counts) (and no faster than the baselines' lower bound
:func:`~harmony_opt.planners.baselines.iteration_floor` says), or raises :class:`InfeasibleError`
with a non-empty explanation. Any other exception is a bug.
"""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pandas as pd

from .core.errors import ContractError, InfeasibleError
from .core.hardware import Hardware
from .compile.program_memory import program_memory
from .core.plan import Plan
from .core.profile import Profile
from .core.units import GB, GiB
from .planners.baselines import iteration_floor
from .planners.registry import BASELINES, PLANNERS, get_planner, planner_entry
from .sim.host_memory import activation_ceiling, host_memory, model_host_memory
from .sim.simulator import simulate

PLANNER_NAMES = tuple(PLANNERS)       # every planner of the registry, ours (cp-sat) first
BASELINE_NAMES = BASELINES


@dataclasses.dataclass(frozen=True)
class FuzzCase:
    """Everything that fixes one fuzz example; ``repr`` of it replays the example."""

    layers: int
    seed: int
    batch: int
    gpus: int
    cap_factor: float          # memory cap = cap_factor x the largest single-layer BWD peak at the smallest size
    mode: str = "auto"         # for cp-sat and harmony
    use_gpus: int | None = None
    time_limit: float = 1.0    # CP-SAT seconds
    host_factor: float | None = None   # host memory = the model's + this x the activation ceiling (None: ample)


def random_profile(R: int, seed: int) -> Profile:
    """A profile that passes validation but is otherwise wild: zero-byte and zero-time layers,
    sizes over six orders of magnitude, noisy times, FWD and BWD profiled at different sizes."""
    rng = np.random.default_rng(seed)

    def logu(lo, hi, n):
        return np.exp(rng.uniform(np.log(lo), np.log(hi), n))

    w = np.where(rng.random(R) < 0.15, 0, logu(2**10, 2**30, R)).astype(np.int64)
    buf = np.where(rng.random(R) < 0.8, 0, logu(2**8, 2**22, R)).astype(np.int64)
    k = rng.choice([0, 1, 2], R)
    x = logu(2**8, 2**26, R).astype(np.int64)          # input bytes per sample
    x[rng.random(R) < 0.05] = 0
    out = np.append(x[1:], 0)
    t = np.where(rng.random(R) < 0.05, 0.0, logu(1e-6, 5e-2, R))
    alpha, beta = rng.uniform(0, 1), rng.uniform(0.1, 1)
    layers = pd.DataFrame({"layer": np.arange(R), "param_bytes": w, "buffer_bytes": buf,
                           "optimizer_state_bytes": k * w, "cpu_update_s": w / rng.uniform(1e8, 2e10)})
    pool = np.arange(1, 65)
    from_one = rng.random() < 0.7     # most real profiles start at microbatch 1

    def pick():
        s = rng.choice(pool, rng.integers(1, 6), replace=False)
        return np.unique(np.append(s, 1) if from_one else s)
    fwd_sizes = pick()
    bwd_sizes = fwd_sizes if rng.random() < 0.5 else pick()
    with_saved = rng.random() < 0.5
    frames = []
    for phase, sizes in (("FWD", fwd_sizes), ("BWD", bwd_sizes)):
        for u in sizes:
            act = x * u
            noise = rng.uniform(0.9, 1.1, R)
            time = t * (alpha + beta * u) * noise * (1.0 if phase == "FWD" else rng.uniform(1.5, 4.0))
            saved = (act * rng.uniform(1, 6, R)).astype(np.int64)
            peak = w + buf + act + out * u + (0 if phase == "FWD" else w + saved)
            df = pd.DataFrame({"phase": phase, "microbatch": int(u), "layer": np.arange(R), "gpu_time_s": time,
                               "peak_memory_bytes": peak.astype(np.int64), "input_bytes": act.astype(np.int64)})
            if with_saved:
                df["saved_bytes"] = saved
            frames.append(df)
    return Profile(f"fuzz-R{R}-s{seed}", layers, with_stash_times(pd.concat(frames, ignore_index=True), seed),
                   {"model": "fuzz"})


def with_stash_times(micro: pd.DataFrame, seed: int) -> pd.DataFrame:
    """``micro`` with stash-path times (``stash_time_s``) for half the seeds, drawn from their own stream so
    that the other columns stay what ``seed`` drew before: a stashing forward 1 to 1.6x the plain one, a
    backward from a kept graph 0.1 to 1.2x the recomputing one (a CPU measurement's noise)."""
    rng = np.random.default_rng([seed, 1])
    if rng.random() < 0.5:
        return micro
    fwd = (micro["phase"] == "FWD").to_numpy()
    factor = np.where(fwd, rng.uniform(1.0, 1.6, len(micro)), rng.uniform(0.1, 1.2, len(micro)))
    return micro.assign(stash_time_s=micro["gpu_time_s"].to_numpy() * factor)


def random_hardware(profile: Profile, gpus: int, cap_factor: float, seed: int, host: int = 2**50) -> Hardware:
    """A server whose memory cap is ``cap_factor`` times the largest layer's smallest backward peak,
    with ``host`` bytes of host memory (all of it pinnable, or half where it is ample)."""
    rng = np.random.default_rng(seed + 1)
    u0 = profile.size_range("BWD")[0]
    need = int(profile.costs("BWD", u0).memory.max())
    cap = max(1, int(need * cap_factor))
    h2d = float(rng.uniform(1, 60)) * GB
    shared = bool(rng.random() < 0.7)
    return Hardware(
        name=f"fuzz-{gpus}gpu", gpus=gpus, gpu_memory_bytes=cap, host_memory_bytes=host,
        pinned_memory_bytes=host if host < 2**50 else 2**49,
        h2d_bandwidth=h2d, d2h_bandwidth=float(rng.uniform(1, 60)) * GB, shared_host_link=shared,
        link_bandwidth=h2d * int(rng.integers(1, gpus + 1)) if shared and rng.random() < 0.5 else None,
        p2p_bandwidth=0.0 if rng.random() < 0.4 else float(rng.uniform(1, 100)) * GB,
        host_copy_bandwidth=float(rng.uniform(2, 30)) * GiB, cpu_optimizer_scale=float(rng.uniform(0.3, 3)),
        gpu_optimizer_bandwidth=float(rng.uniform(50, 3000)) * GB)


def build(case: FuzzCase) -> tuple[Profile, Hardware]:
    profile = random_profile(case.layers, case.seed)
    host = 2**50 if case.host_factor is None else \
        max(1, model_host_memory(profile).total + int(case.host_factor * activation_ceiling(profile, case.batch)))
    return profile, random_hardware(profile, case.gpus, case.cap_factor, case.seed, host)


def run_planner(name: str, profile: Profile, hw: Hardware, case: FuzzCase) -> Plan:
    """``name`` from the registry on the case: a planner that searches the mode gets the case's mode and
    time limit, one that plans in one mode gets it (vPP for "auto"), the others neither."""
    entry = planner_entry(name)
    kw = {}
    if entry.modes == "auto":
        kw.update(mode=case.mode, time_limit=case.time_limit, seed=0, workers=1)
    elif entry.modes == "per-mode":
        kw["mode"] = "vPP" if case.mode == "auto" else case.mode
    return get_planner(entry.name)(profile, hw, case.batch, hw.gpu_memory_bytes, gpus=case.use_gpus, **kw)


def check_plan(plan: Plan, profile: Profile, hw: Hardware, cap: int, name: str) -> None:
    """Check the plan half of the contract; :class:`ContractError` says which promise broke."""
    where = f"{name} plan"
    plan.validate()
    plan.check_against(profile, hw)
    if plan.memory_cap is None or plan.memory_cap > cap:
        raise ContractError(f"{where}: memory_cap {plan.memory_cap} > {cap}")
    text = plan.to_json()
    again = Plan.from_dict(json.loads(text))
    if again.to_json() != text:
        raise ContractError(f"{where}: JSON does not round-trip")
    tl = simulate(plan, profile, hw, memory_cap=cap, with_timeline=False)
    peak = max(tl.meta["reserved_memory"].values(), default=0)
    if peak > cap:
        raise ContractError(f"{where}: the simulator reserves {peak} bytes, over the cap {cap}")
    run = program_memory(plan, profile, cap)
    if not run.fits:
        raise ContractError(f"{where}: its program would hold {run.over[2]} bytes at {run.over[1]} on GPU "
                            f"{run.over[0]}, over the cap {cap}: refused at run time")
    host = host_memory(plan, profile, hw)
    if host.total > hw.host_memory_bytes or host.pinned > hw.pinned_memory_bytes:
        raise ContractError(f"{where}: needs {host.total} bytes of host memory ({host.pinned} pinned), the host "
                            f"has {hw.host_memory_bytes} ({hw.pinned_memory_bytes})")
    t = plan.simulated_iteration_time_s
    if t is None or not math.isfinite(t) or t < 0:
        raise ContractError(f"{where}: simulated_iteration_time_s {t!r}")
    if not math.isclose(t, tl.iteration_time, rel_tol=1e-9, abs_tol=1e-12):
        raise ContractError(f"{where}: claims {t} s but simulates to {tl.iteration_time} s")
    # the baselines skip microbatch sizes by this bound: it must hold for every plan it applies to
    floor = iteration_floor(plan, profile, hw)
    if not floor <= tl.iteration_time * (1 + 1e-7):
        raise ContractError(f"{where}: iteration_floor {floor} s exceeds the simulated {tl.iteration_time} s")


def check_case(case: FuzzCase, planners=PLANNER_NAMES) -> dict[str, str]:
    """Run every planner on the case; return ``{planner: "plan" | "infeasible"}``.

    Raises :class:`ContractError` for a broken promise; any other exception but InfeasibleError
    escapes unchanged (that is a bug too)."""
    profile, hw = build(case)
    out = {}
    for name in planners:
        try:
            plan = run_planner(name, profile, hw, case)
        except InfeasibleError as e:
            if not (str(e).strip() and e.explanation.strip()):
                raise ContractError(f"{name}: InfeasibleError without an explanation") from e
            out[name] = "infeasible"
            continue
        check_plan(plan, profile, hw, hw.gpu_memory_bytes, name)
        out[name] = "plan"
    return out


def random_case(rng: np.random.Generator, max_layers: int = 1200, time_limit: float = 1.0,
                large_fraction: float = 0.05, large_from: int = 200) -> FuzzCase:
    """A case for the soak: usually 1..``large_from`` layers (log-uniform), with probability
    ``large_fraction`` ``large_from``..``max_layers`` (uniform), since large cases cost minutes."""
    gpus = int(rng.integers(1, 5))
    if max_layers > large_from and rng.random() < large_fraction:
        R = int(rng.integers(large_from, max_layers + 1))
    else:
        R = min(int(np.exp(rng.uniform(0, np.log(min(large_from, max_layers) + 1)))), max_layers) or 1
    return FuzzCase(
        layers=R, seed=int(rng.integers(0, 2**31)), batch=int(rng.integers(1, 65)), gpus=gpus,
        cap_factor=float(np.exp(rng.uniform(np.log(0.7), np.log(40)))),
        mode=str(rng.choice(["auto", "vPP", "vDP"])),
        use_gpus=None if rng.random() < 0.5 else int(rng.integers(1, gpus + 1)), time_limit=time_limit,
        host_factor=None if rng.random() < 0.7 else float(rng.uniform(0, 0.6)))
