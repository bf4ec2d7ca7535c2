"""Harmony-compatible mode: calibration against the original scheduler and unit tests of its parts.

Calibration numbers are HARMONY_REFERENCE.md section 7 (bert_96, D = 32, N = 2, cap 10 GiB,
Top-1, ranked normally). Packer cases are computed by hand in the comments.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from harmony_opt.core.bundled import load_profile
from harmony_opt.core.errors import InfeasibleError, UsageError
from harmony_opt.harmony import (EventKind, HarmonyCandidate, Medium, Stream, TaskKind, Tensor, compose_task_graph,
                                 expand_events, harmony_search, merge_rendezvous, rebatch, run_events,
                                 simulate_harmony, task_memory)
from harmony_opt.harmony.packing import (PACKERS, balanced, balanced_addx, balanced_split, balanced_time,
                                         candidate_sizes, get_packer, greedy, greedy_addx, greedy_reverse,
                                         greedy_reverse_addx, packing_methods, reuse)
from harmony_opt.harmony.search import _Top

CAP10 = 10 * 2**30


def arr(*v):
    return np.array(v, dtype=np.int64)


@pytest.fixture(scope="module")
def bert96():
    return load_profile("bert_96")


# -- calibration (section 7) ----------------------------------------------------------------

@pytest.mark.parametrize("mode, time_s, shape, configs", [
    ("vPP", 17.873845, (8, 9, 8, 10), 32),
    ("vDP", 19.421301, (8, 4, 8, 10), 24),
])
def test_calibration_published_methods(bert96, mode, time_s, shape, configs):
    res = harmony_search(bert96, 32, 2, mode, CAP10, packing_fwd=("balanced_time", "reuse"),
                         packing_bwd=("balanced_time",), topk=1, rank_fit_normally=True)
    best = res.best
    assert best.time == pytest.approx(time_s, rel=1e-6)
    assert (best.u_fwd, len(best.packs_fwd), best.u_bwd, len(best.packs_bwd)) == shape
    assert res.configs_evaluated == configs
    if mode == "vPP":
        assert best.method_fwd == "reuse" and best.packs_fwd == best.packs_bwd[:-1]


@pytest.mark.parametrize("mode, time_s", [("vPP", 17.587), ("vDP", 19.349)])
def test_calibration_default_methods(bert96, mode, time_s):
    res = harmony_search(bert96, 32, 2, mode, CAP10, packing_fwd="defaults", packing_bwd="defaults",
                         rank_fit_normally=True)
    assert res.best.time == pytest.approx(time_s, rel=1e-3)


def test_best_plan_replays_in_simulator(bert96):
    res = harmony_search(bert96, 32, 2, "vPP", CAP10, rank_fit_normally=True)
    plan = res.best_plan()
    assert plan.planner == "harmony" and plan.cost_model == "harmony"
    assert plan.packs_fwd == res.best.packs_fwd and plan.packs_bwd == res.best.packs_bwd
    assert plan.packs_fwd[-1][1] + 1 == plan.packs_bwd[-1][0]
    assert plan.stats["configs_evaluated"] == 32 and plan.stats["method_fwd"] == "reuse"
    tl = simulate_harmony(plan, bert96)
    assert tl.iteration_time == pytest.approx(res.best.time, rel=1e-12)
    assert tl.cost_model == "harmony" and tl.ranks == 2
    assert set(tl.events.stream) == {"SwapIn", "P2PIn", "Compute", "P2POut", "SwapOut", "CPU"}
    assert tl.events.end.max() == pytest.approx(tl.iteration_time)
    assert (tl.events.end >= tl.events.start).all()
    assert tl.meta["global_memory"] == res.best.memory == max(tl.meta["per_rank_memory"].values())
    assert max(tl.peak_memory().values()) == tl.meta["global_memory"]
    # every P2P send and its receive is one transfer: same start and end
    ev = tl.events
    for kind_out, kind_in, step in (("Y", "X", 1), ("dX", "dY", 2)):
        sends = ev[(ev.stream == "P2POut") & (ev.kind == kind_out)]
        recv = ev[(ev.stream == "P2PIn") & (ev.kind == kind_in)].set_index(["task", "microbatch"])
        assert len(sends)
        for s in sends.itertuples():
            r = recv.loc[(s.task + step, s.microbatch)]
            assert (r.start, r.end) == pytest.approx((s.start, s.end))
    quick = simulate_harmony(plan, bert96, with_timeline=False)
    assert quick.iteration_time == tl.iteration_time and quick.events.empty


def test_vdp_simulates_one_gpu(bert96):
    plan = harmony_search(bert96, 32, 2, "vDP", CAP10, rank_fit_normally=True).best_plan()
    tl = simulate_harmony(plan, bert96)
    assert set(tl.events["rank"]) == {0} and tl.meta["n_busy_gpus"] == 2
    assert "ARD" in set(tl.events.kind)       # all-reduce because N' = 2


# -- packers (section 3) --------------------------------------------------------------------

def test_greedy_forward_strict_at_cap():
    m, x = arr(3, 3, 3, 3), arr(1, 1, 1, 1)
    # s = 4; +3 = 7 < 8; +3 = 10 -> new pack at 2 with 3 + 1 = 4; +3 = 7
    assert greedy_addx(m, x, None, 8) == ((0, 1), (2, 3))
    assert greedy_addx(m, x, None, 7) == ((0, 0), (1, 1), (2, 2), (3, 3))    # 7 < 7 fails
    assert greedy_addx(m, x, None, 4) is None                                 # 3 + 1 >= 4
    assert greedy(m, x, None, 7) == ((0, 1), (2, 3))                          # x ignored: 6 < 7
    assert greedy(m, x, None, 6) == ((0, 0), (1, 1), (2, 2), (3, 3))


def test_greedy_reverse_leftover_in_first_pack():
    m, x = arr(3, 3, 3, 3, 3), arr(1, 1, 1, 1, 1)
    # from layer 4: 3; +3+1 = 7 < 8; 6+3+1 = 10 -> close at 3; ... first pack keeps the rest
    assert greedy_reverse_addx(m, x, None, 8) == ((0, 0), (1, 2), (3, 4))
    assert greedy_reverse(arr(2, 2, 2), arr(9, 9, 9), None, 4) == ((0, 0), (1, 1), (2, 2))   # 2+2 < 4 fails
    assert greedy_reverse(arr(2, 2, 2), arr(9, 9, 9), None, 5) == ((0, 0), (1, 2))
    assert greedy_reverse_addx(arr(2, 2), arr(1, 3), None, 5) is None        # layer 0 alone: 2 + 3 >= 5


def test_balanced_split_floor_division_on_ints():
    # int: q = 21 // 2 = 10 -> cut where prefix >= 10 (layer 1); float: q = 10.5 -> layer 2
    assert balanced_split(arr(5, 5, 5, 6), 2).tolist() == [0, 1]
    assert balanced_split(np.array([5.0, 5.0, 5.0, 6.0]), 2).tolist() == [0, 2]
    # so balanced rejects S = 2 (5 | 16) and takes S = 3 (q = 7: 5 | 5 | 11), not (10 | 11)
    assert balanced(arr(5, 5, 5, 6), arr(0, 0, 0, 0), None, 12) == ((0, 0), (1, 1), (2, 3))


def test_balanced_rejects_empty_packs_and_strictness():
    # S = 1: 8 < 8 fails; S = 2: q = 4 cuts at layer 0 -> empty first pack; no S left
    assert balanced(arr(4, 4), arr(1, 1), None, 8) is None
    assert balanced(arr(4, 4), arr(1, 1), None, 9) == ((0, 1),)
    # addx accepts equality: 4 + 4 + 1 = 9 <= 9
    assert balanced_addx(arr(4, 4), arr(1, 1), None, 9) == ((0, 1),)
    assert balanced_addx(arr(4, 4), arr(1, 1), None, 8) is None
    # S0 = ceil(12 / 7) = 2: q = 6 cuts at layer 1 (prefix 6 >= 6): 3+1 | 9+1 > 7; S = 3: 4 | 4 | 7 <= 7
    assert balanced_addx(arr(3, 3, 3, 3), arr(1, 1, 1, 1), None, 7) == ((0, 0), (1, 1), (2, 3))


def test_balanced_time_splits_on_time_with_memory_guess():
    m, x, t = arr(1, 1, 1, 1), arr(0, 0, 0, 0), np.array([1.0, 1.0, 1.0, 3.0])
    # S0 = ceil(4 / 3) = 2; q = 3.0 -> cut at layer 2 (prefix 3 >= 3)
    assert balanced_time(m, x, t, 3) == ((0, 1), (2, 3))
    assert balanced_addx(m, x, t, 3) == ((0, 0), (1, 3))      # by memory: q = 2 -> cut at 1
    # x[2] = 2: S = 2 fails (2 + 2 > 3); S = 3: q = 2.0 cuts at layers 1 (prefix 2) and 3 (prefix 6)
    assert balanced_time(m, arr(0, 0, 2, 0), t, 3) == ((0, 0), (1, 2), (3, 3))


def test_reuse_is_strict_and_forward_only():
    m, x = arr(2, 2, 2), arr(1, 1, 1)
    packs = ((0, 0), (1, 2))                                     # 2+1 = 3 and 4+1 = 5
    assert reuse(m, x, None, 6, packs) == packs
    assert reuse(m, x, None, 5, packs) is None
    with pytest.raises(UsageError):
        reuse(m, x, None, 6)
    with pytest.raises(UsageError, match="forward-only"):
        packing_methods(["balanced_time", "reuse"], "BWD")


def test_packer_registry():
    assert get_packer("Balanced_TIME") is balanced_time
    assert set(PACKERS) == {"greedy", "greedy_addx", "greedy_reverse", "greedy_reverse_addx", "balanced",
                            "balanced_addx", "balanced_time", "reuse"}
    with pytest.raises(UsageError, match="greedy_reverse_addx"):
        get_packer("greedy_magic")
    assert packing_methods("published", "FWD") == ("balanced_time", "reuse")
    assert packing_methods("published", "BWD") == ("balanced_time",)
    assert packing_methods("all", "FWD") == ("greedy_reverse_addx", "balanced_addx", "reuse", "balanced_time")
    assert packing_methods("defaults", "BWD") == ("greedy_reverse_addx", "balanced_addx", "balanced_time")
    assert packing_methods("Greedy, balanced,greedy", "FWD") == ("greedy", "balanced")


def test_every_packer_covers_layers_under_cap(bert96):
    c = bert96.costs("BWD", 4)
    m, x = c.memory - c.input[:-1], c.input[:-1]
    for name, fn in PACKERS.items():
        if name == "reuse":
            continue
        packs = fn(m, x, c.time, CAP10)
        assert packs is not None and packs[0][0] == 0 and packs[-1][1] == len(m) - 1
        assert all(b + 1 == a2 for (_, b), (a2, _) in zip(packs, packs[1:]))
        if name.endswith("addx") or name == "balanced_time":
            assert all(c.pack_memory(a, b) <= CAP10 for a, b in packs)


# -- candidate sizes (section 2) ------------------------------------------------------------

def test_candidate_sizes():
    prof = range(1, 100)
    assert candidate_sizes(prof, 12, 4, "vPP") == [1, 2, 3, 4, 6, 12]
    assert candidate_sizes(prof, 12, 4, "vPP", step=2) == [1, 3]
    assert candidate_sizes(range(1, 6), 12, 4, "vPP") == [1, 2, 3, 4]
    # vDP 13 over 3 GPUs: shares 5, 4, 4 and Dcap 4; only 1 divides every share
    assert candidate_sizes(prof, 13, 3, "vDP") == [1]
    assert candidate_sizes(prof, 13, 3, "vDP", inequal=True) == [1, 2, 3, 4]
    assert candidate_sizes([1, 5, 9, 13], 64, 4, "vPP") == [1, 2, 4, 8]


def test_smaller_ufwd_and_step_enlarge_or_shrink_the_space(bert96):
    base = harmony_search(bert96, 16, 2, "vPP", CAP10)
    small = harmony_search(bert96, 16, 2, "vPP", CAP10, smaller_ufwd=True)
    assert small.search_space > base.search_space and small.configs_evaluated > base.configs_evaluated
    assert small.best.time <= base.best.time


# -- search and ranking (section 4) ---------------------------------------------------------

def _cand(key):
    return HarmonyCandidate(1, (), 1, ((0, 0),), "", "m", key, key, None)


def test_topk_replaces_first_worst_only_when_strictly_better():
    top = _Top(2, dedup=False)
    a, b, c, d = _cand(5.0), _cand(3.0), _cand(5.0), _cand(4.0)
    for x in (a, b, c):
        top.add(x)
    assert top.items == [a, b]           # c ties the worst: not strictly better
    top.add(d)
    assert top.items == [b, d] and top.ranked() == [b, d]
    one = _Top(1, dedup=False)
    first, tie = _cand(2.0)._replace(method_bwd="first"), _cand(2.0)._replace(method_bwd="tie")
    for x in (_cand(3.0), first, tie):
        one.add(x)
    assert one.ranked() == [first]       # first in enumeration order among the minimum wins


def test_dedup_and_keep_all(bert96):
    full = harmony_search(bert96, 32, 2, "vPP", CAP10, topk=-1, rank_fit_normally=True)
    assert len(full.candidates) == full.configs_evaluated == 32
    keys = [c.key for c in full.candidates]
    assert keys == sorted(keys)
    dedup = harmony_search(bert96, 32, 2, "vPP", CAP10, topk=-1, dedup=True, rank_fit_normally=True)
    ids = {(c.u_fwd, c.packs_fwd, c.u_bwd, c.packs_bwd) for c in full.candidates}
    assert len(dedup.candidates) == len(ids) < 32
    assert dedup.best.time == full.best.time


def test_search_counts_the_events_it_plays(bert96):
    """The planner charges Harmony's search to its budget by the events its simulations play:
    every distinct candidate once."""
    full = harmony_search(bert96, 32, 2, "vPP", CAP10, topk=-1, rank_fit_normally=True)
    distinct = {(c.u_fwd, c.packs_fwd, c.u_bwd, c.packs_bwd): k for k, c in enumerate(full.candidates)}
    played = sum(simulate_harmony(full.best_plan(k), bert96, with_timeline=False).meta["events"]
                 for k in distinct.values())
    assert len(distinct) < len(full.candidates)      # repeated candidates are simulated once
    assert full.events_simulated == played > 0
    assert full.best_plan().stats["events_simulated"] == played


def test_fit_on_one_gpu_ranks_first_unless_ranked_normally():
    prof = load_profile("bert_large")
    fit = harmony_search(prof, 16, 2, "vPP", CAP10, topk=-1)
    assert len(fit.best.packs_bwd) == 1 and fit.best.packs_fwd == ()
    assert fit.best.key == pytest.approx(fit.best.time / 1000)
    plan = fit.best_plan()
    assert plan.packs_fwd == () and plan.microbatch_fwd == plan.microbatch_bwd
    normal = harmony_search(prof, 16, 2, "vPP", CAP10, topk=-1, rank_fit_normally=True)
    assert all(c.key == c.time for c in normal.candidates)


def test_score_callable_replaces_simulator(bert96):
    seen = []

    def value(plan):
        return float(plan.microbatch_bwd * 100 + len(plan.packs_bwd))

    def score(plan):
        seen.append(plan)
        return value(plan)

    res = harmony_search(bert96, 32, 2, "vPP", CAP10, score=score, rank_fit_normally=True)
    assert seen and all(p.planner == "harmony" for p in seen)
    assert res.best.time == min(value(p) for p in seen) and res.best.memory is None


def test_scoring_every_candidate_at_once_ranks_as_one_by_one(bert96):
    """``score_many`` (the planner's processes) gets each distinct candidate once, and the search
    ranks them as with ``score``."""
    def value(plan):
        return float(plan.microbatch_fwd * 7 % 5 + len(plan.packs_fwd) + plan.microbatch_bwd / 10)

    batches = []

    def score_many(plans):
        batches.append(plans)
        return [value(p) for p in plans]
    one = harmony_search(bert96, 32, 2, "vPP", CAP10, score=value, topk=-1, rank_fit_normally=True)
    many = harmony_search(bert96, 32, 2, "vPP", CAP10, score_many=score_many, topk=-1, rank_fit_normally=True)
    assert len(batches) == 1
    idents = [(p.microbatch_fwd, p.packs_fwd, p.microbatch_bwd, p.packs_bwd) for p in batches[0]]
    distinct = {(c.u_fwd, c.packs_fwd, c.u_bwd, c.packs_bwd) for c in one.candidates}
    assert len(idents) == len(set(idents)) == len(distinct)
    assert [(c.time, c.u_fwd, c.u_bwd) for c in many.candidates] == [(c.time, c.u_fwd, c.u_bwd) for c in one.candidates]
    assert many.settings["scored_by"] == "custom"


def test_infeasible_names_layer_size_and_cap(bert96):
    with pytest.raises(InfeasibleError) as e:
        harmony_search(bert96, 32, 2, "vPP", 2 * 10**8)
    err = e.value
    assert err.microbatch == 1 and err.cap_bytes == 2 * 10**8 and err.needed_bytes >= err.cap_bytes
    assert f"layer {err.layer}" in str(err)
    with pytest.raises(UsageError):
        harmony_search(bert96, 32, 2, "vXP", CAP10)
    with pytest.raises(UsageError, match="bw_swapp"):
        harmony_search(bert96, 32, 2, "vPP", CAP10, bw_swapp=1.0)


# -- task graph (section 5) -------------------------------------------------------------------

def test_vpp_task_graph_order_ranks_and_media():
    fwd, bwd = ((0, 2), (3, 5), (6, 6)), ((0, 3), (4, 6), (7, 9))
    G = compose_task_graph("vPP", 2, 8, 10, 2, fwd, 4, bwd)
    kinds = [(G.nodes[i]["kind"], G.nodes[i]["first"], G.nodes[i]["rank"]) for i in sorted(G)]
    assert kinds == [(TaskKind.FWD, 0, 0), (TaskKind.FWD, 3, 1), (TaskKind.FWD, 6, 0),
                     (TaskKind.BWD, 7, 1), (TaskKind.UPD, 7, 1), (TaskKind.BWD, 4, 0), (TaskKind.UPD, 4, 0),
                     (TaskKind.BWD, 0, 1), (TaskKind.UPD, 0, 1)]
    ins = {i: {p.tensor: p for p in G.nodes[i]["inputs"]} for i in G}
    outs = {i: {p.tensor: p for p in G.nodes[i]["outputs"]} for i in G}
    assert ins[0][Tensor.X].medium is Medium.DAT and ins[1][Tensor.X].medium is Medium.P2P
    assert G.graph["last_fwd_msg"]       # u_fwd != u_bwd on 2 GPUs: last FWD -> loss BWD by MSG
    assert outs[2][Tensor.Y].medium is Medium.MSG and ins[3][Tensor.X].medium is Medium.MSG
    assert ins[3][Tensor.T].medium is Medium.DAT and Tensor.DY not in ins[3]
    assert ins[5][Tensor.DY] == (Tensor.DY, 6, 6, Medium.P2P, 3)
    assert outs[5][Tensor.DX] == (Tensor.DX, 4, 4, Medium.P2P, 7) and Tensor.DX not in outs[7]
    stash = [(p.first, p.peer) for p in G.nodes[0]["outputs"] if p.tensor is Tensor.SX]
    assert stash == [(0, 7)]
    assert [(p.first, p.peer) for p in G.nodes[1]["outputs"] if p.tensor is Tensor.SX] == [(4, 5)]
    assert ins[5][Tensor.X] == (Tensor.X, 4, 4, Medium.MSG, 1)
    assert ins[4][Tensor.DW] == (Tensor.DW, 7, 9, Medium.LOC, 3)
    # JIT pinning on GPU 0: last FWD [6, 6] and first BWD [4, 6] share layer 6
    pinned = [p for p in G.nodes[5]["inputs"] if p.medium is Medium.PIN]
    assert {(p.tensor, p.first, p.last, p.peer) for p in pinned} == {(Tensor.W, 6, 6, 2), (Tensor.B, 6, 6, 2)}
    assert G.has_edge(0, 7) and G.has_edge(1, 2) and G.has_edge(3, 5) and G.has_edge(3, 4)
    assert G.nodes[0]["ubatchszs"] == (2, 2, 2, 2) and G.nodes[3]["ubatchszs"] == (4, 4)


def test_vdp_task_graph_copies_and_swaps():
    G = compose_task_graph("vDP", 3, 13, 10, 2, ((0, 4),), 2, ((0, 4), (5, 9)))
    assert len(G) == 15 and {G.nodes[i]["rank"] for i in range(5, 10)} == {1}
    assert G.nodes[0]["ubatchszs"] == (2, 2, 1) and G.nodes[5]["ubatchszs"] == (2, 2)
    assert all(p.medium is not Medium.P2P for i in G for p in G.nodes[i]["inputs"])
    assert {p.tensor: p.medium for p in G.nodes[6]["inputs"]}[Tensor.X] is Medium.SWP
    assert G.nodes[9]["device"] == "CPU:1"


# -- events and simulator (section 6) ---------------------------------------------------------

def test_rebatch_converter():
    r = rebatch([4, 4, 1], [2, 2, 2, 2, 1], 2)
    assert r.targets == (((0, 2), (1, 2)), ((2, 2), (3, 2)), ((4, 1),)) and r.producer == (0, 0, 1, 1, 2)
    r = rebatch([4, 4, 4, 1], [3, 3, 3, 3, 1], 3)
    assert r.targets == (((0, 3),), ((1, 3),), ((2, 3), (3, 3)), ((4, 1),)) and r.producer == (0, 1, 2, 2, 3)
    r = rebatch([3, 3, 3, 3, 1], [4, 4, 4, 1], 4)          # a residual carried over
    assert r.targets == ((), ((0, 4),), ((1, 4),), ((2, 4),), ((3, 1),)) and r.producer == (1, 2, 3, 4)


def test_rendezvous_sides_wait_for_each_other():
    # rank 0: compute c (1 s) then send s (2 s, after c); rank 1: receive p (5 s) then receive r paired with s
    dur = [1.0, 2.0, 5.0, 2.0]
    deps = [[], [0], [], []]
    queues = [[0], [1], [2, 3]]
    peers = [(1, 3), (3, 1)]
    assert merge_rendezvous(deps, queues, peers)[1] == [0, 2]
    begin = run_events(dur, deps, queues, peers)
    assert begin[1] == begin[3] == 5.0           # the send waits for the receiver's queue
    assert run_events(dur, deps, queues) == [0.0, 1.0, 0.0, 5.0]


def test_crossed_rendezvous_deadlocks():
    # rank 0 sends a1 then a2; rank 1 receives b2 then b1: each pair waits for the other's predecessor
    dur = [1.0] * 4
    queues = [[0, 1], [3, 2]]
    peers = [(0, 2), (2, 0), (1, 3), (3, 1)]
    assert run_events(dur, [[], [], [], []], queues, peers) is None
    assert run_events(dur, [[], [], [], []], [[0, 1], [2, 3]], peers) == [0.0, 1.0, 0.0, 1.0]


def _dwb_deps(mode, gpus, prefetch=False):
    prof = load_profile("bert_large")
    G = compose_task_graph(mode, gpus, 16, 28, 4, ((0, 13),), 4, ((0, 13), (14, 27)))
    ev = expand_events(G, prof, prefetch_offload=prefetch)
    idx = {k: e for e, k in enumerate(ev.key)}
    t = next(i for i in sorted(G) if G.nodes[i]["kind"] is TaskKind.BWD and G.nodes[i]["has_criterion"])
    kinds = {ev.key[d][4] for d in ev.deps[idx[(t, 0, 0, Stream.SWAP_OUT, EventKind.DWB)]]}
    return kinds, ev


def test_vpp_dwb_does_not_wait_for_dx_but_vdp_does():
    assert _dwb_deps("vPP", 2)[0] == {EventKind.BWD}
    assert _dwb_deps("vDP", 1)[0] == {EventKind.BWD, EventKind.DX}
    assert _dwb_deps("vPP", 1)[0] == {EventKind.BWD, EventKind.DX}       # one GPU: simulated as vDP
    assert _dwb_deps("vDP", 2)[0] == {EventKind.BWD, EventKind.ARD}      # all-reduce waits for dX
    assert _dwb_deps("vDP", 1, prefetch=True)[0] == {EventKind.BWD}


def test_prefetch_offload_changes_wb_and_input_dependencies():
    _, ev = _dwb_deps("vDP", 1, prefetch=True)
    _, ev_off = _dwb_deps("vDP", 1)
    assert len(ev.key) == len(ev_off.key)
    idx = {k: e for e, k in enumerate(ev.key)}
    wb = idx[(3, 0, 0, Stream.SWAP_IN, EventKind.WB)]          # BWD [0, 13]: prefetched at left's last BWD
    assert [ev.key[d][4] for d in ev.deps[wb]] == [EventKind.BWD]
    swap_in = [ev.key[e][4] for e in ev.queues[(0, Stream.SWAP_IN)] if ev.key[e][0] == 3]
    assert swap_in[:3] == [EventKind.SX, EventKind.DY, EventKind.WB]   # WB queued after the first inputs
    x2 = idx[(0, 2, 0, Stream.SWAP_IN, EventKind.X)]
    assert [ev.key[d][:2] for d in ev.deps[x2]] == [(0, 0)]          # double buffer: compute of i - 2


def test_prefetch_offload_search_runs(bert96):
    off = harmony_search(bert96, 32, 2, "vPP", CAP10, rank_fit_normally=True)
    on = harmony_search(bert96, 32, 2, "vPP", CAP10, rank_fit_normally=True, prefetch_offload=True)
    assert math.isfinite(on.best.time) and on.best.time < off.best.time


def test_inequal_microbatches_rebatch_in_simulation(bert96):
    res = harmony_search(bert96, 10, 2, "vPP", CAP10, inequal_ubatchsize=True, topk=-1, rank_fit_normally=True)
    assert all(math.isfinite(c.time) for c in res.candidates)
    c = next(c for c in res.candidates if c.u_fwd == 4 and c.u_bwd == 3)
    plan = res.best_plan(res.candidates.index(c))
    assert plan.allow_uneven and plan.microbatches("FWD") == [4, 4, 2]
    tl = simulate_harmony(plan, bert96)
    msgs = tl.events[tl.events.kind == "MSGY"]
    assert sorted(msgs.microbatch) == [0, 1, 2, 3]          # one message per BWD microbatch


def test_task_memory_formula(bert96):
    G = compose_task_graph("vPP", 2, 8, 100, 4, ((0, 49),), 4, ((0, 49), (50, 99)))
    f, b = bert96.costs("FWD", 4), bert96.costs("BWD", 4)
    x = f.input
    assert task_memory(G, 0, bert96) == x[0] + f.pack_memory(0, 49) + x[50] + x[0]
    assert task_memory(G, 1, bert96) == 2 * x[50] + b.pack_memory(50, 99) + x[50]
    assert task_memory(G, 3, bert96) == 2 * x[0] + x[50] + b.pack_memory(0, 49)
    assert task_memory(G, 2, bert96) == 0


def test_harmonys_cost_model_ignores_the_hardwares_execution_terms():
    """Harmony's simulator takes no Hardware, and the planners under its cost model (Harmony's search,
    ours) decide the same plan with or without the execution terms; only the hardware they record
    differs. Under the default cost model the same terms change the simulated time."""
    import dataclasses
    import json

    from harmony_opt.core.hardware import get_hardware
    from harmony_opt.planners.registry import get_planner
    from harmony_opt.sim.simulator import simulate
    from conftest import synthetic_profile

    prof = synthetic_profile(R=6, seed=1)
    hw = get_hardware("1080ti-x4").with_gpus(2)
    cpu = dataclasses.replace(hw, copy_overlap=False, h2d_latency_s=2e-5, d2h_latency_s=2e-5, compute_scale=0.5,
                              cpu_optimizer_call_s=1e-3, gpu_optimizer_call_s=1e-3, gpu_optimizer_tensor_s=1e-4,
                              issue_overhead_s=5e-5, collective_bandwidth=1e9)

    def decisions(p):
        d = json.loads(p.to_json())
        for k in ("solver", "hardware", "search_time_s"):
            d.pop(k, None)
        return d
    for name, opts in (("harmony", {"mode": "vPP"}), ("cp-sat", {"time_limit": 0.5})):
        a, b = (get_planner(name)(prof, h, 8, 10 * 2**30, gpus=2, cost_model="harmony", **opts) for h in (hw, cpu))
        assert decisions(a) == decisions(b), name
        assert a.simulated_iteration_time_s == b.simulated_iteration_time_s
        assert b.hardware["copy_overlap"] is False and "copy_overlap" not in a.hardware
        default = a.replace(cost_model="default")
        assert simulate(default, prof, cpu).iteration_time != simulate(default, prof, hw).iteration_time
