"""The CP-SAT planner: mode, GPU count, microbatch sizes and packs, with a proven bound.

Decomposition (DESIGN.md, performance rules): an outer loop enumerates the
configurations that can matter (mode x GPUs x (u_fwd, u_bwd)); each gets a valid
lower bound (compute of its microbatch sizes spread over its GPUs) and is pruned when
that bound already exceeds the best simulated plan. The rest are solved by the CP-SAT
segment model (packing.py), whose solution is then played by the simulator, the judge.
Harmony's best plan (judged the same way) is the hint for its configuration and the
incumbent to beat, so the result is never slower than Harmony's search.

Reported: the CP-SAT objective of the chosen configuration and its simulated time
(their difference is the model's fidelity), CP-SAT's bound on that configuration's
objective, and the global lower bound over all plans (harmony_opt.bound).
"""
from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from harmony_opt.baselines import feasible_sizes, plan_harmony
from harmony_opt.bound import lower_bound
from harmony_opt.errors import HarmonyOptError, InfeasibleError, PlanError, UsageError
from harmony_opt.harmony_compat import simulate_harmony
from harmony_opt.simulator import simulate
from harmony_opt.hardware import Hardware
from harmony_opt.memory import explain_infeasible
from harmony_opt.plan import PackOptions, Plan, data_shares, split_microbatches
from harmony_opt.profile import Profile

from .arcs import MAX_LAYERS_WITH_STASH, Config, build_arcs
from .packing import Solution, objective_of, solve
from .timeline import solve_timeline

log = logging.getLogger("harmony_opt.plan")


@dataclasses.dataclass
class PlannerOptions:
    mode: str = "auto"              # auto | vPP | vDP
    gpus: int | None = None         # None: try 1 .. hardware.gpus
    time_limit: float = 10.0        # work seconds for the whole search (deterministic accounting, see WORK_*)
    seed: int = 0
    workers: int = 1                # CP-SAT workers; 1 is fastest on these models, >1 runs interleaved (deterministic)
    rel_gap: float = 1e-3
    harmony_space: bool = False     # restrict to Harmony's space: u_fwd >= u_bwd, sizes dividing the batch
    uneven: bool = False            # allow microbatch sizes that do not divide the batch
    hint: bool = True               # warm start from Harmony's search
    options: bool = True            # search per-pack recompute/stash and CPU/GPU optimizer (off in harmony_space)
    cost_model: str = "default"     # the simulator that judges candidates: default | harmony


#: The search budget is counted in deterministic "work seconds", so that the same inputs
#: give the same plan on a busy or an idle machine: CP-SAT's deterministic time, plus
#: these costs of model building and simulation, measured on a 2-core machine (about
#: 60-110 us per simulated event, 20 us per candidate pack). They track wall time within
#: a small factor.
WORK_PER_EVENT = 1e-4
WORK_PER_ARC = 2e-5
WORK_PER_SOLVE = 0.25   # CP-SAT's start-up and presolve, which its deterministic clock barely counts


def _compute_bound(profile: Profile, cfg: Config, batch: int, stash: bool) -> float:
    """Valid lower bound of any plan of this configuration: its least compute spread over its GPUs.

    Every sample passes every layer's backward; with recompute that includes the forward
    again. With stash variants a backward may skip the recompute, so only ``BWD - FWD``
    per layer counts (the forward packs add more; leaving them out keeps the bound valid).
    """
    R = profile.num_layers
    share = batch if cfg.mode == "vPP" else data_shares(batch, cfg.gpus)[0]
    f_max = profile.size_range("FWD")[1]
    t = 0.0
    for u in split_microbatches(share, cfg.u_bwd):
        b = profile.costs("BWD", u).time
        if stash:
            b = np.maximum(b - profile.costs("FWD", min(u, f_max)).time, 0.0)
        t += float(np.sum(b))
    return t / (cfg.gpus if cfg.mode == "vPP" else 1)


