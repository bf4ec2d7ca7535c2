"""Compiler and validator: every compiled program validates; hand-broken programs do not."""
from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harmony_opt.compile.compiler import build_tasks, compile_plan, instruction_key, microbatch_rows
from harmony_opt.core.errors import PlanError, ProgramError
from harmony_opt.core.kinds import TaskKind
from harmony_opt.core.plan import PackOptions, Plan, forward_instructions
from harmony_opt.core.hardware import get_hardware
from harmony_opt.sim.taskgraph import compose
from harmony_opt.compile.program import Instr, Kind, LayerBytes, Program, Stream, Tensor, effects
from harmony_opt.compile.validate import format_schedule, validate_program

from conftest import synthetic_profile


def make_plan(mode="vPP", gpus=1, batch=4, uf=2, ub=2, fwd=((0, 1), (2, 2)), bwd=((0, 2), (3, 5)), R=6,
              options=(), **kw) -> Plan:
    return Plan(planner="test", mode=mode, gpus=gpus, batch=batch, microbatch_fwd=uf, microbatch_bwd=ub,
                packs_fwd=fwd, packs_bwd=bwd, num_layers=R, options=options, **kw)


def sizes(R: int) -> LayerBytes:
    return LayerBytes(weights=(1000,) * R, buffers=(10,) * R, optimizer=(2000,) * R, input=(40.0,) * R,
                      saved=(80.0,) * R, target=8.0)


def replace(program: Program, rank: int, instrs) -> Program:
    ranks = list(program.ranks)
    ranks[rank] = tuple(instrs)
    return Program(**{**program.__dict__, "ranks": tuple(ranks)})


# -- the compact form and JSON ---------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "12:IW[4-7]@i=1048576",
    "13:RX[4-4]#0(0+2)@p>0.3<9",
    "14:F[4-7]#0(0+2)@c<12,13",
    "15:SY[8-8]#0(0+2)@p>1.4<14",
    "16:FsA[2-3]#1(2+2)@c<15",
    "17:DdW[0-3]@c",
    "18:U[0-3]@u<17",
    "19:AdW[0-3]@c",
])
def test_compact_form_round_trips(text):
    ins = Instr.from_str(text)
    assert str(ins) == text
    assert Instr.from_dict(ins.to_dict(), "x") == ins


def test_compact_form_rejects_garbage():
    with pytest.raises(ProgramError, match="cannot read instruction"):
        Instr.from_str("12:Q[1-2]@c")


def test_program_json_round_trips(tmp_path):
    program = compile_plan(make_plan(gpus=2, ub=1), layer_bytes=sizes(6))
    path = program.save(tmp_path / "p.json")
    assert Program.load(path) == program
    d = json.loads(path.read_text())
    assert d["version"] == 1 and len(d["ranks"]) == 2


def test_program_json_errors_name_the_field(tmp_path):
    d = compile_plan(make_plan()).to_dict()
    with pytest.raises(ProgramError, match="version"):
        Program.from_dict({**d, "version": 99})
    del d["ranks"][0][0]["kind"]
    with pytest.raises(ProgramError, match=r"ranks\[0\]\[0\]: missing field kind"):
        Program.from_dict(d)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ProgramError, match="not valid JSON"):
        Program.load(tmp_path / "bad.json")


# -- task order and placement (HARMONY_REFERENCE 5) --------------------------------------------------------

def test_vpp_task_order_and_round_robin():
    plan = make_plan(gpus=2, R=8, fwd=((0, 1), (2, 3), (4, 4)), bwd=((0, 2), (3, 4), (5, 7)))
    (tasks,) = build_tasks(plan)
    assert [(t.kind, t.pack, t.rank) for t in tasks] == [
        ("F", (0, 1), 0), ("F", (2, 3), 1), ("F", (4, 4), 0),
        ("B", (5, 7), 1), ("B", (3, 4), 0), ("B", (0, 2), 1)]


def test_vdp_gives_every_rank_every_task_on_its_share():
    plan = make_plan(mode="vDP", gpus=2, batch=5, uf=2, ub=1, allow_uneven=True)
    copies = build_tasks(plan)
    assert [{t.rank for t in c} for c in copies] == [{0}, {1}]
    assert microbatch_rows(plan, "FWD", 0) == ((0, 2), (2, 1))
    assert microbatch_rows(plan, "FWD", 1) == ((0, 2),)
    program = compile_plan(plan)
    assert program.samples == (3, 2) and program.sample_offsets == (0, 3)


# -- instruction counts ------------------------------------------------------------------------------------

