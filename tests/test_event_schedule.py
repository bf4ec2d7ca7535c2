"""The timeline model (solver_models/event_schedule.py) and the order of the transfers it chooses
(steps/order.py): it schedules the simulated events at least as well, its bounds hold for every
order, and a plan carries the order the simulator plays faster."""
import pytest
from hypothesis import given, settings, strategies as st

from harmony_opt import get_hardware
from harmony_opt.core.plan import ORDERED_STREAMS, Plan
from harmony_opt.sim.simulator import simulate
from harmony_opt.solver_models.planner import PlannerOptions, plan

from conftest import synthetic_profile


def test_timeline_model_schedules_the_simulated_events_at_least_as_well():
    from harmony_opt.solver_models.event_schedule import solve_timeline
    prof = synthetic_profile(R=10, seed=7)
    hw = get_hardware("1080ti-x4").with_gpus(2)
    cap = int(prof.costs("BWD", 4).pack_memory(0, 9) * 0.5)
    p = plan(prof, hw, 8, PlannerOptions(time_limit=3, hint=False), memory_cap=cap)
    r = solve_timeline(p, prof, hw, time_limit=2)
    assert r.status in ("OPTIMAL", "FEASIBLE")
    # the simulator's schedule is feasible for the model, so the optimum is no later; and it is
    # a real schedule of the same events, so it is no earlier than the model's own bound
    assert r.bound_s - 1e-6 <= r.makespan_s <= r.simulated_s + 1e-6
    assert len(r.starts) == r.events
    tl = p.solver["timeline"]
    carried = tl.get("transfer_order") or {}
    rule = carried["rule_simulated"] if carried.get("kept") else p.simulated_iteration_time_s
    assert tl["bound"] - 1e-6 <= tl["objective"] <= rule + 1e-6       # the model of the rule's order
    # the bound over every order of the transfers is a relaxation of the rule's order
    assert tl["order_bound"] <= tl["bound"] + 1e-9 and tl["order_gap"] >= tl["gap"] - 1e-9


def test_order_bound_holds_for_every_order_of_the_transfers():
    """Four vDP replicas on one host link: with the order inside each transfer stream free, CP-SAT
    proves an optimum below the rule order's, by running transfers in another order; the plan's
    order bound is below that optimum, and the schedule keeps each stream to one transfer at a
    time and every dependency."""
    from harmony_opt.sim.simulator import Expansion
    from harmony_opt.solver_models.event_schedule import TRANSFER_STREAMS, solve_timeline
    prof, hw = synthetic_profile(R=6, seed=0), get_hardware("1080ti-x4").with_gpus(4)
    p = Plan("t", "vDP", 4, 16, 4, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6)
    fixed = solve_timeline(p, prof, hw, time_limit=10)
    free = solve_timeline(p, prof, hw, time_limit=10, order="free", hint=fixed.starts)
    assert fixed.status == free.status == "OPTIMAL"
    assert fixed.order_bound_s <= free.makespan_s < fixed.makespan_s - 1e-4
    sim = Expansion(p, prof, hw, hw.gpu_memory_bytes, True)
    sim.build()
    ev, at = sim.events, free.starts
    ends = [s + e.duration for s, e in zip(at, ev)]
    assert all(at[k] >= ends[d] - 2e-6 for k, e in enumerate(ev) for d in e.deps)
    reordered = 0
    for (_, stream), q in sim.streams.items():
        if stream in TRANSFER_STREAMS:
            run = sorted(q, key=at.__getitem__)
            assert all(at[b] >= ends[a] - 2e-6 for a, b in zip(run, run[1:]))
            reordered += run != q
    assert reordered


