"""Steps 6 and 7 of plan(): the timeline model (CP-SAT) of the chosen plan's events, its proof, and where it
pays, the order of the transfers in their streams that the plan then carries."""
from __future__ import annotations

import math


from harmony_opt.compile.compiler import compile_plan
from harmony_opt.core.errors import PlanError
from harmony_opt.core.plan import Plan

from ..budget import MIN_TIMELINE_LIMIT, TIMELINE_REL_GAP, Budget, timeline_slowness
from ..event_schedule import solve_timeline
from ..state import Search


def timeline_of(S: Search, plan_: Plan) -> tuple[dict | None, object]:
    """Step 6: the timeline model of the plan's events, with what is left of the budget, at most a
    tenth of the time limit: its deterministic second costs 0.4-6 wall seconds depending on the plan
    (gpt2_xl D=7 on 4 GPUs, 387 events: 6), so a short limit is not overrun by a model that only
    reports on the plan. Returns its report and result."""
    tr = _solve_timeline(S, plan_)
    if tr is None:
        return None, None
    return {"status": tr.status, "objective": tr.makespan_s, "bound": tr.bound_s, "gap": tr.gap,
            "order_bound": tr.order_bound_s, "order_gap": tr.order_gap, "events": tr.events,
            "wall_time_s": tr.wall_time}, tr


def _solve_timeline(S: Search, plan_: Plan, **kw):
    """solve_timeline under the budget (see timeline_of); None where too little of it is left, or under
    Harmony's cost model (the model schedules the default simulator's events)."""
    if S.timeline_share <= 0:
        return None
    limit = S.timeline_limit(plan_)
    if limit < MIN_TIMELINE_LIMIT:
        return None
    events = S.events_of(plan_)
    slow = timeline_slowness(events)
    S.budget.spend(Budget.PER_TIMELINE_EVENT * events + limit * slow)
    limits = S.budget.cp_sat_limits(limit)
    if limits["wall_limit"] is not None:        # the model's building counts against the wall too
        limits["wall_limit"] = max(0.05, limits["wall_limit"] - Budget.PER_TIMELINE_EVENT * events)
    tr = solve_timeline(plan_, S.profile, S.hw, **limits, seed=S.opts.seed, workers=S.opts.workers, report=S.say,
                        rel_gap=TIMELINE_REL_GAP, **kw)
    S.budget.solved(tr.status, tr.wall_time, limits)
    return tr


def transfer_order(S: Search, plan_: Plan, t: float, fixed) -> tuple[Plan, float, dict | None]:
    """Step 7: the order of the swaps. Where the bound over every order of the transfers leaves more
    than TIMELINE_REL_GAP below the simulated time and budget is left, the timeline model also
    chooses the order of the streams a plan carries (``order="carried"``), from its schedule in the
    rule's order; the plan carries that order (Plan.transfer_order) where the simulator, the judge,
    plays it faster. On the benchmark's plans the search mostly spends the budget first, so this
    runs where it finished early (resnet1026 D=32 on 2 GPUs: 3.5512 -> 3.5396 s)."""
    if fixed is None or not fixed.starts or not math.isfinite(t) or 1 - fixed.order_bound_s / t <= TIMELINE_REL_GAP:
        return plan_, t, None
    tr = _solve_timeline(S, plan_, order="carried", hint=fixed.starts)
    if tr is None or not tr.starts:
        return plan_, t, None
    report = {"status": tr.status, "objective": tr.makespan_s, "bound": tr.bound_s, "wall_time_s": tr.wall_time,
              "streams": 0, "simulated": None, "rule_simulated": t, "kept": False}
    order = tr.order if tr.makespan_s < t else None
    if order is not None and not issuable(plan_.replace(transfer_order=order)):
        S.say("transfer order of the timeline model: the compiler cannot issue it (a transfer would come "
              "before what it moves is made): kept the rule's")
        report["not_issuable"] = True
        order = None
    if order is not None:
        ordered = plan_.replace(transfer_order=order)
        t_ordered = S.judge(ordered)
        report.update(streams=len(order), simulated=t_ordered, kept=t_ordered < t)
        S.say(f"transfer order of the timeline model: {len(order)} stream(s) reordered, simulated "
              f"{S.shown(t_ordered)} against {S.shown(t)} in the rule's order"
              + ("" if t_ordered < t else ": kept the rule's"))
        if t_ordered < t:
            return ordered, t_ordered, report
    return plan_, t, report


def issuable(plan_: Plan) -> bool:
    """Whether the compiler can issue ``plan_``'s transfer order (the simulator's events and the
    program's instructions differ in what they may start before: P2P, host parking)."""
    try:
        compile_plan(plan_)
    except PlanError:
        return False
    return True
