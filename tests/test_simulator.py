"""The default simulator: dependencies, streams, memory and bytes behave as the plan implies."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from harmony_opt import PlanError, get_hardware, load_profile
from harmony_opt.plan import Plan
from harmony_opt.simulator import simulate, tasks_of

from conftest import synthetic_profile


def random_packs(draw, lo, hi):
    """Contiguous packs covering lo..hi."""
    cuts = sorted(draw(st.sets(st.integers(lo + 1, hi), max_size=hi - lo)) if hi > lo else [])
    starts = [lo] + cuts
    return [(s, e - 1) for s, e in zip(starts, cuts + [hi + 1])]


@st.composite
def plans(draw):
    R = draw(st.integers(2, 9))
    prof = synthetic_profile(R=R, seed=draw(st.integers(0, 3)))
    mode = draw(st.sampled_from(["vPP", "vDP"]))
    gpus = draw(st.integers(1, 3))
    batch = draw(st.sampled_from([4, 8, 12]))
    share = batch if mode == "vPP" else batch // gpus
    uf = draw(st.sampled_from([u for u in (1, 2, 4, 8) if u <= share]))
    ub = draw(st.sampled_from([u for u in (1, 2, 4, 8) if u <= share]))
    bwd = random_packs(draw, 0, R - 1)
    fwd = random_packs(draw, 0, bwd[-1][0] - 1) if bwd[-1][0] > 0 else []
    plan = Plan("test", mode, gpus, batch, uf, ub, fwd, bwd, R, allow_uneven=True,
                prefetch=draw(st.booleans()))
    return prof, plan


HW = get_hardware("1080ti-x4").with_gpus(3)


@settings(max_examples=60, deadline=None)
@given(plans())
def test_timeline_respects_streams_memory_and_bytes(case):
    prof, plan = case
    cap = 2**40
    tl = simulate(plan, prof, HW, memory_cap=cap)
    ev = tl.events
    assert (ev.end >= ev.start).all()
    # no stream runs two events at once
    for _, g in ev.groupby(["rank", "stream"]):
        g = g.sort_values("start")
        assert (g.start.to_numpy()[1:] >= g.end.to_numpy()[:-1] - 1e-12).all()
    # the shared link carries one transfer per direction at a time (link_slots == 1)
    for streams in (("swap_in", "swap_in_w"), ("swap_out",)):
        g = ev[ev.stream.isin(streams) & (ev.end > ev.start)].sort_values("start")
        assert (g.start.to_numpy()[1:] >= g.end.to_numpy()[:-1] - 1e-9).all()
    assert max(tl.peak_memory().values()) <= cap
    # weights come in once per pack per iteration (input-batch grouping), on every replica
    R = prof.num_layers
    replicas = plan.gpus if plan.mode == "vDP" else 1
    w_in = ev[ev.kind == "W"]["bytes"].sum()
    expected = replicas * (sum(int(prof.param_bytes(a, b)) for a, b in plan.packs_fwd)
                           + sum(int(prof.param_bytes(a, b)) for a, b in plan.packs_bwd))
    assert w_in == expected
    # forward before backward: every BWD compute of a pack starts after the FWD computes feeding it
    assert tl.iteration_time == pytest.approx(ev.end.max())
    assert set(tl.busy_time("compute")) <= set(range(plan.gpus))


@settings(max_examples=30, deadline=None)
@given(plans(), st.floats(0.3, 0.9))
def test_memory_cap_is_never_exceeded(case, frac):
    prof, plan = case
    from harmony_opt.simulator import _Expansion
    need = max(_Expansion.task_memory(plan, prof, t) for t in tasks_of(plan) if t.kind != "U")
    cap = int(need / frac)   # every task fits; prefetch only when there is room
    tl = simulate(plan, prof, HW, memory_cap=cap)
    assert max(tl.peak_memory().values()) <= cap


def test_dependencies_order_forward_then_backward():
    prof = synthetic_profile(R=6)
    plan = Plan("t", "vPP", 2, 8, 2, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6)
    ev = simulate(plan, prof, HW).events
    f_end = ev[(ev.kind == "FWD")].end.max()
    first_b = ev[(ev.kind == "BWD")].start.min()
    assert first_b >= ev[(ev.kind == "FWD") & (ev.pack == "2-3")].end.min()
    upd = ev[ev.kind == "UPD"]
    dw = ev[ev.kind == "dW"]
    for pack in upd.pack:
        assert upd[upd.pack == pack].start.min() >= dw[dw.pack == pack].end.max() - 1e-12
    assert f_end <= ev.end.max()


def test_prefetch_hides_weight_swaps():
    prof = load_profile("gpt2_xl")
    hw = get_hardware("1080ti-x4", memory_cap=9e9)
    R = prof.num_layers
    bwd = [(i, min(i + 3, R - 1)) for i in range(0, R, 4)]
    base = Plan("t", "vPP", 4, 64, 4, 2, bwd[:-1], bwd, R)
    on = simulate(base, prof, hw).iteration_time
    off = simulate(base.replace(prefetch=False), prof, hw).iteration_time
    assert on < off


def test_naive_swap_moves_weights_per_microbatch():
    prof = synthetic_profile(R=4)
    hw = get_hardware("1080ti-x4").with_gpus(1)
    bwd = [(l, l) for l in range(4)]
    grouped = Plan("t", "vDP", 1, 8, 2, 2, bwd[:-1], bwd, 4)
    naive = grouped.replace(input_batch_grouping=False)
    wg = simulate(grouped, prof, hw).events.query("kind == 'W'")["bytes"].sum()
    wn = simulate(naive, prof, hw).events.query("kind == 'W'")["bytes"].sum()
    assert wn == 4 * wg   # 8 samples / microbatch 2 = 4 sweeps


def test_invalid_plans_are_refused():
    prof = synthetic_profile(R=4)
    with pytest.raises(PlanError, match="more than the cap"):
        simulate(Plan("t", "vPP", 1, 8, 2, 2, [], [(0, 3)], 4), prof, HW, memory_cap=2**20)
    with pytest.raises(PlanError, match="layers"):
        simulate(Plan("t", "vPP", 1, 8, 2, 2, [], [(0, 4)], 5), prof, HW)
    with pytest.raises(PlanError, match="GPUs"):
        simulate(Plan("t", "vPP", 4, 8, 2, 2, [], [(0, 3)], 4), prof, HW)


def test_trace_and_plot(tmp_path):
    prof = synthetic_profile(R=4)
    tl = simulate(Plan("t", "vPP", 2, 8, 2, 2, [(0, 1)], [(0, 1), (2, 3)], 4), prof, HW)
    import json
    trace = json.loads(tl.to_chrome_trace(tmp_path / "t.json").read_text())
    assert any(e["ph"] == "X" for e in trace["traceEvents"])
    assert tl.plot(tmp_path / "g.png").stat().st_size > 10_000
