"""The default simulator: dependencies, streams, memory and bytes behave as the plan implies.

The property tests draw random valid plans (both modes, 1-3 GPUs, prefetch on or off,
uneven microbatches, per-pack recompute/stash and CPU/GPU optimizer, naive swapping,
with and without a GPU link) and check the simulated timeline against the plan's task
graph (harmony_opt.sim.taskgraph): every edge's data arrives before its consumer computes,
no stream runs two events at once, memory stays under the cap, and each link carries
exactly the bytes the graph's flows imply, tensor kind by tensor kind.
"""
import dataclasses
from collections import defaultdict

import pytest
from hypothesis import given, settings, strategies as st

from harmony_opt import PlanError, get_hardware, load_profile
from harmony_opt.core.plan import ORDERED_STREAMS, PackOptions, Plan, data_shares
from harmony_opt.core.profile import Profile
from harmony_opt.sim.bound import lower_bound
from harmony_opt.sim.simulator import Expansion, check_memory, count_events, simulate, tasks_of
from harmony_opt.sim.taskgraph import SOURCE_TENSOR, Medium, TaskKind, Tensor, link_bytes, task_graph

from conftest import synthetic_profile


def random_packs(draw, lo, hi):
    """Contiguous packs covering lo..hi."""
    cuts = sorted(draw(st.sets(st.integers(lo + 1, hi), max_size=hi - lo)) if hi > lo else [])
    starts = [lo] + cuts
    return [(s, e - 1) for s, e in zip(starts, cuts + [hi + 1])]


HW = get_hardware("1080ti-x4").with_gpus(3)
NO_P2P = dataclasses.replace(HW, p2p_bandwidth=0.0)


@st.composite
def plans(draw):
    """A random valid plan on a synthetic profile, and the hardware to play it on."""
    R = draw(st.integers(2, 9))
    prof = synthetic_profile(R=R, seed=draw(st.integers(0, 3)))
    mode = draw(st.sampled_from(["vPP", "vDP"]))
    gpus = draw(st.integers(1, 3))
    batch = draw(st.sampled_from([4, 6, 8, 10, 12]))
    hi = min(8, max(data_shares(batch, gpus)) if mode == "vDP" else batch)
    grouping = draw(st.integers(0, 4)) > 0
    uf = draw(st.integers(1, hi))
    ub = draw(st.integers(1, hi)) if grouping else uf
    bwd = random_packs(draw, 0, R - 1)
    fwd = random_packs(draw, 0, bwd[-1][0] - 1) if bwd[-1][0] > 0 else []
    hw = draw(st.sampled_from([HW, NO_P2P]))
    # a GPU optimizer step needs input-batch grouping, and in vDP an all-reduce over a GPU link
    gpu_step = grouping and not (mode == "vDP" and gpus > 1 and hw is NO_P2P)
    opts = tuple(PackOptions(recompute=draw(st.integers(0, 2)) > 0,
                             optimizer=draw(st.sampled_from(["cpu", "gpu"] if gpu_step else ["cpu"])))
                 for _ in bwd)
    plan = Plan("test", mode, gpus, batch, uf, ub, fwd, bwd, R, options=opts, allow_uneven=True,
                prefetch=draw(st.booleans()), input_batch_grouping=grouping, gpu_handoff=draw(st.booleans()))
    return prof, plan, hw


def expand(plan, prof, hw, cap):
    """The simulator's events (with their task graph nodes) and its timeline."""
    plan.check_against(prof, hw)
    check_memory(plan, prof, cap)
    sim = Expansion(plan, prof, hw, cap, plan.prefetch)
    sim.build()
    return sim, sim.run(with_timeline=True)


