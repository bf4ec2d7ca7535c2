"""The CP-SAT planner: mode, GPU count, microbatch sizes, packs and per-pack options, with a bound.

``plan()`` runs seven steps under one deterministic work budget (budget.py), numbered the same in
the code below and in the step modules' docstrings:

1. **Harmony's search** (steps/first.py): its plan is the incumbent, so the result is never slower
   than Harmony's, and its configuration is visited first.
2. **A first solution per configuration** (steps/first.py): every (mode, GPUs, u_fwd, u_bwd) that
   can matter (options.py), visited in the order of a cheap valid bound (bounds.py); the exact DP
   (dp.py) where one GPU runs the whole chain, local search from balanced packs in vPP
   (search.py). A configuration whose bound reaches the best model value found is pruned, and so
   is every later one.
3. **Improvement** (steps/improve.py): local search, then CP-SAT on the most promising
   configurations from that solution as a complete hint: the segment model (chain.py) for one
   chain, the position model (pipeline.py) for vPP, with per-pack options (recompute or stash,
   CPU or GPU optimizer step); each gets its proven bound.
4. **The simulator judges** (steps/select.py): the best candidates and the incumbent are
   simulated and the fastest wins; where the winner is a chain that may keep gradients on the
   GPU, the DP also searches that model's own chains (4b).
5. **Polish** (steps/select.py): where the winner is a vPP plan, its plans with the loss pack
   starting nearby, each the model's descent with that start held, judged by the simulator; then a
   descent judged by the simulator.
6. **The timeline model** (steps/order.py, event_schedule.py) schedules the chosen plan's events
   and proves how close the simulator's schedule is to the best of those events.
7. **The order of the transfers** (steps/order.py): where another order could gain (the timeline
   model's bound says so) and budget is left, the timeline model chooses it, and the plan carries
   it when the simulator plays it faster.

Finally the compiled program's memory is checked (harmony_opt.compile.program_memory.fit_to_program). Reported in
``plan.solver``: the model's objective for the chosen plan and its agreement with the simulator
(``fidelity``), the bound over every configuration searched and the gap to it, the chosen
configuration's status and bound, the timeline model's result, the physical lower bound over all
plans (harmony_opt.sim.bound) and the speed-up over Harmony's search.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time

import numpy as np

from harmony_opt.sim.bound import lower_bound
from harmony_opt.planners.baselines import played
from harmony_opt.core.bundled import plan_ident
from harmony_opt.core.errors import HarmonyOptError, UsageError
from harmony_opt.core.hardware import Hardware
from harmony_opt.sim.host_memory import may_bind, model_host_memory
from harmony_opt.compile.program_memory import fit_to_program
from harmony_opt.core.plan import Plan
from harmony_opt.core.profile import Profile

from . import pool
from .bounds import compute_floor, config_bound, in_bound_order
from .budget import Budget
from .options import PlannerOptions, configurations, validate
from .state import Candidate, Search
from .tasks import Config, build_tasks, candidate_cuts
from .timing import evaluate, pack_starts, sequence_of_plan
from .steps.first import first_solutions, harmony_hint
from .steps.improve import cp_sat, exact_shapes, local_search, tighten
from .steps.select import (even_runner_up, handoff_chains, judge_candidates, polish, refine_chain, sweep_starts,
                           with_handoff)
from .steps.order import timeline_of, transfer_order


log = logging.getLogger("harmony_opt.plan")


def _space_bound(S: Search, found: list[Candidate], open_bound: float, most: int = 64) -> float:
    """The bound over the searched space: every evaluated configuration's own bound and the cheap
    bound of those not reached. A configuration whose plans may keep gradients on the GPU was
    searched on the model without, so for it only the bound of every variant of the model holds.
    While the lowest is one that ``tighten`` could raise, it does (at most ``most`` times)."""
    on_floor = {id(c): not c.handoff and S.handoff(c.cfg) for c in found}

    def held(c):
        return c.floor if on_floor[id(c)] else c.bound

    def loose(c):
        if c.cfg.ranks > 1:
            return not c.pathed
        return not c.tight_floor if on_floor[id(c)] else not c.tight
    for _ in range(most):
        low = min(found, key=lambda c: (held(c), str(c.cfg)), default=None)
        if low is None or not loose(low) or held(low) >= open_bound or S.budget.left() <= 0:
            break
        tighten(S, low, floor=on_floor[id(low)])
    return min([held(c) for c in found] + [open_bound])


def _configuration_report(S: Search, c: Candidate | None) -> dict | None:
    """What was proven about the chosen configuration (plan.solver["configuration"])."""
    if c is None:
        return None
    r = c.solve if c.solve is not None and c.solve.objective is not None else None
    if c.proof in ("dp", "shapes"):
        status, proof = "OPTIMAL", c.proof
    elif (r is not None and r.status == "OPTIMAL" and c.cfg.ranks == 1 and c.how == "cp-sat"
          and c.value <= r.objective + 1e-9):       # not where what it leaves out binds (timing.py)
        status, proof = "OPTIMAL", "cp-sat"
    else:
        status, proof = "FEASIBLE", None
    conf = {"configuration": str(c.cfg), "status": status, "proof": proof, "found_by": c.how,
            "objective": c.value, "bound": c.bound, "gap": max(0.0, (c.value - c.bound) / c.value),
            "cp_sat": None if c.solve is None else {"status": c.solve.status, "wall_time_s": c.solve.wall_time}}
    if S.opts.cost_model != "default":
        # the model describes the default simulator: its proofs and bounds say nothing about another
        conf.update(status="FEASIBLE", proof=None, bound=None, gap=None)
    return conf


def plan(profile: Profile, hw: Hardware, batch: int, options: PlannerOptions | None = None, *,
         memory_cap: int | None = None, report=None) -> Plan:
    """The best plan found, with the solver's statistics in ``plan.solver``.

    Deterministic: configurations are visited in a fixed order, the heuristics use seeded
    generators and fixed step counts, CP-SAT runs under a deterministic time limit, so the same
    inputs, seed and workers give the same plan. The plan's compiled program fits the cap
    (harmony_opt.compile.program_memory.fit_to_program): where the search's pack memory let through a plan whose
    program would not, it searches again under a lower cap, with the work the searches before it
    left of ``time_limit`` (at least ``MIN_RETRY_WORK``), and refuses with the figures where that
    fails too."""
    cap = int(memory_cap or hw.gpu_memory_bytes)
    opts = options or PlannerOptions()
    if opts.cost_model == "harmony" and not opts.harmony_space:
        return _under_harmonys_cost_model(profile, hw, batch, opts, cap, report)
    return fit_to_program(_charged(profile, hw, batch, opts, report), cap, profile,
                          who=f"the best plan of {profile.name}")


#: Work seconds a search under a lowered cap gets at least, when the searches before it left less:
#: enough for Harmony's search and the first solutions, so that it returns a plan.
MIN_RETRY_WORK = 0.25


def _charged(profile: Profile, hw: Hardware, batch: int, opts: PlannerOptions, report, incumbent=None):
    """``make(cap)`` for fit_to_program: a search under ``cap`` that gets the work seconds (and wall
    seconds) the searches before it left of ``opts``' limits, so that searching again under a lower
    cap does not multiply the budget; the plan reports the work of all of them."""
    spent = {"work": 0.0, "wall": 0.0, "searches": 0, "first": None}

    def make(cap: int) -> Plan:
        o = opts
        if spent["searches"]:
            o = dataclasses.replace(
                opts, time_limit=max(opts.time_limit - spent["work"] / 0.9, MIN_RETRY_WORK),
                wall_limit=None if opts.wall_limit is None else max(opts.wall_limit - spent["wall"], MIN_RETRY_WORK))
        p = _plan(profile, hw, batch, o, memory_cap=cap, report=report, incumbent=incumbent)
        s = p.solver or {}
        spent["work"] += s.get("work_s", 0.0)
        spent["wall"] += p.search_time_s or 0.0
        spent["searches"] += 1
        if spent["searches"] == 1:          # the first search: its own figures, as without a retry
            spent["first"], spent["cap"] = s, cap
            return p
        # a search under a lowered cap: its plan keeps the user's cap (fit_to_program), under which the
        # simulator plays it otherwise (more room to prefetch): its figures are of that play (a plan
        # claimed 15.407 s, simulated at the lowered cap, which its own cap plays in 15.389 s)
        t, _ = played(p.replace(memory_cap=spent["cap"]), profile, hw, opts.cost_model)
        if math.isfinite(t):
            objective, harmony_t = s.get("objective"), s.get("harmony_time_s")
            s = {**s, "fidelity": abs(objective - t) / t if objective else s.get("fidelity"),
                 "speedup_over_harmony": harmony_t / t if harmony_t else s.get("speedup_over_harmony")}
            p = p.replace(simulated_iteration_time_s=t)
        s = _bounds_at_the_cap(s, spent["first"], p.simulated_iteration_time_s)
        return p.replace(search_time_s=spent["wall"],
                         stats={**(p.stats or {}), "efficiency": s["lower_bound_s"] / p.simulated_iteration_time_s},
                         solver={**s, "work_s": spent["work"], "work_budget_s": 0.9 * opts.time_limit,
                                 "searches": spent["searches"]})
    return make


def _bounds_at_the_cap(s: dict, first: dict, simulated: float) -> dict:
    """A search again under a lowered cap (fit_to_program) proves its bounds for the plans that fit
    that cap in the model; the plans that fit the user's cap may be faster. So its bounds are taken
    at most the first search's, under the user's cap, whose bound over every configuration searched
    holds for every plan of each (a 6-layer CPU-like profile on 2 GPUs, vPP x2 u=4/2: 0.1162 s
    reported at the lowered cap, where a plan of 0.1054 s fits the user's), or its own chosen
    configuration's where that is the same; and so is the lower bound over all plans."""
    s = dict(s)

    def lowered(bound, held):
        return None if bound is None or held is None else min(bound, held)
    s["bound"] = lowered(s.get("bound"), first.get("bound"))
    if s.get("gap") is not None:
        s["gap"] = None if s["bound"] is None else (s["objective"] - s["bound"]) / s["objective"]
    conf, same = s.get("configuration"), first.get("configuration") or {}
    if conf is not None and conf.get("bound") is not None:
        bound = lowered(conf["bound"], same.get("bound") if same.get("configuration") == conf["configuration"]
                        else first.get("bound"))
        conf = {**conf, "bound": bound,
                "gap": None if bound is None else max(0.0, (conf["objective"] - bound) / conf["objective"])}
        if bound is None or bound < conf["objective"] - 1e-9:
            conf.update(status="FEASIBLE", proof=None)
        s["configuration"] = conf
    s["lower_bound_s"] = min(s["lower_bound_s"], first["lower_bound_s"])
    s["gap_to_lower_bound"] = (simulated - s["lower_bound_s"]) / simulated
    return s


def plan_under_cap(profile: Profile, hw: Hardware, batch: int, cap: int | None = None, *, gpus: int | None = None,
                   report=None, **options) -> Plan:
    """:func:`plan` in the registry's calling convention (harmony_opt.planners.registry): the cap as
    the fourth argument and ``options`` the fields of :class:`PlannerOptions`; an unknown option is
    a UsageError naming the valid ones."""
    fields = [f.name for f in dataclasses.fields(PlannerOptions) if f.name != "gpus"]
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise UsageError(f"cp-sat: unknown option(s) {', '.join(unknown)}; valid: {', '.join(fields)}")
    return plan(profile, hw, batch, PlannerOptions(gpus=gpus, **options), memory_cap=cap, report=report)


#: Work seconds at least left by the search of Harmony's space for the wider one to run (_under_harmonys_cost_model)
MIN_WIDER_WORK = 0.5


def _under_harmonys_cost_model(profile: Profile, hw: Hardware, batch: int, opts: PlannerOptions, cap: int,
                               report) -> Plan:
    """The full space under Harmony's cost model, never slower than Harmony's space.

    The planner's model describes the default simulator, not Harmony's (tens of % apart on the same
    plan), so it cannot steer a search beyond Harmony's space towards what Harmony's simulator plays
    faster: given the same budget, the full-space search lost to the restricted one on synthetic
    profiles (tests/test_planner.py). So Harmony's space is searched first, under the whole budget;
    the decisions beyond it (u_fwd < u_bwd, other GPU counts, sizes not dividing the batch) get the
    work seconds that search leaves, from its plan as the incumbent."""
    say = report or (lambda s: None)
    who = f"the best plan of {profile.name}"
    narrow = fit_to_program(_charged(profile, hw, batch, dataclasses.replace(opts, harmony_space=True), report),
                            cap, profile, who=who)
    s = narrow.solver
    left = s["work_budget_s"] - s["work_s"]
    wall_left = None if opts.wall_limit is None else opts.wall_limit - narrow.search_time_s
    if left < MIN_WIDER_WORK or (wall_left is not None and wall_left < MIN_WIDER_WORK):
        say(f"Harmony's space searched with the whole budget ({s['work_s']:.2f} work s): no budget left beyond it")
        return narrow.replace(solver={**s, "space": "harmony"})
    say(f"Harmony's space searched in {s['work_s']:.2f} work s; beyond it with the {left:.2f} s left")
    wider = fit_to_program(_charged(profile, hw, batch, dataclasses.replace(opts, time_limit=left / 0.9,
                                                                            wall_limit=wall_left),
                                    report, incumbent=narrow), cap, profile, who=who)
    best = wider if wider.simulated_iteration_time_s < narrow.simulated_iteration_time_s else narrow
    t, harmony_t = best.simulated_iteration_time_s, s["harmony_time_s"]
    return best.replace(search_time_s=narrow.search_time_s + wider.search_time_s,
                        solver={**best.solver, "space": "full", "harmony_time_s": harmony_t,
                                "speedup_over_harmony": harmony_t / t if harmony_t else None,
                                "work_s": s["work_s"] + wider.solver["work_s"],
                                "wall_time_s": s["wall_time_s"] + wider.solver["wall_time_s"]})


def _plan(profile: Profile, hw: Hardware, batch: int, options: PlannerOptions | None = None, *,
          memory_cap: int | None = None, report=None, incumbent: Plan | None = None) -> Plan:
    """One search; ``incumbent``: a plan to start from instead of Harmony's search's."""
    opts = options or PlannerOptions()
    validate(opts, hw, batch)
    # weights, gradients and optimizer state: the same in every plan (on several servers they split
    # between the servers' host memories as the plan places the packs: each plan is checked)
    if hw.servers == 1:
        model_host_memory(profile).check(hw, f"every plan of {profile.name}")
    ident = plan_ident(profile, hw)
    if opts.cost_model != "default":    # Harmony's simulator charges no execution terms: nor does the model of it
        hw = hw.without_execution_terms()
    t_start = time.perf_counter()
    S = Search(profile, hw, batch, int(memory_cap or hw.gpu_memory_bytes), opts,
                # the rest: the report, and what the charges miss
                Budget(0.9 * opts.time_limit, None if opts.wall_limit is None else 0.9 * opts.wall_limit),
                report or (lambda s: None),
                ident,
                host_check=may_bind(profile, hw, batch))
    with pool.processes(S):
        if incumbent is None:
            incumbent = harmony_hint(S) if opts.hint else None                         # 1
        harmony_t = incumbent.simulated_iteration_time_s if incumbent is not None else None
        hint_work = S.budget.used

        # 2. configurations in the order of their cheap bound, the hint's first (its value prunes early);
        # the bound is computed for those the search reaches (in_bound_order)
        configs = configurations(profile, hw, batch, opts)
        S.budget.spend(Budget.PER_FLOOR * len(configs))
        floor = {c: compute_floor(profile, hw, batch, c, S.cap, S.stash(c)) for c in configs}
        configs = [c for c in configs if np.isfinite(floor[c])]
        computed = [0]

        def bound(c: Config) -> float:
            computed[0] += 1
            return config_bound(profile, hw, batch, c, S.cap, S.stash(c))
        # the sizes that divide the minibatch first; the uneven ones after, with what that leaves of the
        # share and pruned by its best; each with the number of bounds computed up to it, which
        # first_solutions charges as it takes them
        hint_cfg = None if incumbent is None else Config.of(incumbent)
        even = set(configurations(profile, hw, batch, dataclasses.replace(opts, uneven=False)))
        tiers, best = [], [float("inf")]        # best: the least model value found (first_solutions)
        for tier in ([c for c in configs if c in even], [c for c in configs if c not in even]):
            if tier:
                ordered = ((c, b, computed[0]) for c, b in in_bound_order(
                    tier, floor, bound, hint_cfg if hint_cfg in tier else None, prune=lambda v: v >= best[0]))
                tiers.append((ordered, len(tier), min(floor[c] for c in tier)))
        S.say(f"{len(configs)} configurations (mode x GPUs x microbatch sizes), visited in the order of their bound"
              + (f", the {len(even & set(configs))} whose sizes divide the minibatch first" if len(tiers) > 1 else ""))
        stats = {"configurations": len(configs), "evaluated": 0, "pruned": 0, "infeasible": 0, "out_of_budget": 0}

        found, open_bound = first_solutions(S, tiers, incumbent, stats, best)
        if not found and incumbent is None:
            raise S.infeasible()
        local_search(S, found)                                                           # 3
        cp_sat(S, found)
        exact_shapes(S, found)
        best_plan, best_t, best_c, judged = judge_candidates(S, found, incumbent)        # 4
        if best_c is not None and best_c.cfg.ranks == 1 and S.handoff(best_c.cfg):
            best_plan, best_t = handoff_chains(S, best_c, best_plan, best_t)   # 4b
        rival = refine_chain(S, best_c, judged, best_t, found)                          # 4c
        if best_c is not None and best_c.cfg.ranks > 1:
            also = even_runner_up(best_c, judged, best_t, even)
            best_plan, best_t, best_c = sweep_starts(S, best_c, best_plan, best_t, found, also)   # 5
        if best_c is not None:
            best_plan, best_t = polish(S, best_c, best_plan, best_t, found)               # 5
        if rival is not None and rival[2] < best_t * (1 - 1e-9):
            best_c, best_plan, best_t = rival
        if best_c is not None and best_c.handoff:
            with_handoff(S, best_c)
    if best_c is not None and best_c.cfg.ranks > 1:
        tighten(S, best_c)             # the chosen configuration's proof, also where it is not the lowest
    space_bound = _space_bound(S, found, open_bound) if opts.cost_model == "default" else None
    timeline, fixed = timeline_of(S, best_plan)                                          # 6
    best_plan, best_t, order = transfer_order(S, best_plan, best_t, fixed)            # 7
    if timeline is not None:
        timeline["transfer_order"] = order

    conf = _configuration_report(S, best_c)
    if best_c is not None:
        model_value = best_c.value
    else:                                  # Harmony's plan won: its value on our model, if representable
        model_value = _model_value_of(incumbent, profile, hw, batch, S.cap)
    lb = lower_bound(profile, hw, batch, S.cap)
    solver = {
        "status": conf["status"] if conf else "NOT_SOLVED",
        "model": None if best_c is None else ("chain" if best_c.cfg.ranks == 1 else "pipeline"),
        "objective": model_value,
        "bound": space_bound,
        "gap": (model_value - space_bound) / model_value if model_value and space_bound is not None else None,
        "fidelity": abs(model_value - best_t) / best_t if model_value else None,
        "source": "harmony-hint" if best_c is None else best_c.how,
        "configuration": conf,
        "timeline": timeline,
        "wall_time_s": time.perf_counter() - t_start,
        "work_s": S.budget.used,
        "work_budget_s": S.budget.total,
        "hint_work_s": hint_work,       # of work_s: Harmony's search for the warm start
        "stopped_by_wall": S.budget.stopped_by_wall,
        "lower_bound_s": lb["bound_s"],
        "gap_to_lower_bound": (best_t - lb["bound_s"]) / best_t,
        "harmony_time_s": harmony_t,
        "speedup_over_harmony": (harmony_t / best_t) if harmony_t else None,
        **stats,
    }
    return best_plan.replace(planner="cp-sat", simulated_iteration_time_s=best_t,
                             search_time_s=time.perf_counter() - t_start, solver=solver,
                             stats={"efficiency": lb["bound_s"] / best_t}, **ident)


def _model_value_of(p: Plan, profile, hw, batch, cap) -> float | None:
    """The model's iteration time of a given plan (None if one of its packs is not a candidate)."""
    cfg = Config.of(p)
    try:        # a plan without forward packs may name a forward size that is not profiled
        tasks = build_tasks(profile, hw, batch, cfg, cap, gpu_opt=True, stash=False,
                            cuts=candidate_cuts(profile, cfg.u_bwd, keep=pack_starts(p)), gpu_handoff=p.gpu_handoff)
        seq = sequence_of_plan(tasks, p)
    except (KeyError, HarmonyOptError):
        return None
    v = evaluate(tasks, seq)
    return v if np.isfinite(v) else None
