"""Steps 1 and 2 of plan(): Harmony's search as the incumbent, then a first solution per configuration
in the order of its bound."""
from __future__ import annotations

import collections
import dataclasses
import functools
import math

import numpy as np

from harmony_opt.planners.baselines import plan_harmony
from harmony_opt.core.errors import HarmonyOptError
from harmony_opt.core.plan import Plan

from .. import dp, pool, search
from ..budget import Budget, NeedsBudget, Tally
from ..state import Candidate, Search
from ..tasks import Config, Tasks
from ..timing import evaluate, pack_starts, sequence_of_plan


def harmony_hint(S: Search) -> Plan | None:
    """Harmony's search in the modes asked for, the best by the simulator (published packing
    heuristics; all of them in Harmony's space or under Harmony's cost model, where the plan must
    never lose to Harmony's own best): the incumbent and the hint."""
    best = None
    for mode in (("vPP", "vDP") if S.opts.mode == "auto" else (S.opts.mode,)):
        try:
            packing = "all" if S.opts.harmony_space or S.opts.cost_model == "harmony" else "published"
            hp = plan_harmony(S.profile, S.hw, S.batch, S.cap, mode=mode, gpus=S.opts.gpus or S.hw.gpus,
                              packing_fwd=packing, packing_bwd=packing, cost_model=S.opts.cost_model,
                              play_many=None if S.pool is None else functools.partial(S.pool.map, pool.play))
        except HarmonyOptError:
            continue
        # its candidates' simulations, by the cost model's simulator, and its packing work
        runs = hp.stats["configs_evaluated"]
        S.budget.spend(Budget.simulation(hp.stats["events_simulated"], S.opts.cost_model, runs)
                       + runs * Budget.PER_PACKING * S.profile.num_layers)
        if hp.simulated_iteration_time_s is not None and (
                best is None or hp.simulated_iteration_time_s < best.simulated_iteration_time_s):
            best = hp
    if best is not None:
        S.say(f"hint: Harmony's search, {best.mode} x{best.gpus} u={best.microbatch_fwd}/{best.microbatch_bwd}: "
              f"{best.simulated_iteration_time_s:.4f} s simulated")
    return best


#: Of the budget, what step 2 may spend on the first tier (the sizes dividing the minibatch), and on
#: the later ones: steps 3-5 spend what is left on the best configurations of both, those --even
#: takes among them (local_search), and the later tiers' first solutions rarely overtake the first
#: tier's best (D=64 on 1080ti-x4: bert_large vPP x4 returned 4.480 s with 0.45 for both, 4.440 s
#: with 0.25 here, --even 4.430 s; gpt2_xl on 1-4 GPUs 39.27 s with 0.3, 39.23 s with 0.25).
FIRST_SHARE = 0.45
LATER_TIERS_SHARE = 0.25


def first_solutions(S: Search, tiers, incumbent: Plan | None, stats: dict, best: list[float]):
    """Step 2: a first solution per configuration, tier after tier (``tiers``: (ordered, count, least
    floor) per tier; ``ordered`` yields (configuration, bound, bounds computed so far) triples in
    bound order), until in each tier the bound reaches the best model value (the rest of the tier
    is pruned) or the budget share runs out. Returns (candidates, the least bound of the
    configurations not reached). ``best``: ``[the least model value found]``, updated here, which
    the tiers' orders prune by (in_bound_order); ``[inf]`` to start.

    Tiers put the configurations that are most often best first (the sizes that divide the
    minibatch) without leaving out the others: those get what the first tier leaves of a smaller share
    (LATER_TIERS_SHARE), and its best value prunes them.

    With other processes (S.pool), the next configurations' first solutions are computed ahead,
    one per process, as in ``_first_ahead``; each is charged and checked here in order as if it
    were computed here, and those the search does not reach are dropped."""
    hint_cfg = None if incumbent is None else Config.of(incumbent)
    found = []
    charged, done, total = [0], [0], sum(count for _, count, _ in tiers)
    for k, (ordered, count, _) in enumerate(tiers):
        out = _first_tier(S, ordered, count, incumbent, hint_cfg, stats, found, best, charged, done, total,
                          FIRST_SHARE if k == 0 else LATER_TIERS_SHARE)
        if out is not None:         # out of budget: this tier's least bound not reached, and the later tiers'
            stats["out_of_budget"] += sum(c for _, c, _ in tiers[k + 1:])
            return found, min([out] + [least for _, _, least in tiers[k + 1:]])
    return found, float("inf")