def check_against_graph(sim, graph) -> int:
    """Assert that the played events respect every edge of the task graph and every task's own
    inputs and outputs; return how many (edge, flow) pairs were checked."""
    by = defaultdict(list)
    for e in sim.events:
        by[(e.node, e.kind, e.microbatch)].append(e)

    def one(node, kind, mb=0, peer=None):
        found = [e for e in by[(node, kind, mb)] if peer is None or e.peer == peer]
        assert len(found) == 1, f"{len(found)} {kind} events of {node} microbatch {mb} for {peer}"
        return found[0]

    def after(later, earlier, what):
        assert later.start >= earlier.end, (f"{what}: {later.kind} of {later.node} mb {later.microbatch} starts at "
                                            f"{later.start} before {earlier.kind} of {earlier.node} mb "
                                            f"{earlier.microbatch} ends at {earlier.end}")

    def compute(node, mb):
        return one(node, "FWD" if node.kind == TaskKind.FWD else "BWD", mb)

    def last(node):
        return compute(node, len(graph.nodes[node]["microbatches"]) - 1)

    def consumer_step(v):
        d = graph.nodes[v]
        return one(v, "UPD") if d["device"] == "cpu" else one(v, "GPU_UPD")

    checked = 0
    for u, v, data in graph.edges(data=True):
        for f in data["flows"]:
            what = f"{u} -> {v} {f['tensor'].value} by {f['medium'].value}"
            t, m = f["tensor"], f["medium"]
            if t in (Tensor.X, Tensor.DY, Tensor.SX):
                for i, needs in enumerate(f["needs"]):
                    for k in needs:
                        if m == Medium.PIN:     # kept on the GPU: no transfer, read once computed
                            after(compute(v, i), compute(u, k), what)
                            continue
                        sent = one(u, SOURCE_TENSOR[t].value, k, peer=v)
                        after(sent, compute(u, k), what + " (sent after it is computed)")
                        if m == Medium.P2P:
                            after(compute(v, i), sent, what)
                        else:
                            got = one(v, t.value, i)
                            after(got, sent, what + " (swapped in after it is out)")
                            after(compute(v, i), got, what)
            elif t == Tensor.DW and m in (Medium.LOC, Medium.MSG):
                after(consumer_step(v), one(u, "dW"), what)
                after(one(u, "dW"), last(u), what)
            elif t == Tensor.DW and m == Medium.P2P:       # all-reduced contribution of another replica
                after(consumer_step(v), one(u, "ARD"), what)
                after(one(u, "ARD"), last(u), what)
            elif m == Medium.PIN and t in (Tensor.DW, Tensor.W):
                after(one(v, "GPU_UPD"), last(u), what)
            else:
                raise AssertionError(f"no rule to check {what}")
            checked += 1
    # each task's own inputs and outputs
    for node, d in graph.nodes(data=True):
        if node.kind == TaskKind.UPD:
            if d["device"] == "gpu":
                after(one(node, "GPU_UPD"), one(node, "K"), f"{node} optimizer state")
                after(one(node, "WK"), one(node, "GPU_UPD"), f"{node} write-back")
            continue
        w = one(node, "W")
        for i in range(len(d["microbatches"])):
            after(compute(node, i), w, f"{node} weights")
            for f in d["inputs"]:
                if f.medium == Medium.DAT:
                    after(compute(node, i), one(node, f.tensor.value, i), f"{node} data")
    return checked


#: Event kinds that carry a (link, tensor) of the graph when they are not the tensor's own name.
EVENT_KIND = {("h2d", Tensor.W): "W", ("h2d", Tensor.B): "W", ("d2h", Tensor.W): "WK", ("d2h", Tensor.K): "WK",
              ("p2p", Tensor.DW): "ARD"}


def bytes_by_kind(timeline) -> dict:
    ev = timeline.events
    link = ev.stream.map({"swap_in": "h2d", "swap_in_w": "h2d", "swap_out": "d2h", "p2p": "p2p"})
    sums = ev.assign(link=link).dropna(subset=["link"]).groupby(["link", "kind"])["bytes"].sum()
    return {k: int(v) for k, v in sums.items() if v}


