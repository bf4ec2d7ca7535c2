"""The task graph: Harmony's order, placement and media; flows and their bytes; validation."""
import dataclasses

import networkx as nx
import pytest
from hypothesis import given, settings, strategies as st

from harmony_opt import PlanError, get_hardware
from harmony_opt.core.plan import PackOptions, Plan
from harmony_opt.sim.taskgraph import (Task, TaskKind, Tensor, compose, format_task_table, link_bytes, placement,
                                   rebatch_needs, stash_pieces, task_graph, validate)

from conftest import synthetic_profile

HW = get_hardware("1080ti-x4").with_gpus(3)
NO_P2P = dataclasses.replace(HW, p2p_bandwidth=0.0)


def names(graph_or_nodes):
    return [str(t) for t in (graph_or_nodes.graph["order"] if isinstance(graph_or_nodes, nx.DiGraph)
                             else [n.task for n in graph_or_nodes])]


def media(nodes) -> dict:
    """(task, direction, tensor) -> medium, for a compact comparison with literal tables."""
    out = {}
    for n in nodes:
        for d, flows in (("in", n.inputs), ("out", n.outputs)):
            for f in flows:
                out.setdefault((str(n.task), d, f.tensor.value), set()).add(f.medium.value)
    return {k: "/".join(sorted(v)) for k, v in out.items()}


# -- the compact form ----------------------------------------------------------------------------------
@given(st.sampled_from(list(TaskKind)), st.integers(0, 500), st.integers(0, 50), st.integers(0, 7),
       st.one_of(st.none(), st.integers(0, 99)))
def test_task_string_round_trips(kind, a, length, rank, sweep):
    t = Task(kind, (a, a + length), rank, sweep)
    assert Task.from_str(str(t)) == t
    assert str(Task.from_str(str(t))) == str(t)


def test_task_string_grammar():
    assert str(Task(TaskKind.F, (4, 7), 1)) == "F[4-7]@1"
    assert str(Task(TaskKind.B, (0, 3), 2, 5)) == "B[0-3]#5@2"
    assert Task.from_str("U[8-9]@0") == Task(TaskKind.UPD, (8, 9), 0)
    assert TaskKind.F is TaskKind.FWD and TaskKind("B") is TaskKind.BWD and TaskKind.UPD == "U"
    for bad in ("F[4-7]", "X[1-2]@0", "F[4-7]@1x", "F[a-7]@1"):
        with pytest.raises(ValueError, match="not a task"):
            Task.from_str(bad)


# -- order and placement (HARMONY_REFERENCE.md 5.1-5.2) ------------------------------------------------
def test_vpp_round_robin_order():
    prof = synthetic_profile(R=8)
    plan = Plan("t", "vPP", 2, 4, 2, 2, [(0, 1), (2, 3), (4, 5)], [(0, 2), (3, 4), (5, 5), (6, 7)], 8)
    assert [str(p) for p in placement(plan)] == [
        "F[0-1]@0", "F[2-3]@1", "F[4-5]@0",
        "B[6-7]@1", "U[6-7]@1", "B[5-5]@0", "U[5-5]@0", "B[3-4]@1", "U[3-4]@1", "B[0-2]@0", "U[0-2]@0"]
    assert names(compose(plan, prof, HW)) == [str(p) for p in placement(plan)]


def test_vdp_replicates_and_naive_swapping_sweeps():
    prof = synthetic_profile(R=4)
    plan = Plan("t", "vDP", 2, 8, 2, 2, [(0, 1)], [(0, 1), (2, 3)], 4, input_batch_grouping=False)
    # 4 samples per GPU, microbatch 2: two sweeps per replica; CPU updates only after the last sweep
    assert names(compose(plan, prof, HW)) == [
        "F[0-1]#0@0", "B[2-3]#0@0", "B[0-1]#0@0",
        "F[0-1]#1@0", "B[2-3]#1@0", "U[2-3]#1@0", "B[0-1]#1@0", "U[0-1]#1@0",
        "F[0-1]#0@1", "B[2-3]#0@1", "B[0-1]#0@1",
        "F[0-1]#1@1", "B[2-3]#1@1", "U[2-3]#1@1", "B[0-1]#1@1", "U[0-1]#1@1"]
    g = task_graph(plan, prof, HW)
    # the update after the last sweep waits for every sweep's gradient, and the all-reduce links replicas
    preds = {str(p) for p in g.predecessors(Task.from_str("U[2-3]#1@0"))}
    assert preds == {"B[2-3]#0@0", "B[2-3]#1@0", "B[2-3]#0@1", "B[2-3]#1@1"}