def test_a_plan_carries_the_order_of_the_swaps_the_timeline_model_chose():
    """The timeline model with the order of the carried streams free (``order="carried"``) beats the
    rule's order on four vDP replicas sharing one link; the plan carrying its order
    (``TimelineResult.order``) has that schedule as its own: the fixed-order model of the ordered plan
    reaches it (within the stop gap), below the rule order's optimum, and simulates it."""
    from harmony_opt.sim.simulator import Expansion
    from harmony_opt.solver_models.event_schedule import _schedule_order, solve_timeline
    prof, hw = synthetic_profile(R=6, seed=0), get_hardware("1080ti-x4").with_gpus(4)
    p = Plan("t", "vDP", 4, 16, 4, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6)
    rule = solve_timeline(p, prof, hw, time_limit=10, rel_gap=0)
    chosen = solve_timeline(p, prof, hw, time_limit=10, order="carried", hint=rule.starts, rel_gap=0)
    assert rule.status == chosen.status == "OPTIMAL" and chosen.makespan_s < rule.makespan_s - 1e-4
    order = chosen.order
    assert order and {s for _, s, _ in order} <= {"swap_in", "swap_out", "free"}
    ordered = p.replace(transfer_order=order)
    own = solve_timeline(ordered, prof, hw, time_limit=10, rel_gap=0)
    assert own.status == "OPTIMAL" and own.makespan_s == pytest.approx(chosen.makespan_s, abs=1e-6)
    assert simulate(ordered, prof, hw).iteration_time > 0
    sim = Expansion(p, prof, hw, hw.gpu_memory_bytes, True)
    sim.build()
    assert _schedule_order(sim, rule.starts, ORDERED_STREAMS)[0] is None    # the rule's own schedule: no order


@pytest.mark.parametrize("time_limit", [2.0, 20.0])
def test_timeline_model_gets_at_most_a_tenth_of_a_short_time_limit(time_limit, monkeypatch):
    """The timeline model only reports on the chosen plan; its deterministic second can cost several
    wall seconds, so under a short --time-limit it must not take the rest of the budget (at most
    1 s, a tenth of the limit below 10 s)."""
    import harmony_opt.solver_models.steps.order as order
    from harmony_opt.solver_models.event_schedule import solve_timeline
    asked = []

    def timed(*a, **k):
        asked.append(k["time_limit"])
        return solve_timeline(*a, **k)
    monkeypatch.setattr(order, "solve_timeline", timed)
    prof = synthetic_profile(R=10, seed=7)
    hw = get_hardware("1080ti-x4").with_gpus(2)
    p = plan(prof, hw, 8, PlannerOptions(time_limit=time_limit), memory_cap=int(prof.costs("BWD", 4).pack_memory(0, 9)))
    # the plan's schedule, and where the order of the swaps could gain, the model choosing it
    assert 1 <= len(asked) <= 2 and all(0 < a <= min(1.0, 0.1 * time_limit) + 1e-9 for a in asked)
    assert p.solver["timeline"]["status"] in ("OPTIMAL", "FEASIBLE")


def test_timeline_bound_holds_when_the_search_has_no_time():
    """Out of budget, CP-SAT may prove nothing; the bound is then the longest precedence chain or the
    busiest stream: above zero, never above what the simulator achieves, and no weaker than CP-SAT's."""
    from harmony_opt.solver_models.event_schedule import solve_timeline
    prof = synthetic_profile(R=10, seed=7)
    hw = get_hardware("1080ti-x4").with_gpus(2)
    cap = int(prof.costs("BWD", 4).pack_memory(0, 9) * 0.5)
    p = plan(prof, hw, 8, PlannerOptions(time_limit=3, hint=False), memory_cap=cap)
    starved = solve_timeline(p, prof, hw, time_limit=1e-9)
    full = solve_timeline(p, prof, hw, time_limit=2)
    tl = simulate(p, prof, hw, memory_cap=cap)
    busiest = max(tl.busy_time("compute").values())
    assert busiest - 1e-5 <= starved.bound_s <= starved.simulated_s + 1e-6
    assert starved.bound_s <= full.makespan_s + 1e-6 and full.bound_s <= full.makespan_s + 1e-6