@settings(max_examples=80, deadline=None)
@given(plans())
def test_timeline_respects_task_graph_streams_and_bytes(case):
    prof, plan, hw = case
    cap = 2**40
    graph = task_graph(plan, prof, hw)
    sim, tl = expand(plan, prof, hw, cap)
    assert check_against_graph(sim, graph) == sum(len(d["flows"]) for *_, d in graph.edges(data=True))
    ev = tl.events
    assert (ev.end >= ev.start).all()
    # no stream runs two events at once
    for _, g in ev.groupby(["rank", "stream"]):
        g = g.sort_values("start")
        assert (g.start.to_numpy()[1:] >= g.end.to_numpy()[:-1]).all()
    # the shared link carries one transfer per direction at a time (link_slots == 1)
    for streams in (("swap_in", "swap_in_w"), ("swap_out",)):
        g = ev[ev.stream.isin(streams) & (ev.end > ev.start)].sort_values("start")
        assert (g.start.to_numpy()[1:] >= g.end.to_numpy()[:-1]).all()
    assert max(tl.meta["reserved_memory"].values()) <= cap
    # every link carries what the graph's flows imply, tensor kind by tensor kind
    expected = defaultdict(int)
    for (link, tensor, _), b in link_bytes(graph, by_tensor=True).items():
        if b:
            expected[(link, EVENT_KIND.get((link, tensor), tensor.value))] += b
    assert bytes_by_kind(tl) == dict(expected)
    assert tl.bytes_moved() == link_bytes(graph)
    # and, independently of the graph: weights come in once per pack per replica and sweep
    sweeps = [len(plan.microbatches("FWD", r)) if not plan.input_batch_grouping else 1
              for r in range(plan.gpus if plan.mode == "vDP" else 1)]
    w = sum(int(prof.param_bytes(a, b) + prof.buffer_bytes(a, b)) for a, b in plan.packs_fwd + plan.packs_bwd)
    assert ev[ev.kind == "W"]["bytes"].sum() == sum(sweeps) * w
    assert tl.iteration_time == ev.end.max()
    assert set(tl.busy_time("compute")) <= set(range(plan.gpus))
    # the quick summary the planners use says the same
    quick = simulate(plan, prof, hw, memory_cap=cap, with_timeline=False)
    assert quick.iteration_time == tl.iteration_time
    assert quick.meta["bytes"] == tl.bytes_moved()
    assert quick.events.empty and quick.meta["reserved_memory"] == tl.meta["reserved_memory"]
    assert quick.meta["events"] == count_events(plan, prof, hw) == len(sim.events)


@settings(max_examples=60, deadline=None)
@given(plans())
def test_the_shared_link_serves_transfers_first_come_first_served(case):
    """A transfer that has waited for the host link is not overtaken by one that became ready
    after it on another GPU (a fixed GPU priority would starve the last GPUs of a vDP plan)."""
    prof, plan, hw = case
    sim, _ = expand(plan, prof, hw, 2**40)          # memory never holds a transfer back here
    ev = sim.events
    fifo = {b: a for q in sim.streams.values() for a, b in zip(q, q[1:])}
    ready = [max([0.0, *(ev[d].end for d in e.deps), *(ev[d].start for d in e.start_deps),
                  *([ev[fifo[k]].end] if k in fifo else [])]) for k, e in enumerate(ev)]
    by_link = defaultdict(list)
    for k, e in enumerate(ev):
        if e.link is not None:
            by_link[e.link].append(k)
    eps = 1e-12
    for ks in by_link.values():
        for b in ks:
            overtaken = [a for a in ks if ready[a] < ready[b] - eps and ready[a] <= ev[b].start
                         and ev[a].start > ev[b].start + eps]
            assert not overtaken, (ev[b], [ev[a] for a in overtaken])


@settings(max_examples=40, deadline=None)
@given(plans(), st.floats(0.3, 1.0))
def test_memory_cap_is_never_exceeded(case, frac):
    prof, plan, hw = case
    need = max(Expansion.task_memory(plan, prof, t) for t in tasks_of(plan) if t.kind != "U")
    cap = int(need / frac)   # every task fits; prefetch only when there is room
    graph = task_graph(plan, prof, hw)
    sim, tl = expand(plan, prof, hw, cap)
    assert max(tl.meta["reserved_memory"].values()) <= cap
    check_against_graph(sim, graph)
    with pytest.raises(PlanError, match="more than the cap"):
        simulate(plan, prof, hw, memory_cap=need - 1)


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


def test_a_pipeline_recomputes_while_its_output_gradient_is_on_the_way():
    """vPP on 2 GPUs: a backward pack whose dY comes from the other GPU recomputes a microbatch as
    soon as its weights and stashed input are in, and only its backward waits for dY, as the executor
    runs it (the compiled program's waits_on); the loss pack, without a dY, stays one event. The two
    events take the backward's profiled time together."""
    prof = synthetic_profile(R=6)
    plan = Plan("t", "vPP", 2, 8, 4, 4, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6)
    ev = simulate(plan, prof, HW).events
    rec, bwd = ev[ev.kind == "REC"], ev[ev.kind == "BWD"]
    assert set(rec.pack) == {"0-1", "2-3"}
    for pack, (a, b) in (("0-1", (0, 1)), ("2-3", (2, 3))):
        for mb in (0, 1):
            r = rec[(rec.pack == pack) & (rec.microbatch == mb)].iloc[0]
            w = bwd[(bwd.pack == pack) & (bwd.microbatch == mb)].iloc[0]
            assert r.end <= w.start + 1e-12
            assert (r.end - r.start) + (w.end - w.start) == pytest.approx(prof.costs("BWD", 4).pack_time(a, b))
    # dY of pack 2-3's first microbatch: the loss pack's dX sent over P2P; the recompute does not wait for it
    dy = ev[(ev.stream == "p2p") & (ev.kind == "dX") & (ev.pack == "4-5") & (ev.microbatch == 0)].iloc[0]
    first = rec[(rec.pack == "2-3") & (rec.microbatch == 0)].iloc[0]
    assert first.start < dy.end
    assert bwd[(bwd.pack == "2-3") & (bwd.microbatch == 0)].start.iloc[0] >= dy.end - 1e-12
    assert (bwd.pack == "4-5").sum() == 2 and not (rec.pack == "4-5").any()


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