# -- media (HARMONY_REFERENCE.md 5.3, default cost model) ----------------------------------------------
def test_media_vpp_with_gpu_link():
    prof = synthetic_profile(R=6)
    plan = Plan("t", "vPP", 2, 4, 2, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6)
    m = media(compose(plan, prof, HW))
    assert m[("F[0-1]@0", "in", "X")] == "DAT"
    assert m[("F[0-1]@0", "in", "W")] == m[("F[0-1]@0", "in", "B")] == "SHM"
    assert m[("F[0-1]@0", "out", "Y")] == m[("F[2-3]@1", "in", "X")] == "P2P"
    assert m[("F[0-1]@0", "out", "sX")] == m[("B[0-1]@0", "in", "sX")] == "MSG"
    assert m[("F[2-3]@1", "out", "Y")] == m[("B[4-5]@0", "in", "X")] == "P2P"   # same sizes: no re-batching
    assert m[("B[4-5]@0", "out", "dX")] == m[("B[2-3]@1", "in", "dY")] == "P2P"
    assert m[("B[4-5]@0", "out", "dW")] == m[("U[4-5]@0", "in", "dW")] == "LOC"
    assert m[("U[4-5]@0", "in", "K")] == m[("U[4-5]@0", "out", "W")] == "SHM"
    assert ("B[0-1]@0", "out", "dX") not in m          # holds layer 0: no outgoing gradient


def test_media_rebatching_no_gpu_link_same_gpu_and_gpu_optimizer():
    prof = synthetic_profile(R=6)
    plan = Plan("t", "vPP", 2, 4, 2, 1, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6,
                options=(PackOptions(), PackOptions(recompute=False, optimizer="gpu"), PackOptions()))
    m = media(compose(plan, prof, HW))
    assert m[("F[2-3]@1", "out", "Y")] == m[("B[4-5]@0", "in", "X")] == "MSG"   # u 2 -> 1: through the host
    assert m[("F[0-1]@0", "out", "Y")] == "P2P"
    assert m[("B[2-3]@1", "out", "dW")] == m[("U[2-3]@1", "in", "dW")] == "PIN"
    assert m[("U[2-3]@1", "in", "K")] == "SHM"
    m = media(compose(plan, prof, NO_P2P))
    assert m[("F[0-1]@0", "out", "Y")] == m[("F[2-3]@1", "in", "X")] == "MSG"
    assert m[("B[4-5]@0", "out", "dX")] == "MSG"
    one = Plan("t", "vPP", 1, 4, 2, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6)
    m = media(compose(one, prof, HW))
    assert {m[("F[0-1]@0", "out", "Y")], m[("B[4-5]@0", "out", "dX")], m[("B[2-3]@0", "in", "dY")]} == {"SWP"}


def test_vdp_gradients_all_reduce_or_go_through_host():
    prof = synthetic_profile(R=4)
    plan = Plan("t", "vDP", 2, 8, 2, 2, [(0, 1)], [(0, 1), (2, 3)], 4)
    nodes = {str(n.task): n for n in compose(plan, prof, HW)}
    w = int(prof.param_bytes(2, 3))
    outs = {(f.tensor.value, f.medium.value): f for f in nodes["B[2-3]@1"].outputs}
    assert outs[("dW", "P2P")].peer is None and outs[("dW", "P2P")].nbytes == (w,)     # the all-reduce
    assert outs[("dW", "LOC")].nbytes == (w // 2,)                                     # this GPU's shard
    nodes = {str(n.task): n for n in compose(plan, prof, NO_P2P)}
    ins = [(f.medium.value, str(f.peer)) for f in nodes["U[2-3]@1"].inputs if f.tensor == Tensor.DW]
    assert ins == [("MSG", "B[2-3]@1"), ("MSG", "B[2-3]@0")]                             # sums every replica's


# -- flows and bytes ---------------------------------------------------------------------------------
def test_stash_pack_spanning_forward_packs_is_kept_in_parts():
    prof = synthetic_profile(R=8)
    plan = Plan("t", "vPP", 1, 4, 2, 2, [(0, 2), (3, 5)], [(0, 4), (5, 5), (6, 7)], 8,
                options=(PackOptions(recompute=False), PackOptions(), PackOptions()))
    assert stash_pieces(plan, 0, 2) == [(0, 0, 2)]
    assert stash_pieces(plan, 3, 5) == [(0, 3, 4), (1, 5, 5)]
    nodes = {str(n.task): n for n in compose(plan, prof, HW)}
    sx = [f for f in nodes["B[0-4]@0"].inputs if f.tensor == Tensor.SX]
    assert [str(f.peer) for f in sx] == ["F[0-2]@0", "F[3-5]@0"]
    c = prof.costs("BWD", 2)
    assert [sum(f.nbytes[i] for f in sx) for i in range(2)] == [int(c.pack_saved(0, 4))] * 2


def test_rebatching_needs():
    assert rebatch_needs([4, 4], [2, 2, 2, 2]) == ((0,), (0,), (1,), (1,))
    assert rebatch_needs([2, 2, 2], [3, 3]) == ((0, 1), (1, 2))
    assert rebatch_needs([3, 3, 1], [4, 3]) == ((0, 1), (1, 2))


def test_link_bytes_of_one_gpu_match_the_profile():
    """vPP on one GPU, recompute, CPU optimizer: every byte that crosses the link, from the profile."""
    prof = synthetic_profile(R=6)
    fwd, bwd = [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)]
    plan = Plan("t", "vPP", 1, 6, 2, 2, fwd, bwd, 6)
    x = prof.costs("FWD", 2).input
    mbs = 3
    w = sum(int(prof.param_bytes(a, b)) for a, b in fwd + bwd)
    h2d = (w + mbs * (x[0]              # the data
                      + x[2]            # F[2-3] reads F[0-1]'s output back
                      + x[4]            # the loss pack reads the last forward's output
                      + x[0] + x[2]     # the backward packs' stashed inputs
                      + x[4] + x[2]))   # gradients dY of B[2-3] and B[0-1]
    d2h = (sum(int(prof.param_bytes(a, b)) for a, b in bwd)
           + mbs * (x[2] + x[4]         # forward outputs
                    + x[0] + x[2]       # stashed inputs
                    + x[4] + x[2]))     # backward gradients dX
    assert link_bytes(task_graph(plan, prof, HW)) == {"h2d": h2d, "d2h": d2h, "p2p": 0}