def test_timeline_reports_the_simulators_schedule_when_cp_sat_finds_none_in_its_time(monkeypatch):
    """Under a wall limit, CP-SAT may run out of time on thousands of events before it takes up its
    hint (bert_96 D=64, 4,668-6,356 events: no report in one walled benchmark run). The hint,
    the simulator's schedule, is a schedule of the model, and the floor bounds every one: the report
    gives both, and says so."""
    from ortools.sat.python import cp_model

    import harmony_opt.solver_models.event_schedule as timeline
    from harmony_opt.commands.planning import solver_summary

    class OutOfTime:
        def solve(self, model):
            return cp_model.UNKNOWN

        def status_name(self, status):
            return "UNKNOWN"
    prof = synthetic_profile(R=10, seed=7)
    hw = get_hardware("1080ti-x4").with_gpus(2)
    p = plan(prof, hw, 8, PlannerOptions(time_limit=2, hint=False))
    solved = timeline.solve_timeline(p, prof, hw, time_limit=2)
    monkeypatch.setattr(timeline.cpsat, "solver", lambda **kw: OutOfTime())
    r = timeline.solve_timeline(p, prof, hw, time_limit=2)
    assert r.status == timeline.HINT and len(r.starts) == r.events == solved.events
    assert abs(r.makespan_s - r.simulated_s) <= 1e-5
    assert r.bound_s <= solved.bound_s + 1e-6 and 0 < r.bound_s <= r.makespan_s and r.gap is not None
    line = solver_summary({"timeline": {"status": r.status, "objective": r.makespan_s, "bound": r.bound_s,
                                        "gap": r.gap}})[-1]
    assert "no schedule found in its time: the simulator's" in line and f"{r.makespan_s:.4f} s" in line


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 9), st.integers(0, 20)), min_size=1, max_size=6))
def test_one_machine_bound_is_the_best_subset_bound_and_no_schedule_beats_it(jobs):
    """Carlier's theorem, brute force: the preemptive Jackson value is the largest min release + sum of
    lengths + min tail over the subsets, and no order of the jobs, run without preemption, ends earlier."""
    import itertools
    from harmony_opt.solver_models.event_schedule import one_machine_bound
    release, length, tail = (list(c) for c in zip(*jobs))
    value = one_machine_bound(release, length, tail)
    n = len(jobs)
    subsets = (s for r in range(1, n + 1) for s in itertools.combinations(range(n), r))
    assert value == max(min(release[k] for k in s) + sum(length[k] for k in s) + min(tail[k] for k in s)
                        for s in subsets)

    def makespan(order):
        t, end = 0, 0
        for k in order:
            t = max(t, release[k]) + length[k]
            end = max(end, t + tail[k])
        return end
    assert value <= min(makespan(o) for o in itertools.permutations(range(n)))


def test_timeline_bound_counts_the_transfers_queueing_on_the_shared_link():
    """Four vDP replicas on one host link: their transfers, which the precedences let run side by
    side, queue on it. The link's one-machine bound lifts the timeline bound above the longest chain
    and the busiest stream, and stays below the optimum CP-SAT proves."""
    import math
    from harmony_opt.sim.simulator import Expansion
    from harmony_opt.solver_models.event_schedule import SCALE, _floor_ticks, link_resources, solve_timeline
    prof, hw = synthetic_profile(R=6, seed=1), get_hardware("1080ti-x4").with_gpus(4)
    bwd = [(0, 1), (2, 3), (4, 5)]
    p = Plan("t", "vDP", 4, 16, 2, 2, bwd[:-1], bwd, 6)
    sim = Expansion(p, prof, hw, hw.gpu_memory_bytes, True)
    sim.build()
    queues = {k: list(v) for k, v in sim.streams.items()}
    sim.run(with_timeline=False)
    ticks = lambda s: int(math.floor(s * SCALE))  # noqa: E731
    without = _floor_ticks(sim.events, queues, ticks) / SCALE
    starved = solve_timeline(p, prof, hw, time_limit=1e-9)
    best = solve_timeline(p, prof, hw, time_limit=10)
    assert best.status == "OPTIMAL"
    assert without * 1.05 < starved.bound_s <= best.makespan_s + 1e-6
    assert link_resources(sim.events, hw).keys() == {"h2d", "d2h"}