def test_gpu_handoff_removes_the_gradients_round_trip_through_host_memory():
    """One microbatch per backward pack on one GPU: with gpu_handoff each activation gradient
    between consecutive backward packs stays on the GPU, so exactly those bytes leave the link."""
    prof = synthetic_profile(R=6)
    hw = get_hardware("1080ti-x4").with_gpus(1)
    bwd = [(0, 1), (2, 3), (4, 5)]
    host = Plan("t", "vDP", 1, 4, 2, 4, bwd[:-1], bwd, 6)
    kept = host.replace(gpu_handoff=True)
    a, b = simulate(host, prof, hw), simulate(kept, prof, hw)
    moved = lambda tl, kind: tl.events.query(f"kind == '{kind}'")["bytes"].sum()
    assert moved(b, "dX") == moved(b, "dY") == 0 and moved(a, "dX") == moved(a, "dY") > 0
    assert moved(b, "Y") == moved(a, "Y") > 0          # activations still go through host memory
    assert b.bytes_moved()["d2h"] == a.bytes_moved()["d2h"] - moved(a, "dX")
    assert b.bytes_moved()["h2d"] == a.bytes_moved()["h2d"] - moved(a, "dY")
    assert b.iteration_time < a.iteration_time
    # two microbatches per backward pack: through host memory as before
    two = host.replace(microbatch_bwd=2)
    assert simulate(two.replace(gpu_handoff=True), prof, hw).iteration_time == simulate(two, prof, hw).iteration_time


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


@settings(max_examples=60, deadline=None)
@given(plans())
def test_a_plan_carrying_the_rules_own_order_plays_the_same(case):
    """Plan.transfer_order names each transfer of the ordered streams once (simulator.Expansion.key),
    and an order equal to Harmony's rule changes nothing."""
    prof, plan, hw = case
    cap = 2**40
    sim, tl = expand(plan, prof, hw, cap)
    order = []
    for (rank, stream), q in sorted(sim.streams.items()):
        if stream in ORDERED_STREAMS:
            keys = tuple(sim.key(k) for k in q)
            assert len(set(keys)) == len(keys), (stream, keys)
            order.append((rank, stream, keys))
    same = simulate(plan.replace(transfer_order=order), prof, hw, memory_cap=cap)
    assert same.iteration_time == tl.iteration_time


def test_the_simulator_plays_the_plans_transfer_order():
    """Swap-outs and swap-ins run in the order the plan carries: named transfers take the places of the
    named ones, the rest keep theirs; a name the plan does not move is refused, naming it."""
    prof = synthetic_profile(R=6, seed=0)
    p = Plan("t", "vDP", 1, 8, 4, 4, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6)
    out = ("Y[4]@0+4", "Y[4]@4+4", "sX[2]@0+4", "sX[2]@4+4")      # rule: sX, Y, sX, Y of F[2-3]
    inp = ("dY[4]@0+4", "sX[2]@0+4", "dY[4]@4+4", "sX[2]@4+4")     # rule: sX before dY of B[2-3]
    q = p.replace(transfer_order=[(0, "swap_out", out), (0, "swap_in", inp)])
    sim, _ = expand(q, prof, HW, 2**40)
    for stream, keys in (("swap_out", out), ("swap_in", inp)):
        played = sorted(sim.streams[(0, stream)], key=lambda k: sim.events[k].start)
        names = [sim.key(k) for k in played]
        assert [k for k in names if k in keys] == list(keys)
        rule, _ = expand(p, prof, HW, 2**40)
        assert [rule.key(k) for k in rule.streams[(0, stream)] if rule.key(k) in keys] != list(keys)
        assert [k for k in names if k not in keys] == [rule.key(k) for k in rule.streams[(0, stream)]
                                                       if rule.key(k) not in keys]
    bad = p.replace(transfer_order=[(0, "swap_out", ("Y[5]@0+4",))])
    with pytest.raises(PlanError, match=r"rank 0 stream swap_out names Y\[5\]@0\+4, which this plan does not"):
        simulate(bad, prof, HW)
    backwards = tuple(reversed([rule.key(k) for k in rule.streams[(0, "swap_out")]]))   # dW before the outputs
    with pytest.raises(PlanError, match="deadlocked: .* its transfer_order runs a transfer before what it needs"):
        simulate(p.replace(transfer_order=[(0, "swap_out", backwards)]), prof, HW)
    from harmony_opt.harmony import simulate_harmony
    with pytest.raises(PlanError, match="Harmony's simulator swaps in Harmony's order only"):
        simulate_harmony(q, prof)