def _first_tier(S: Search, ordered, count: int, incumbent, hint_cfg, stats, found, best, charged, done, total,
                share: float):
    """One tier of first_solutions; the least bound not reached where the budget ran out, else None."""
    stream, queued, ahead = iter(ordered), collections.deque(), {}
    for i in range(count):
        while S.pool is not None and len(queued) <= S.opts.processes:      # the next ones, ahead
            item = next(stream, None)
            if item is None:
                break
            queued.append(item)
            if item[1] < best[0]:        # not where the bound prunes it already
                ahead[item[0]] = S.pool.submit(_first_ahead, item[0], incumbent, hint_cfg)
        item = queued.popleft() if queued else next(stream, None)
        if item is None:
            break
        cfg, cfg_bound, computed = item
        S.budget.spend(Budget.PER_BOUND * (computed - charged[0]))     # where it is taken, not read ahead
        charged[0] = computed
        if cfg_bound >= best[0]:
            stats["pruned"] += count - i
            break
        # at least one, where the hint took the share; and where every one so far was infeasible,
        # not on past the budget while the hint is a plan to return (a 1-layer random profile whose
        # host memory the model finds too small for all 110 configurations, Harmony's plan fitting it:
        # 3.7 work s of a 1.8 s budget)
        if S.budget.left(share) <= 0 and (found or (incumbent is not None and done[0] > 0)):
            stats["out_of_budget"] += count - i
            _drop(ahead)
            return cfg_bound
        done[0] += 1
        r = ahead.pop(cfg).result() if cfg in ahead else None
        if r is None:
            tasks, first = _first_of(S, cfg, incumbent, hint_cfg)
            rows, host = len(tasks.table), tasks.host_budget is not None
        else:
            spent, first, rows, host = r
            for seconds in spent:
                S.budget.spend(seconds)
            tasks = None
        if first is None or not np.isfinite(first[0]):
            stats["infeasible"] += 1
            if host and rows:
                S.host_blocked.append(cfg)      # for the explanation, should nothing fit
            continue
        if tasks is None:       # built in the other process, charged with it: the same table again
            tasks = _first_tasks(dataclasses.replace(S, budget=Budget(S.budget.total)), cfg, incumbent, hint_cfg)
        stats["evaluated"] += 1
        value, seq, dp_bound = first
        # the DP's optimum bounds the configuration where no stash variant could beat it, and every
        # variant of the model where plans cannot keep gradients on the GPU either (tighten)
        chain_ = cfg.ranks == 1
        bound = max(cfg_bound, dp_bound if dp_bound is not None and not S.stash(cfg) else 0.0)
        kept = chain_ and S.handoff(cfg)
        found.append(Candidate(cfg, tasks, seq, value, bound, cfg_bound if kept else bound,
                                "dp" if dp_bound is not None else "balanced",
                                tight=not (chain_ and S.stash(cfg)), tight_floor=not kept))
        if value < best[0]:
            best[0] = value
            S.say(f"[{done[0]}/{total}] {cfg}: model {value:.4f} s  <- best so far")
    _drop(ahead)
    return None


def _first_tasks(S: Search, cfg: Config, incumbent: Plan | None, hint_cfg: Config | None) -> Tasks:
    """The candidate tasks of ``cfg``, charged to ``S.budget``; the hint's configuration keeps the
    hint's pack boundaries."""
    return S.tasks(cfg, keep=pack_starts(incumbent) if cfg == hint_cfg else ())


def _first_of(S: Search, cfg: Config, incumbent: Plan | None, hint_cfg: Config | None):
    """(``_first_tasks``, the first solution or None), charged to ``S.budget``; the hint's
    configuration starts from the hint."""
    tasks = _first_tasks(S, cfg, incumbent, hint_cfg)
    hint = None
    if cfg == hint_cfg:
        try:
            hint = sequence_of_plan(tasks, incumbent)
        except KeyError:
            pass
    return tasks, (first_solution(S, tasks, hint) if len(tasks.table) else None)


def _first_ahead(cfg: Config, incumbent: Plan | None, hint_cfg: Config | None):
    """In a process of processes: (work seconds spent, first solution, task rows, whether the host
    budget may bind) of ``cfg``; None where the first solution reads the budget (a DP priced into
    the host memory, dp.within_host), left to the planner's own process."""
    S = dataclasses.replace(pool.FORKED, budget=Tally(pool.FORKED.budget.total), pool=None)
    try:
        tasks, first = _first_of(S, cfg, incumbent, hint_cfg)
    except NeedsBudget:
        return None
    return S.budget.spent, first, len(tasks.table), tasks.host_budget is not None


def _drop(ahead: dict) -> None:
    """Cancel the work computed ahead that the search did not reach."""
    for f in ahead.values():
        f.cancel()


def first_solution(S: Search, tasks: Tasks, hint):
    """(model value, sequence, bound or None) of a first solution: the DP's optimum for a chain,
    which also bounds the model's optimum over the plans without stash variants or kept
    gradients (the DP leaves out the link floors, the forward queue and the waits for the task two
    back, which can only add); the best of the hint
    and balanced packs in vPP (search.py), improved later."""
    if tasks.cfg.ranks == 1:
        S.budget.spend(Budget.dp(tasks))
        r = dp.solve_chain(tasks)
        if r is None:
            return None
        value = evaluate(tasks, r[1])
        if math.isinf(value) and tasks.host_budget is not None:     # its activation buffers overflow the host
            return dp.within_host(tasks, r, lambda: afford_dp(S, tasks))
        return value, r[1], r[0]
    starts, work = search.starts(tasks, S.profile, hint)
    S.budget.spend(Budget.PER_START * work)
    return (starts[0][0], starts[0][1], None) if starts else None


def afford_dp(S: Search, tasks: Tasks) -> bool:
    """Charge one more DP over ``tasks``; whether the budget has some left."""
    S.budget.spend(Budget.dp(tasks))
    return S.budget.left() > 0