# -- the graph and its validation -----------------------------------------------------------------------
PROF8 = synthetic_profile(R=8, seed=1)


@st.composite
def small_plans(draw):
    R = 8
    cuts = sorted(draw(st.sets(st.integers(1, R - 1), max_size=5)))
    bwd = list(zip([0] + cuts, [c - 1 for c in cuts] + [R - 1]))
    end = bwd[-1][0] - 1
    fcuts = sorted(draw(st.sets(st.integers(1, end), max_size=4))) if end > 0 else []
    fwd = list(zip([0] + fcuts, [c - 1 for c in fcuts] + [end])) if end >= 0 else []
    mode, gpus = draw(st.sampled_from(["vPP", "vDP"])), draw(st.integers(1, 3))
    grouping = draw(st.booleans())
    hw = draw(st.sampled_from([HW, NO_P2P]))
    # a GPU optimizer step needs input-batch grouping, and in vDP an all-reduce over a GPU link
    places = ["cpu", "gpu"] if grouping and not (mode == "vDP" and gpus > 1 and hw is NO_P2P) else ["cpu"]
    opts = tuple(PackOptions(draw(st.booleans()), draw(st.sampled_from(places))) for _ in bwd)
    share = 6 if mode == "vPP" else 6 // gpus
    uf = draw(st.integers(1, min(3, share)))
    ub = uf if not grouping else draw(st.integers(1, min(3, share)))
    plan = Plan("t", mode, gpus, 6, uf, ub, fwd, bwd, R, options=opts, allow_uneven=True,
                input_batch_grouping=grouping, gpu_handoff=draw(st.booleans()))
    return plan, hw


@settings(max_examples=60, deadline=None)
@given(small_plans())
def test_graph_is_a_valid_dag_whose_flows_match(case):
    plan, hw = case
    nodes = compose(plan, PROF8, hw)
    assert [n.attrs() for n in compose(plan, PROF8, hw)] == [n.attrs() for n in nodes]   # a pure function
    g = task_graph(plan, PROF8, hw, nodes)
    assert nx.is_directed_acyclic_graph(g)
    placed = validate(g)
    assert sorted(placed["BWD"]) == list(range(8))
    for u, v, d in g.edges(data=True):
        for f in d["flows"]:
            assert f["bytes_out"] is not None, (u, v, f)
            assert all(len(n) >= 1 for n in f["needs"])
            if f["tensor"] in (Tensor.X, Tensor.DY):      # the same tensor on both sides
                if all(n == (i,) for i, n in enumerate(f["needs"])):
                    assert f["bytes_in"] == f["bytes_out"]
                else:       # re-batched: other microbatches (this profile's activations are linear in u)
                    assert sum(f["bytes_in"]) == sum(f["bytes_out"])
    # every forward and backward microbatch size list adds up to the replica's samples
    for n in nodes:
        if n.kind != TaskKind.UPD:
            share = plan.samples_per_gpu()[n.replica] if n.task.sweep is None else n.microbatches[0]
            assert sum(n.microbatches) == share


def test_validate_draws_the_schedule_on_failure():
    prof = synthetic_profile(R=6)
    plan = Plan("t", "vPP", 2, 4, 2, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6)
    g = task_graph(plan, prof, HW)
    g2 = g.copy()
    g2.remove_node(Task.from_str("B[2-3]@1"))
    with pytest.raises(PlanError, match=r"(?s)BWD packs do not cover.*ERROR HERE"):
        validate(g2)
    g3 = g.copy()
    g3.add_edge(Task.from_str("B[0-1]@0"), Task.from_str("F[0-1]@0"), flows=[])
    with pytest.raises(PlanError, match="cycle"):
        validate(g3)
    g4 = g.copy()
    g4.nodes[Task.from_str("U[4-5]@0")]["inputs"] = ()
    g4.remove_edge(Task.from_str("B[4-5]@0"), Task.from_str("U[4-5]@0"))
    with pytest.raises(PlanError, match="no update"):
        validate(g4)
    grid = format_task_table(g, Task.from_str("F[2-3]@1"))
    assert grid.splitlines()[0].split() == ["step", "|", "GPU0", "|", "GPU1"]
    assert "F[2-3]" in grid.splitlines()[2] and grid.splitlines()[2].endswith("<-- ERROR HERE")