# -- the hardware's execution terms (docs/cost_model.md) ---------------------------------------------------
def _one_task():
    """One GPU, one backward pack holding the whole model (the loss pack: a recompute and a backward per
    microbatch), one microbatch, a CPU optimizer step: every event waits for the one before it (the
    weights and the data share the one link slot), so the iteration is their sum."""
    prof = synthetic_profile(R=3)
    hw = dataclasses.replace(get_hardware("1080ti-x4").with_gpus(1), p2p_bandwidth=0.0)
    return prof, hw, Plan("t", "vPP", 1, 2, 2, 2, [], [(0, 2)], 3)


def test_the_one_task_plan_is_the_sum_of_its_events():
    prof, hw, plan = _one_task()
    tl = simulate(plan, prof, hw)
    w = int(prof.param_bytes(0, 2))
    by = tl.events.groupby("kind").duration.sum() if "duration" in tl.events else \
        (tl.events.end - tl.events.start).groupby(tl.events.kind).sum()
    want = (w + int(prof.costs("BWD", 2).input[0])) / hw.h2d_bandwidth + prof.bwd_time(0, 2, 2) \
        + w / hw.d2h_bandwidth + float(prof.cpu_update_time(0, 2))
    assert tl.iteration_time == pytest.approx(want, rel=1e-12)
    assert by["BWD"] == pytest.approx(prof.bwd_time(0, 2, 2), rel=1e-12)


@pytest.mark.parametrize("term, value, delta", [
    ("h2d_latency_s", 3e-4, lambda p, v: 2 * v),                      # the weights and the data come in
    ("d2h_latency_s", 3e-4, lambda p, v: v),                          # the gradients go out
    ("compute_scale", 0.5, lambda p, v: (v - 1) * p.bwd_time(0, 2, 2)),
    ("compute_scale", 2.5, lambda p, v: (v - 1) * p.bwd_time(0, 2, 2)),
    ("issue_overhead_s", 2e-4, lambda p, v: 2 * v),                   # the recompute and the backward
    ("cpu_optimizer_call_s", 1e-3, lambda p, v: v),                   # one CPU step
    ("copy_overlap", False, lambda p, v: 0.0),                        # nothing overlaps in this plan anyway
    ("collective_bandwidth", 1e9, lambda p, v: 0.0),                  # no all-reduce on one GPU
])
def test_each_execution_term_changes_the_one_task_plan_by_what_it_charges(term, value, delta):
    prof, hw, plan = _one_task()
    base = simulate(plan, prof, hw).iteration_time
    got = simulate(plan, prof, dataclasses.replace(hw, **{term: value})).iteration_time
    assert got - base == pytest.approx(delta(prof, value), rel=1e-9, abs=1e-12)


def test_a_stashed_pack_issues_one_instruction_per_microbatch_and_a_gpu_step_one():
    """Two backward packs on one GPU, the first stashed, its optimizer on the GPU: per microbatch one
    instruction for it (no recompute), two for the loss pack, one for the GPU step."""
    prof = synthetic_profile(R=4)
    hw = dataclasses.replace(get_hardware("1080ti-x4").with_gpus(1), p2p_bandwidth=0.0)
    plan = Plan("t", "vPP", 1, 4, 2, 2, [(0, 1)], [(0, 1), (2, 3)], 4,
                options=(PackOptions(recompute=False, optimizer="gpu"), PackOptions()))
    issue = 1e-4
    a = simulate(plan, prof, hw).events
    b = simulate(plan, prof, dataclasses.replace(hw, issue_overhead_s=issue)).events
    dur = lambda ev, q: float((ev.query(q).end - ev.query(q).start).sum())  # noqa: E731
    for q, n in (("kind == 'FWD'", 2), ("kind == 'BWD' and pack == '0-1'", 2), ("kind == 'BWD' and pack == '2-3'", 4),
                 ("kind == 'GPU_UPD'", 1)):
        assert dur(b, q) - dur(a, q) == pytest.approx(n * issue, rel=1e-9), q