def test_counts_of_a_simple_vpp_program():
    plan = make_plan()      # fwd [0,1] [2,2]; bwd [0,2] [3,5]; 2 microbatches of 2
    c = compile_plan(plan).counts(0)
    assert c["IW"] == 4                     # one per task: input-batch grouping
    assert c["F"] == 2 * 2                  # two forward packs x two microbatches
    assert c["C"] == c["B"] == 2 * 2        # recompute + backward per backward pack and microbatch
    assert c["OdW"] == c["U"] == 2          # dW out and one CPU update per backward pack
    assert c["IT"] == 2                     # targets for the loss pack's microbatches
    assert c["IsX"] == 2                    # pack [0,2] reads layer 0's input (the data) as its stash


def test_recompute_off_keeps_the_forward_graph():
    plan = make_plan(fwd=((0, 2),), bwd=((0, 1), (2, 2), (3, 5)), options=(PackOptions(False), PackOptions(),
                                                                             PackOptions()))
    program = compile_plan(plan)
    c = program.counts(0)
    assert program.notes == ()
    assert c["FsA"] == 2 and c["IsA"] == 2 and c["BsA"] == 2   # graph kept in forward, swapped in for backward
    assert c["C"] == 2 * 2                                     # only the other two packs recompute


def test_recompute_off_that_cannot_be_kept_falls_back_with_a_note():
    plan = make_plan(options=(PackOptions(False), PackOptions()))     # bwd [0,2] spans fwd [0,1] and [2,2]
    program = compile_plan(plan)
    assert "recomputes instead" in program.notes[0]
    assert program.counts(0)["FsA"] == 0


def test_gpu_optimizer_swaps_state_and_weights():
    plan = make_plan(options=(PackOptions(True, "gpu"), PackOptions()))
    c = compile_plan(plan).counts(0)
    assert c["IK"] == 1 and c["OW"] == 1 and c["OK"] == 1 and c["U"] == 2


def test_vdp_all_reduces_and_spreads_updates():
    plan = make_plan(mode="vDP", gpus=2, batch=4, uf=2, ub=1)
    program = compile_plan(plan)
    for r in range(2):
        assert program.counts(r)["AdW"] == 2
    assert program.counts()["U"] == 2                       # each pack updated once, by one rank
    assert {r for r in range(2) if program.counts(r)["U"]} == {0, 1}


def test_prefetch_fetches_the_next_weights_before_the_current_pack_ends():
    def position(plan):
        ins = compile_plan(plan).ranks[0]
        second_w = [i for i, x in enumerate(ins) if x.kind is Kind.SWAP_IN and x.tensor is Tensor.W][1]
        first_free = next(i for i, x in enumerate(ins) if x.kind is Kind.FREE and x.tensor is Tensor.W)
        return second_w, first_free
    w, free = position(make_plan(prefetch=True))
    assert w < free
    w, free = position(make_plan(prefetch=False))
    assert w > free


def test_jit_pinning_keeps_shared_layers_resident():
    # rank 0 runs fwd [0,1] then bwd [0,2]: layers 0,1 stay on the GPU between them
    plan = make_plan(gpus=2, R=5, fwd=((0, 1), (2, 2)), bwd=((0, 2), (3, 4)))
    ins = compile_plan(plan).ranks[1]
    w_in = [x.layers for x in ins if x.kind is Kind.SWAP_IN and x.tensor is Tensor.W]
    assert w_in == [(2, 2), (0, 1)]


def test_naive_swapping_sweeps_each_microbatch_through_every_pack():
    """Without input-batch grouping every microbatch brings every pack's weights in again, each
    sweep's gradients are added on the host, and each pack's optimizer steps once, at the end."""
    plan = make_plan(mode="vDP", batch=6, uf=2, ub=2, fwd=((0, 0), (1, 1), (2, 4)), bwd=tuple((l, l) for l in range(6)),
                     input_batch_grouping=False)
    program = compile_plan(plan, layer_bytes=sizes(6))
    validate_program(program)
    ins = program.ranks[0]
    w_in = Counter(x.layers for x in ins if x.kind is Kind.SWAP_IN and x.tensor is Tensor.W)
    grouped = compile_plan(plan.replace(input_batch_grouping=True), layer_bytes=sizes(6)).ranks[0]
    w_grouped = Counter(x.layers for x in grouped if x.kind is Kind.SWAP_IN and x.tensor is Tensor.W)
    assert w_in == Counter({k: 3 * v for k, v in w_grouped.items()})           # 3 sweeps of 2 samples
    dw = [x for x in ins if x.kind is Kind.SWAP_OUT and x.tensor is Tensor.DW]
    assert sorted(x.mb for x in dw) == sorted([0, 1, 2] * 6)
    last_dw = {x.layers: k for k, x in enumerate(ins) if x.kind is Kind.SWAP_OUT and x.tensor is Tensor.DW}
    upd = {x.layers: k for k, x in enumerate(ins) if x.kind is Kind.UPD}
    assert upd.keys() == last_dw.keys() and all(upd[p] > last_dw[p] for p in upd)
    assert {x.size for x in ins if x.kind is Kind.FWD} == {2}
    # an added sweep reads the host gradients it adds to; the first overwrites them
    assert effects(dw[0], 6).host_reads == () and effects(next(x for x in dw if x.mb), 6).host_reads