@pytest.mark.parametrize("handoff", [False, True])
def test_timeline_model_reserves_the_memory_the_simulator_does(handoff):
    """Replayed at the simulated times, the timeline model's memory reservations are the
    simulator's, gradients kept on the GPU included."""
    from harmony_opt.sim.simulator import Expansion
    from harmony_opt.sim.timeline import memory_steps
    from harmony_opt.solver_models.event_schedule import reservations
    prof, hw = synthetic_profile(R=6), get_hardware("1080ti-x4").with_gpus(2)
    bwd = [(0, 1), (2, 3), (4, 5)]
    p = Plan("t", "vDP", 2, 8, 2, 4, bwd[:-1], bwd, 6, gpu_handoff=handoff)
    sim = Expansion(p, prof, hw, hw.gpu_memory_bytes, True)
    sim.build()
    tl = sim.run(with_timeline=True)
    ev = sim.events
    deltas = {0: [], 1: []}
    for a, from_start, k, nbytes in reservations(ev):
        deltas[ev[k].rank] += [(ev[a].start if from_start else ev[a].end, nbytes), (ev[k].end, -nbytes)]
    for r in (0, 1):
        steps = memory_steps(r, deltas[r])
        want = [(t, b) for q, t, b in sim.reservations if q == r]
        assert [b for _, _, b in steps] == [b for _, b in want]
        assert [t for _, t, _ in steps] == pytest.approx([t for t, _ in want])
        assert max(b for _, b in want) == tl.meta["reserved_memory"][r]
    kept = [x for x in reservations(ev) if not x[1]]
    assert bool(kept) == handoff


def test_under_harmonys_cost_model_the_timeline_model_stays_out():
    """The timeline model schedules the default simulator's events, so under Harmony's cost model the
    plan has no timeline report and carries no order of its own (Harmony's simulator plays its rule
    only); the plan is still never slower than Harmony's search there."""
    prof, hw = synthetic_profile(R=8, seed=3), get_hardware("1080ti-x4").with_gpus(2)
    p = plan(prof, hw, 8, PlannerOptions(mode="vPP", gpus=2, time_limit=2, harmony_space=True, cost_model="harmony"))
    assert p.cost_model == "harmony" and p.solver["timeline"] is None and p.transfer_order is None
    assert p.solver["speedup_over_harmony"] >= 1 - 1e-9


def test_timeline_model_runs_a_ranks_events_one_at_a_time_without_copy_overlap():
    """copy_overlap false: the timeline model keeps each rank's compute, swap and P2P events apart, as
    the simulator's one engine per rank does: the simulator's schedule stays feasible (the model's
    makespan at most the simulated time), its floor counts each engine's whole work, and its schedule
    overlaps none of them."""
    import dataclasses

    from harmony_opt.sim.simulator import ENGINE_STREAMS, Expansion
    from harmony_opt.solver_models.event_schedule import solve_timeline
    prof = synthetic_profile(R=6, seed=3)
    hw = dataclasses.replace(get_hardware("1080ti-x4").with_gpus(2), copy_overlap=False, h2d_latency_s=1e-4,
                             d2h_latency_s=1e-4, issue_overhead_s=2e-4)
    p = Plan("t", "vPP", 2, 8, 2, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6)
    r = solve_timeline(p, prof, hw, time_limit=5)
    sim = Expansion(p, prof, hw, hw.gpu_memory_bytes, p.prefetch)
    sim.build()
    busy = {}
    for e in sim.events:
        if e.stream in ENGINE_STREAMS:
            busy[e.rank] = busy.get(e.rank, 0.0) + e.duration
    assert max(busy.values()) - 1e-5 <= r.bound_s <= r.makespan_s <= r.simulated_s + 1e-6
    for rank in busy:
        spans = sorted((r.starts[k], r.starts[k] + e.duration) for k, e in enumerate(sim.events)
                       if e.rank == rank and e.stream in ENGINE_STREAMS and e.duration > 0)
        assert all(b[0] >= a[1] - 2e-6 for a, b in zip(spans, spans[1:]))