def test_a_gpu_step_pays_its_call_and_each_parameter_tensor():
    """The executor's step on the device loops over the pack's parameters: a step of a pack whose two
    layers hold 3 and 5 tensors lasts the call plus 8 tensors' cost more; without the counts (Harmony's
    profiles), one tensor per layer with parameters."""
    counted = synthetic_profile(R=4)
    counted = dataclasses.replace(counted, layers=counted.layers.assign(param_tensors=[3, 5, 2, 2]))
    hw = dataclasses.replace(get_hardware("1080ti-x4").with_gpus(1), p2p_bandwidth=0.0)
    plan = Plan("t", "vPP", 1, 4, 2, 2, [(0, 1)], [(0, 1), (2, 3)], 4,
                options=(PackOptions(optimizer="gpu"), PackOptions()))
    call, per = 2e-4, 3e-5
    step = lambda prof, h: simulate(plan, prof, h).events.query("kind == 'GPU_UPD'")  # noqa: E731
    for prof, tensors in ((counted, 8), (synthetic_profile(R=4), 2)):
        a = step(prof, hw)
        b = step(prof, dataclasses.replace(hw, gpu_optimizer_call_s=call, gpu_optimizer_tensor_s=per))
        assert len(a) == 1 and prof.param_tensor_count(0, 1) == tensors
        assert float((b.end - b.start).sum() - (a.end - a.start).sum()) == pytest.approx(call + tensors * per)


def test_each_send_between_gpus_pays_the_p2p_latency():
    """A vPP plan on two GPUs hands Y and dX over the GPU link: each send lasts p2p_latency_s more."""
    prof = synthetic_profile(R=4)
    hw = get_hardware("1080ti-x4").with_gpus(2)
    plan = Plan("t", "vPP", 2, 8, 2, 2, [(0, 1)], [(0, 1), (2, 3)], 4)
    a = simulate(plan, prof, hw).events.query("stream == 'p2p'")
    b = simulate(plan, prof, dataclasses.replace(hw, p2p_latency_s=1e-3)).events.query("stream == 'p2p'")
    assert len(a) == len(b) > 0
    assert list(b.end - b.start) == pytest.approx(list(a.end - a.start + 1e-3), rel=1e-9)


def test_the_all_reduce_runs_at_the_collective_bandwidth():
    prof = synthetic_profile(R=4)
    hw = get_hardware("1080ti-x4").with_gpus(2)
    plan = Plan("t", "vDP", 2, 8, 2, 2, [(0, 1)], [(0, 1), (2, 3)], 4)
    for bw in (None, 1e9):
        ev = simulate(plan, prof, dataclasses.replace(hw, collective_bandwidth=bw)).events.query("kind == 'ARD'")
        w = ev.pack.map(lambda p: int(prof.param_bytes(*map(int, p.split("-")))))
        assert list(ev.end - ev.start) == pytest.approx(list(w / (bw or hw.p2p_bandwidth)), rel=1e-12)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(plans())
def test_without_copy_overlap_a_rank_runs_one_event_at_a_time(case):
    """copy_overlap false: a rank's compute, swap and P2P events never overlap, so the iteration lasts
    at least the sum of their durations on every rank; never less than with overlap (where the
    simulator's greedy dispatch is the same)."""
    prof, plan, hw = case
    serial = dataclasses.replace(hw, copy_overlap=False)
    cap = plan.memory_cap or hw.gpu_memory_bytes
    sim, tl = expand(plan, prof, serial, cap)
    ev = tl.events[tl.events.stream.isin(["compute", "swap_in_w", "swap_in", "swap_out", "p2p"])]
    for rank, rows in ev.groupby("rank"):
        rows = rows.sort_values(["start", "end"])
        assert (rows.start.to_numpy()[1:] >= rows.end.to_numpy()[:-1] - 1e-12).all()
        assert tl.iteration_time >= float((rows.end - rows.start).sum()) - 1e-9
    check_against_graph(sim, task_graph(plan, prof, serial))