def test_bytes_and_peak_memory():
    program = compile_plan(make_plan(), layer_bytes=sizes(6))
    w = [x for x in program.ranks[0] if x.kind is Kind.SWAP_IN and x.tensor is Tensor.W]
    assert w[0].bytes == 2000                  # layers 0..1
    stats = validate_program(program)
    assert stats.peak_bytes[0] > 3000
    assert stats.bytes_moved["swap_in"] > 0


# -- every compiled program validates (hypothesis) -------------------------------------------------------

@st.composite
def plans(draw):
    R = draw(st.integers(1, 8))

    def cover(lo, hi):
        packs, a = [], lo
        while a <= hi:
            b = draw(st.integers(a, hi))
            packs.append((a, b))
            a = b + 1
        return packs
    bwd = cover(0, R - 1)
    fwd = cover(0, bwd[-1][0] - 1) if bwd[-1][0] > 0 else []
    mode = draw(st.sampled_from(["vPP", "vDP"]))
    gpus = draw(st.integers(1, 2))
    batch = draw(st.integers(gpus, 7))
    share = batch if mode == "vPP" else -(-batch // gpus)
    naive = draw(st.booleans())      # no input-batch grouping: one microbatch size, optimizer on the CPU
    options = tuple(PackOptions(draw(st.booleans()), "cpu" if naive else draw(st.sampled_from(["cpu", "gpu"])))
                    for _ in bwd)
    uf = draw(st.integers(1, share))
    return make_plan(mode=mode, gpus=gpus, batch=batch, uf=uf, ub=uf if naive else draw(st.integers(1, share)),
                     fwd=fwd, bwd=bwd, R=R, options=options, allow_uneven=True, prefetch=draw(st.booleans()),
                     input_batch_grouping=not naive, gpu_handoff=draw(st.booleans()))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_every_compiled_program_validates(plan):
    if not plan.input_batch_grouping and plan.mode == "vDP" and plan.gpus > 1:
        counts = {len(microbatch_rows(plan, "FWD", r)) for r in range(plan.gpus)}
        if len(counts) > 1:     # replicas that sweep unequally often: refused, with the reason
            with pytest.raises(PlanError, match="needs as many microbatches on every GPU"):
                compile_plan(plan)
            return
    program = compile_plan(plan, layer_bytes=sizes(plan.num_layers))
    stats = validate_program(program)
    assert Program.from_dict(json.loads(program.to_json())) == program
    for ins in program.ranks:
        for x in ins:
            assert Instr.from_str(str(x)) == x
    total = program.counts()
    n_tasks = len(plan.packs_fwd) + len(plan.packs_bwd)
    copies = plan.gpus if plan.mode == "vDP" else 1
    # each layer's weights arrive at most once per task that runs it, and per sweep without grouping
    sweeps = 1 if plan.input_batch_grouping else max(len(microbatch_rows(plan, "FWD", r)) for r in range(plan.gpus))
    per_layer = Counter(l for ins in program.ranks for x in ins
                        if x.kind is Kind.SWAP_IN and x.tensor is Tensor.W for l in x.layer_range)
    runs = Counter(l for a, b in plan.packs_fwd + plan.packs_bwd for l in range(a, b + 1))
    assert all(0 < per_layer[l] <= copies * runs[l] * sweeps for l in runs)
    assert total["U"] == len(plan.packs_bwd)
    assert total["SY"] + total["SsX"] + total["SdX"] == total["RX"] + total["RsX"] + total["RdY"]
    if plan.mode == "vDP" and plan.gpus > 1:
        assert total["AdW"] == plan.gpus * len(plan.packs_bwd) * sweeps     # every sweep's gradients
    assert sum(stats.instructions) == sum(total.values())
    assert n_tasks <= sum(1 for ins in program.ranks for x in ins if x.kind in (Kind.FWD, Kind.BWD))


def test_gpu_handoff_keeps_single_microbatch_gradients_on_the_gpu():
    kept = make_plan(mode="vDP", batch=4, uf=4, ub=4, fwd=((0, 0), (1, 2)), bwd=((0, 1), (2, 2), (3, 5)),
                     gpu_handoff=True)

    def moves(plan):
        program = compile_plan(plan, layer_bytes=sizes(6))
        validate_program(program)
        return {(x.kind, x.tensor, x.layers[0]) for x in program.ranks[0] if x.kind in (Kind.SWAP_IN, Kind.SWAP_OUT)}
    host = moves(kept.replace(gpu_handoff=False))
    gradients = {(Kind.SWAP_OUT, Tensor.DX, 3), (Kind.SWAP_IN, Tensor.DY, 3), (Kind.SWAP_OUT, Tensor.DX, 2),
                 (Kind.SWAP_IN, Tensor.DY, 2)}
    assert gradients <= host and host - moves(kept) == gradients      # activations still go through host
    # two backward microbatches: the gradients go through host memory too
    assert moves(kept.replace(microbatch_bwd=2)) == moves(kept.replace(microbatch_bwd=2, gpu_handoff=False))


# -- the validator catches broken programs --------------------------------------------------------------

def two_rank_program() -> Program:
    return compile_plan(make_plan(gpus=2, ub=1), layer_bytes=sizes(6))


@pytest.mark.parametrize("kind, message", [(Kind.RECV, r"send to rank \d \(tag \d+\) has no matching receive"),
                                           (Kind.SEND, r"receive from rank \d \(tag \d+\) has no matching send")])
def test_message_without_its_partner_is_caught(kind, message):
    program = two_rank_program()
    r, idx = next((r, i) for r, ins in enumerate(program.ranks) for i, x in enumerate(ins) if x.kind is kind)
    ins = list(program.ranks[r])
    dropped = ins.pop(idx)
    ins = [x.replace(waits_on=tuple(w for w in x.waits_on if w != dropped.id)) for x in ins]
    with pytest.raises(ProgramError, match=message) as e:
        validate_program(replace(program, r, ins))
    assert "<-- ERROR HERE" in str(e.value)


def test_use_before_arrival_is_caught():
    program = compile_plan(make_plan())
    ins = list(program.ranks[0])
    first_w = next(i for i, x in enumerate(ins) if x.kind is Kind.SWAP_IN and x.tensor is Tensor.W)
    gone = ins.pop(first_w)
    ins = [x.replace(waits_on=tuple(w for w in x.waits_on if w != gone.id)) for x in ins]
    with pytest.raises(ProgramError, match=r"uses device tensor W\[0\] before it arrives"):
        validate_program(replace(program, 0, ins))


def test_missing_wait_is_caught():
    program = compile_plan(make_plan())
    ins = list(program.ranks[0])
    k = next(i for i, x in enumerate(ins) if x.kind is Kind.FWD)
    ins[k] = ins[k].replace(waits_on=())
    with pytest.raises(ProgramError, match="without waiting for it") as e:
        validate_program(replace(program, 0, ins))
    assert "<-- ERROR HERE" in str(e.value)


def test_memory_over_the_cap_is_caught_and_named():
    program = compile_plan(make_plan(), layer_bytes=sizes(6))
    peak = validate_program(program).peak_bytes[0]
    validate_program(program, cap_bytes=peak)
    with pytest.raises(ProgramError, match=f"over the cap of {peak - 1} bytes") as e:
        validate_program(program, cap_bytes=peak - 1)
    assert str(e.value).startswith("rank 0: instruction ")


def test_sends_out_of_order_are_caught():
    program = compile_plan(make_plan(gpus=2, ub=1))
    r = next(r for r, ins in enumerate(program.ranks) if sum(x.kind is Kind.SEND for x in ins) >= 2)
    ins = list(program.ranks[r])
    a, b = [i for i, x in enumerate(ins) if x.kind is Kind.SEND][:2]
    ins[a], ins[b] = ins[a].replace(tag=ins[b].tag), ins[b].replace(tag=ins[a].tag)
    with pytest.raises(ProgramError, match="same order|sends layers|sends dX"):
        validate_program(replace(program, r, ins))


def test_deadlock_is_caught():
    # each rank sends only what it received from the other: neither can start
    ranks = tuple(tuple(Instr.from_str(x) for x in (f"0:RX[0-0]#0(0+2)@p>{peer}.{peer}",
                                                    f"1:SY[0-0]#0(0+2)@p>{peer}.{1 - peer}<0",
                                                    "2:DX[0-0]#0(0+2)@c<1"))
                  for peer in (1, 0))
    program = Program(ranks=ranks, num_layers=2, mode="vPP", batch=2, samples=(2, 2), sample_offsets=(0, 0))
    with pytest.raises(ProgramError, match="deadlock") as e:
        validate_program(program)
    assert "rank 0 stuck at 0:RX[0-0]" in str(e.value)


def test_waits_must_point_backwards():
    program = compile_plan(make_plan())
    ins = list(program.ranks[0])
    ins[0] = ins[0].replace(waits_on=(len(ins) - 1,))
    with pytest.raises(ProgramError, match="not an earlier instruction"):
        validate_program(replace(program, 0, ins))


def test_format_schedule_marks_the_step():
    program = compile_plan(make_plan())
    text = format_schedule(program, 0, 5, context=2)
    assert text.count("\n") == 5 and "<-- ERROR HERE" in text.splitlines()[3]


def test_effects_name_what_moves():
    e = effects(Instr.from_str("3:IsX[2-2]#1(2+2)@i"), 6)
    assert e.allocs == (("sX", 2, 2, 2),) and e.host_reads == ((("sX", 2), (2, 2)),)
    e = effects(Instr.from_str("4:B[2-3]#0(0+2)@c"), 6)
    assert ("dX", 4, 0, 2) in e.reads and ("dX", 2, 0, 2) in e.allocs and ("dW", 3) in e.allocs
    e = effects(Instr(5, Kind.UPD, (0, 1), Stream.CPU), 6)
    assert e.host_reads == ((("dW", 0), None), (("dW", 1), None))


def test_layer_bytes_from_a_bundled_profile():
    from harmony_opt.core.bundled import load_profile

    prof = load_profile("bert_large")
    R = prof.num_layers
    lb = LayerBytes.from_profile(prof, 4)
    half = R // 2
    plan = make_plan(batch=8, uf=4, ub=4, fwd=((0, half - 1),), bwd=((0, half - 1), (half, R - 1)), R=R)
    stats = validate_program(compile_plan(plan, layer_bytes=lb))
    assert stats.peak_bytes[0] > int(prof.param_bytes(half, R - 1))


def test_a_plans_transfer_order_is_the_programs_issue_order():
    """The compiler issues the swap-outs in the plan's order (Plan.transfer_order), keeps every other
    instruction and every dependency, and refuses an order that would move a tensor before it is made."""
    p = make_plan(mode="vDP", gpus=1, batch=8, uf=4, ub=4, fwd=[(0, 1), (2, 3)], bwd=[(0, 1), (2, 3), (4, 5)], R=6)

    def swap_outs(program):
        return [instruction_key(x) for x in program.ranks[0] if x.kind is Kind.SWAP_OUT and instruction_key(x)]
    rule = compile_plan(p)
    keys = swap_outs(rule)
    order = [k for k in keys if k.startswith("Y")] + [k for k in keys if not k.startswith("Y")]
    assert order != keys
    program = compile_plan(p.replace(transfer_order=[(0, "swap_out", tuple(order))]),
                           layer_bytes=sizes(p.num_layers))
    assert swap_outs(program) == order
    validate_program(program)
    assert Counter(x.replace(id=0, waits_on=(), bytes=0) for x in program.ranks[0]) == \
        Counter(x.replace(id=0, waits_on=()) for x in rule.ranks[0])
    with pytest.raises(PlanError, match="rank 0's swaps cannot be issued in that order"):
        compile_plan(p.replace(transfer_order=[(0, "swap_out", tuple(reversed(keys)))]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_the_simulator_counts_the_forward_instructions_the_compiler_issues(plan):
    """A forward pack is issued as one instruction per piece (cut where a backward pack starts inside it);
    the simulator charges ``issue_overhead_s`` per piece and microbatch (core.plan.forward_instructions)."""
    if not plan.input_batch_grouping and plan.mode == "vDP" and plan.gpus > 1 and \
            len({len(microbatch_rows(plan, "FWD", r)) for r in range(plan.gpus)}) > 1:
        return          # refused by the compiler (test_every_compiled_program_validates)
    counts = compile_plan(plan).counts()
    nodes = compose(plan, synthetic_profile(R=plan.num_layers), get_hardware("1080ti-x4").with_gpus(plan.gpus))
    pieces = forward_instructions(plan.packs_fwd, plan.packs_bwd)
    charged = sum(len(n.microbatches) * pieces[n.pack]
                  for n in nodes if n.kind == TaskKind.FWD)
    assert counts["F"] + counts["FsA"] == charged