def _sizes(sizes: list[int], batch: int, mode: str, gpus: int) -> list[int]:
    """Of the sizes giving the same number of microbatches, the smallest (= the most even split):
    a larger one only adds memory and makes the last microbatch smaller."""
    share = batch if mode == "vPP" else data_shares(batch, gpus)[0]
    best = {}
    for u in sorted(sizes):
        best.setdefault(-(-share // u), u)
    return sorted(best.values())


def configurations(profile: Profile, hw: Hardware, batch: int, opts: PlannerOptions) -> list[Config]:
    modes = ("vPP", "vDP") if opts.mode == "auto" else (opts.mode,)
    gpu_counts = [opts.gpus] if opts.gpus else list(range(1, hw.gpus + 1))
    out = []
    for mode in modes:
        for n in gpu_counts:
            if mode == "vDP" and n > batch:
                continue
            if mode == "vDP" and n == 1 and "vPP" in modes:
                continue        # identical to vPP on one GPU
            div = not (opts.uneven and not opts.harmony_space)
            ub = _sizes(feasible_sizes(profile, batch, mode, n, "BWD", divisors_only=div), batch, mode, n)
            uf = _sizes(feasible_sizes(profile, batch, mode, n, "FWD", divisors_only=div), batch, mode, n)
            for b in ub:
                for f in uf:
                    if opts.harmony_space and f < b:
                        continue
                    out.append(Config(mode, n, f, b))
    return out


def _judge(plan_: Plan, profile: Profile, hw: Hardware, cost_model: str) -> tuple[float, int]:
    """Simulated iteration time (inf if the simulator rejects the plan) and how many events it played."""
    try:
        if cost_model == "harmony":
            tl = simulate_harmony(plan_, profile, with_timeline=False)
            tasks = len(plan_.packs_fwd) + 2 * len(plan_.packs_bwd)
            return tl.iteration_time, 4 * tasks * len(plan_.microbatches("BWD"))
        tl = simulate(plan_, profile, hw, with_timeline=False)
        return tl.iteration_time, tl.meta["events"]
    except PlanError:
        return float("inf"), 0


def _as_solution(p: Plan) -> Solution:
    return Solution(list(p.packs_fwd), list(p.packs_bwd), [(o.recompute, o.optimizer == "gpu") for o in p.options])


def plan(profile: Profile, hw: Hardware, batch: int, options: PlannerOptions | None = None, *,
         memory_cap: int | None = None, report=None) -> Plan:
    """The best plan found, with the solver's statistics in ``plan.solver``.

    Deterministic: the configurations are visited in a fixed order and CP-SAT runs under
    a deterministic time budget, so the same inputs, seed and workers give the same plan.
    """
    opts = options or PlannerOptions()
    if opts.mode not in ("auto", "vPP", "vDP"):
        raise UsageError(f"--mode must be auto, vPP or vDP, got {opts.mode!r}")
    if opts.gpus is not None and not 1 <= opts.gpus <= hw.gpus:
        raise UsageError(f"--gpus {opts.gpus}: hardware {hw.name!r} has {hw.gpus} GPU(s)")
    if batch < 1:
        raise UsageError(f"--batch must be >= 1, got {batch}")
    if not opts.time_limit > 0:
        raise UsageError(f"--time-limit must be > 0 seconds, got {opts.time_limit}")
    if opts.cost_model not in ("default", "harmony"):
        raise UsageError(f"--cost-model must be default or harmony, got {opts.cost_model!r}")
    cap = int(memory_cap or hw.gpu_memory_bytes)
    say = report or (lambda s: None)
    t_start = time.perf_counter()
    R = profile.num_layers
    search_options = opts.options and not opts.harmony_space
    ident = {"profile": {"name": profile.name, "identity": profile.identity}, "hardware": hw.to_dict()}

    # incumbent: Harmony's search judged by our simulator (the hint, and the plan to beat)
    best_plan, best_t, harmony_t = None, float("inf"), None
    if opts.hint:
        modes = ("vPP", "vDP") if opts.mode == "auto" else (opts.mode,)
        for mode in modes:
            try:
                # in Harmony's space the incumbent is Harmony's search with all its heuristics,
                # so the result is never slower than it
                packing = "all" if opts.harmony_space else "published"
                hp = plan_harmony(profile, hw, batch, cap, mode=mode, gpus=opts.gpus or hw.gpus,
                                  packing_fwd=packing, packing_bwd=packing, cost_model=opts.cost_model)
            except HarmonyOptError:
                continue
            t = hp.simulated_iteration_time_s
            if t is not None and t < best_t:
                best_plan, best_t, harmony_t = hp, t, t
        if best_plan is not None:
            say(f"hint: Harmony's search, {best_plan.mode} x{best_plan.gpus} u={best_plan.microbatch_fwd}/"
                f"{best_plan.microbatch_bwd}: {best_t:.4f} s simulated")

    configs = configurations(profile, hw, batch, opts)
    stash = search_options and R <= MAX_LAYERS_WITH_STASH
    bounds = {c: _compute_bound(profile, c, batch, stash) for c in configs}
    configs.sort(key=lambda c: (bounds[c], str(c)))
    if best_plan is not None:   # the hint's configuration first: its bound is reported if the hint wins
        hc = Config(best_plan.mode, best_plan.gpus, best_plan.microbatch_fwd, best_plan.microbatch_bwd)
        if hc in bounds:
            configs.remove(hc)
            configs.insert(0, hc)
    say(f"{len(configs)} configurations (mode x GPUs x microbatch sizes); solving in order of their bound")
    stats = {"configurations": len(configs), "solved": 0, "pruned": 0, "infeasible": 0, "timed_out": 0}
    best_cfg_result = None
    det_used = solver_time = 0.0
    # the timeline model of the chosen plan gets 15 % of the budget (1 work second at most)
    timeline_budget = min(1.0, 0.15 * opts.time_limit) if opts.cost_model == "default" else 0.0
    packing_budget = opts.time_limit - timeline_budget
    per_config = max(1.0, packing_budget / 4)
    solved = {}                 # Config -> (PackingResult, Phases)
    for i, cfg in enumerate(configs):
        if bounds[cfg] >= best_t and i > 0:
            stats["pruned"] += len(configs) - i
            break
        remaining = packing_budget - det_used
        if remaining <= 0.05:
            stats["timed_out"] += len(configs) - i
            break
        ph = build_arcs(profile, hw, batch, cfg, cap, options=search_options)
        det_used += WORK_PER_ARC * (len(ph.fwd) + len(ph.bwd) + len(ph.crit))
        if len(ph.crit) == 0 or (len(ph.bwd) == 0 and ph.crit.start.min() > 0):
            stats["infeasible"] += 1
            continue
        hint = None
        if best_plan is not None and (best_plan.mode, best_plan.gpus, best_plan.microbatch_fwd,
                                      best_plan.microbatch_bwd) == (cfg.mode, cfg.gpus, cfg.u_fwd, cfg.u_bwd):
            hint = _as_solution(best_plan)
        res = solve(ph, R, cfg, hw, time_limit=min(remaining, per_config),
                    seed=opts.seed, workers=opts.workers, rel_gap=opts.rel_gap, hint=hint)
        solver_time += res.wall_time
        det_used += res.deterministic_time + WORK_PER_SOLVE
        if res.objective is None:
            stats["infeasible"] += 1
            continue
        stats["solved"] += 1
        solved[cfg] = (res, ph)
        # the simulator judges the solver's solution and its last earlier incumbent, unless
        # the model already rates them no better than the best plan (it under-estimates)
        sols = [Solution(res.packs_fwd, res.packs_bwd, res.options)] + res.earlier[:1]
        scored = []
        for sol in sols if res.objective < best_t else sols[:0]:
            opts_b = tuple(PackOptions(r, "gpu" if g else "cpu") for r, g in sol.options)
            cand = Plan("cp-sat", cfg.mode, cfg.gpus, batch, cfg.u_fwd, cfg.u_bwd, sol.packs_fwd, sol.packs_bwd, R,
                        options=opts_b, allow_uneven=opts.uneven, memory_cap=cap, cost_model=opts.cost_model,
                        **ident)
            t, n_events = _judge(cand, profile, hw, opts.cost_model)
            det_used += WORK_PER_EVENT * n_events
            scored.append((t, cand, sol))
        if not scored:
            say(f"[{i + 1}/{len(configs)}] {cfg}: CP-SAT {res.status.lower()} {res.objective:.4f} s "
                f"(bound {res.bound:.4f} s), not better than the best simulated plan")
            continue
        t, candidate, sol = min(scored, key=lambda x: x[0])
        improved = t < best_t
        say(f"[{i + 1}/{len(configs)}] {cfg}: CP-SAT {res.status.lower()} {res.objective:.4f} s "
            f"(bound {res.bound:.4f} s), simulated {t:.4f} s{'  <- best' if improved else ''}")
        if improved:
            best_plan, best_t = candidate, t
            best_cfg_result = (cfg, res, ph, sol)

    if best_plan is None:
        raise explain_infeasible(profile, cap, feasible_sizes(profile, batch, "vDP", hw.gpus, "FWD"),
                                 feasible_sizes(profile, batch, "vDP", hw.gpus, "BWD"))
    lb = lower_bound(profile, hw, batch, cap)
    cfg = Config(best_plan.mode, best_plan.gpus, best_plan.microbatch_fwd, best_plan.microbatch_bwd)
    sol = _as_solution(best_plan)
    if cfg in solved:
        res, ph = solved[cfg]
        cfg_bound, status = res.bound, res.status
    else:
        ph = build_arcs(profile, hw, batch, cfg, cap, options=search_options)
        cfg_bound, status = float("nan"), "NOT_SOLVED"
    try:
        objective = objective_of(ph, cfg, hw, sol.packs_fwd, sol.packs_bwd, sol.options)
    except KeyError:            # a pack of the hint is not a candidate (e.g. longer than MAX_ARCS_PER_START)
        objective = None
    packing = {"status": status, "objective": objective, "bound": cfg_bound,
               "gap": (objective - cfg_bound) / objective if objective and cfg_bound == cfg_bound else None}
    # the timeline model schedules the chosen plan's events: its objective is the CP-SAT
    # estimate of the iteration time, its bound what no schedule of these events beats
    timeline = None
    if timeline_budget > 0:
        tr = solve_timeline(best_plan, profile, hw, time_limit=timeline_budget, seed=opts.seed,
                            workers=opts.workers, report=say)
        timeline = {"status": tr.status, "objective": tr.makespan_s, "bound": tr.bound_s, "gap": tr.gap,
                    "events": tr.events, "wall_time_s": tr.wall_time}
        solver_time += tr.wall_time
    elapsed = time.perf_counter() - t_start
    final = timeline if timeline and timeline["objective"] is not None else packing
    global_bound = lb["bound_s"]     # no plan beats the physical lower bound
    solver = {
        "status": final["status"],
        "objective": final["objective"],
        "bound": final["bound"],
        "gap": final["gap"],
        "model": "timeline" if final is timeline else "packing",
        "source": "harmony-hint" if best_cfg_result is None else "cp-sat",
        "fidelity": (abs(final["objective"] - best_t) / best_t) if final["objective"] else None,
        "packing": packing,
        "timeline": timeline,
        "wall_time_s": solver_time,
        "work_s": det_used,
        "lower_bound_s": global_bound,
        "gap_to_lower_bound": (best_t - global_bound) / best_t,
        "harmony_time_s": harmony_t,
        "speedup_over_harmony": (harmony_t / best_t) if harmony_t else None,
        **stats,
    }
    return best_plan.replace(planner="cp-sat", simulated_iteration_time_s=best_t, search_time_s=elapsed,
                             solver=solver, stats={"efficiency": global_bound / best_t})