def test_without_copy_overlap_a_rank_runs_its_events_in_task_order():
    """On one engine per rank (the CPU device, whose executor runs a rank's program in order) a
    microbatch's output leaves before the next microbatch of the same pack computes, so the next GPU of
    a pipeline starts on it at once; granted first come, first served, the engine ran the next
    microbatch first (its input had been ready longer) and held every send behind it."""
    prof = synthetic_profile(R=6)
    hw = dataclasses.replace(get_hardware("1080ti-x4").with_gpus(2), copy_overlap=False)
    plan = Plan("t", "vPP", 2, 8, 2, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6)
    ev = simulate(plan, prof, hw).events
    sends = ev[(ev.stream == "p2p") & ev.kind.isin(["Y", "dX"])]
    assert len(sends) == 4 * 4        # Y of two forward packs, dX of two backward packs, 4 microbatches each
    compute = ev[ev.stream == "compute"].set_index(["rank", "pack", "kind", "microbatch"])
    for s in sends.itertuples():
        nxt = (s.rank, s.pack, "FWD" if s.kind == "Y" else "BWD", s.microbatch + 1)
        if nxt in compute.index:
            assert compute.loc[nxt, "start"] >= s.end - 1e-12, s


@settings(max_examples=40, deadline=None, derandomize=True)
@given(plans(), st.fixed_dictionaries({
    "copy_overlap": st.booleans(), "h2d_latency_s": st.sampled_from([0.0, 1e-4]), "d2h_latency_s": st.sampled_from([0.0, 1e-4]),
    "p2p_latency_s": st.sampled_from([0.0, 1e-4]), "compute_scale": st.sampled_from([0.01, 0.5, 1.0, 2.0]),
    "cpu_optimizer_call_s": st.sampled_from([0.0, 1e-3]), "gpu_optimizer_call_s": st.sampled_from([0.0, 1e-3]),
    "gpu_optimizer_tensor_s": st.sampled_from([0.0, 1e-4]),
    "issue_overhead_s": st.sampled_from([0.0, 1e-4, 1e-3]), "collective_bandwidth": st.sampled_from([None, 1e8])}),
    st.floats(0.3, 1.0), st.sampled_from([1.0, 100.0]))
def test_the_lower_bound_holds_with_the_hardwares_execution_terms(case, terms, frac, slow):
    """harmony_opt.sim.bound scales the kernel times as the simulator does and counts only terms every
    plan pays: never above a plan. ``slow``: a profile whose kernels took that much longer, run at
    compute_scale 0.01 too, where a bound from the profile's times would pass the plan by far."""
    prof, plan, hw = case
    if slow != 1.0:
        prof = Profile(prof.name, prof.layers, prof.microbatch.assign(gpu_time_s=prof.microbatch.gpu_time_s * slow),
                       prof.meta)
    hw = dataclasses.replace(hw, **terms)
    need = max(Expansion.task_memory(plan, prof, t) for t in tasks_of(plan) if t.kind != TaskKind.UPD)
    cap = int(need / frac)      # tight caps: weights must come in, which the bound counts
    assert lower_bound(prof, hw, plan.batch, cap)["bound_s"] <= simulate(plan, prof, hw, memory_cap=cap).iteration_time


def test_the_loss_pack_runs_its_forward_whatever_its_option_says():
    """The loss pack's forward is its recompute (compile.stash_modes); a plan that says recompute=False
    for it was simulated with its backward from a kept graph and its forward nowhere: one pack of two
    layers on 3 GPUs, 100x slow kernels, played 0.712 s under the 0.753 s every plan needs."""
    prof = synthetic_profile(R=2, seed=0)
    prof = Profile(prof.name, prof.layers, prof.microbatch.assign(gpu_time_s=prof.microbatch.gpu_time_s * 100),
                   prof.meta)
    hw = get_hardware("1080ti-x4").with_gpus(3)
    said = Plan("t", "vDP", 3, 6, 2, 2, [], [(0, 1)], 2, options=(PackOptions(recompute=False),),
                prefetch=False, input_batch_grouping=False)
    assert said.options[-1].recompute
    t = simulate(said, prof, hw).iteration_time
    assert t == simulate(said.replace(options=(PackOptions(),)), prof, hw).iteration_time
    assert lower_bound(prof, hw, 6)["bound_s"] <= t


def _with_stash_times(prof: Profile, fwd: float, bwd: float) -> Profile:
    """``prof`` with stash-path times: each forward ``fwd`` x its plain one, each backward ``bwd`` x its
    recomputing one."""
    m = prof.microbatch
    return Profile(prof.name, prof.layers, m.assign(stash_time_s=m.gpu_time_s * m.phase.map({"FWD": fwd, "BWD": bwd})),
                   prof.meta)


def test_a_stashed_pack_costs_its_measured_stash_path():
    """With stash times in the profile, the forward of the stashed layers costs their stashing forward and
    the stashed pack's backward its measured backward from the kept graph; a recompute plan is unchanged."""
    base = synthetic_profile(R=4)
    prof = _with_stash_times(base, fwd=1.5, bwd=0.3)
    hw = dataclasses.replace(get_hardware("1080ti-x4").with_gpus(1), p2p_bandwidth=0.0)
    plan = Plan("t", "vPP", 1, 4, 2, 2, [(0, 1)], [(0, 1), (2, 3)], 4,
                options=(PackOptions(recompute=False), PackOptions()))
    dur = lambda ev, q: float((ev.query(q).end - ev.query(q).start).sum())  # noqa: E731
    ev = simulate(plan, prof, hw).events
    assert dur(ev, "kind == 'FWD'") == pytest.approx(2 * 1.5 * base.fwd_time(0, 1, 2), rel=1e-9)
    assert dur(ev, "kind == 'BWD' and pack == '0-1'") == pytest.approx(2 * 0.3 * base.bwd_time(0, 1, 2), rel=1e-9)
    # without stash times: the plain forward, and the backward less the forward
    ev = simulate(plan, base, hw).events
    assert dur(ev, "kind == 'FWD'") == pytest.approx(2 * base.fwd_time(0, 1, 2), rel=1e-9)
    assert dur(ev, "kind == 'BWD' and pack == '0-1'") == pytest.approx(
        2 * (base.bwd_time(0, 1, 2) - base.fwd_time(0, 1, 2)), rel=1e-9)
    recompute = dataclasses.replace(plan, options=())
    assert simulate(recompute, prof, hw).iteration_time == pytest.approx(simulate(recompute, base, hw).iteration_time,
                                                                         rel=1e-12)


def test_only_the_stashed_layers_of_a_forward_pack_run_the_stash_path():
    """A forward pack over two backward packs, one stashed: only that one's layers cost the stash forward."""
    base = synthetic_profile(R=5)
    prof = _with_stash_times(base, fwd=2.0, bwd=0.5)
    hw = dataclasses.replace(get_hardware("1080ti-x4").with_gpus(1), p2p_bandwidth=0.0)
    plan = Plan("t", "vPP", 1, 2, 2, 2, [(0, 3)], [(0, 1), (2, 3), (4, 4)], 5,
                options=(PackOptions(), PackOptions(recompute=False), PackOptions()))
    ev = simulate(plan, prof, hw).events.query("kind == 'FWD'")
    assert float((ev.end - ev.start).sum()) == pytest.approx(base.fwd_time(0, 3, 2) + base.fwd_time(2, 3, 2), rel=1e-9)


@pytest.mark.parametrize("mode,gpus", [("vPP", 1), ("vPP", 2), ("vDP", 2)])
def test_a_launch_bound_host_sets_the_step(mode, gpus):
    """With ``host_instruction_s`` the step lasts at least what each rank's issuing thread spends: its
    compute events' time (it launches their kernels) and the per-instruction cost of every event it
    issues (frees and CPU steps aside). Where that is short of the events' span, nothing changes."""
    prof = synthetic_profile(R=8)
    plan = Plan("test", mode, gpus, 8, 2, 2, [(0, 2), (3, 5)], [(0, 0), (1, 3), (4, 5), (6, 7)], 8)
    hw = get_hardware("1080ti-x4").with_gpus(gpus)
    base = simulate(plan, prof, hw)
    ev = base.events[base.events.stream != "cpu"]
    compute = ev[ev.stream == "compute"]
    busy = (compute.end - compute.start).groupby(compute["rank"]).sum()
    count = ev.groupby("rank").size()
    per = 10 * base.iteration_time / len(ev)            # enough to outlast the events
    slow = simulate(plan, prof, dataclasses.replace(hw, host_instruction_s=per))
    want = max(busy.get(r, 0.0) + count[r] * per for r in count.index)
    assert slow.iteration_time == pytest.approx(want) and slow.iteration_time > base.iteration_time
    assert slow.meta["host_bound"] == pytest.approx(want - base.iteration_time)
    # the events themselves play as before: the host's floor only lengthens the step
    assert slow.events.end.max() == pytest.approx(base.iteration_time)
    quick = simulate(plan, prof, dataclasses.replace(hw, host_instruction_s=1e-12))
    assert quick.iteration_time == pytest.approx(base.iteration_time) and "host_bound" not in quick.meta
    assert simulate(plan, prof, dataclasses.replace(hw, host_instruction_s=per), with_timeline=False
                    ).iteration_time == pytest.approx(want)
