"""What the executor copies between host and GPU is what the simulator charges for.

The planner is judged by the simulator, the runtime runs the compiler's program: if the two
disagreed on what moves, a plan's predicted time would describe another schedule (as naive
swapping did, compiled with input-batch grouping until 2026-11-22: 18 % fewer bytes than
simulated on GPT-2 medium). A tiny GPT-2 is profiled on the CPU, so the profile's sizes are the
model's, and each plan's bytes per step are compared. Known differences, all small: the
executor also loads the targets (the simulator does not model them) and the simulator charges
stashing layer 0's input, which is the data already in host memory; a stashed pack's saved
activations are counted by the profile layer by layer (a tensor two layers save, twice) and by
the executor once per storage (7 % apart here).
"""
from __future__ import annotations

import functools

import pytest

from harmony_opt.core.hardware import get_hardware
from harmony_opt.measure.models import build_model
from harmony_opt.core.plan import PackOptions, Plan
from harmony_opt.sim.simulator import simulate
from harmony_opt.training import train

NO_RC, GPU_OPT = PackOptions(recompute=False), PackOptions(optimizer="gpu")


@functools.lru_cache(maxsize=1)
def _profile():
    from harmony_opt.measure.profiler import profile_model
    return profile_model(build_model("gpt2-tiny"), [1, 2, 3, 4], "cpu", repeats=1, warmup=0, progress=False)


def _plans(R: int) -> dict[str, tuple[Plan, float]]:
    """name: (plan, relative tolerance)."""
    base = dict(planner="t", num_layers=R)
    three = dict(packs_fwd=((0, 1), (2, 3)), packs_bwd=((0, 1), (2, 3), (4, R - 1)))
    return {
        "vPP, recompute": (Plan(mode="vPP", gpus=1, batch=8, microbatch_fwd=4, microbatch_bwd=2, **three, **base),
                           0.01),
        "vDP, uneven microbatches": (Plan(mode="vDP", gpus=1, batch=7, microbatch_fwd=3, microbatch_bwd=2,
                                          packs_fwd=((0, 2),), packs_bwd=((0, 2), (3, R - 1)), allow_uneven=True,
                                          **base), 0.01),
        "naive swapping": (Plan(mode="vDP", gpus=1, batch=8, microbatch_fwd=2, microbatch_bwd=2,
                                packs_fwd=tuple((l, l) for l in range(R - 1)), packs_bwd=tuple((l, l) for l in range(R)),
                                input_batch_grouping=False, **base), 0.01),
        "one microbatch, handoffs kept on the GPU": (Plan(mode="vDP", gpus=1, batch=4, microbatch_fwd=4,
                                                          microbatch_bwd=4, gpu_handoff=True, **three, **base), 0.01),
        "stashed pack, GPU optimizer": (Plan(mode="vPP", gpus=1, batch=8, microbatch_fwd=4, microbatch_bwd=2,
                                             options=(NO_RC, GPU_OPT, PackOptions()), **three, **base), 0.10),
    }


@pytest.mark.parametrize("name", list(_plans(8)))
def test_executor_moves_the_bytes_the_simulator_charges(name):
    model = build_model("gpt2-tiny")
    plan, tol = _plans(model.num_layers)[name]
    sim = simulate(plan, _profile(), get_hardware("1080ti-x4"), memory_cap=10 ** 12).bytes_moved()
    got = train(model, plan, steps=2, progress=False).bytes_moved[0]
    for way in ("h2d", "d2h"):
        assert got[way] / 2 == pytest.approx(sim[way], rel=tol), (name, way, got[way] / 2, sim[way])


@pytest.mark.parametrize("name", list(_plans(8)))
def test_host_memory_is_what_the_executor_holds(name, monkeypatch):
    """harmony_opt.sim.host_memory against the executor's host tensors after one iteration with Adam: the
    master weights, the gradient buffers, the optimizer state and the activation buffers (the targets
    aside, which no profile has); a stashed pack's host copies of its saved activations are counted
    while they live, and the profile counts them layer by layer (a few % apart, as above)."""
    import torch

    import harmony_opt.runtime.executor as rex
    from harmony_opt.compile.compiler import compile_plan
    from harmony_opt.sim.host_memory import host_memory
    from harmony_opt.compile.program import Kind
    from harmony_opt.runtime.optim import PackOptimizers
    from harmony_opt.measure.shapes import boundary_shapes
    from harmony_opt.runtime.worker import updated_packs

    def size(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)
    model = build_model("gpt2-tiny")
    plan, tol = _plans(model.num_layers)[name]
    program = compile_plan(plan)
    x, y = model.make_batch(plan.batch, torch.Generator().manual_seed(0))
    optim = PackOptimizers(model.layers, updated_packs(program, 0), lambda ps: torch.optim.Adam(ps))
    kept = {}
    forward = rex._HANDLERS[Kind.FWD]

    def spy(ex, ins, e):        # the saved activations of the graphs a stashed pack keeps on the host
        out = forward(ex, ins, e)
        kept.update({k: size(s.host for s in g.saved) for k, g in ex.kept.items()})
        return out
    monkeypatch.setitem(rex._HANDLERS, Kind.FWD, spy)
    ex = rex.Executor(program, 0, model.layers, optim, boundary_shapes(model.layers, x, y))
    ex.run_iteration(0, x, y)
    ex.close()
    want = host_memory(plan, _profile(), get_hardware("1080ti-x4"))
    assert size(p for layer in model.layers for p in [*layer.parameters(), *layer.buffers()]) == want.weights
    assert size(optim.grads.values()) == want.gradients
    state = [v for o in optim.opts.values() if o for st in o.state.values() for v in st.values() if v.dim() > 0]
    assert size(state) == want.optimizer
    acts = size(b for k, b in ex.host._bufs.items() if k != ("T",)) + sum(kept.values())
    assert acts == pytest.approx(want.activations, rel=tol), (acts, want.activations)
    assert bool(kept) == any(not o.recompute for o in plan.options)


def test_the_quick_host_ceiling_is_never_below_the_count():
    """host_memory.overrun skips the exact count where a ceiling of the plan's buffers fits: the ceiling
    must hold for every kind of plan (stash, naive swapping, uneven vDP, kept gradients, Harmony's)."""
    from harmony_opt.planners.baselines import plan_harmony
    from harmony_opt.core.bundled import load_profile
    from harmony_opt.sim.host_memory import activation_ceiling, host_memory

    def ceiling(plan, prof):
        packs = [*plan.packs_fwd, *plan.packs_bwd]
        stashed = [l for (a, b), o in zip(plan.packs_bwd, plan.options) if not o.recompute for l in range(a, b + 1)]
        return activation_ceiling(prof, plan.batch, [a for a, _ in packs] + [b + 1 for _, b in packs
                                                                             if b + 1 < prof.num_layers], stashed)
    hw = get_hardware("1080ti-x4")
    cases = [(plan, _profile()) for plan, _ in _plans(8).values()]
    for name in ("gpt2_xl", "vgg416", "bert_96"):
        cases += [(plan_harmony(load_profile(name), hw, 64, 10 * 2**30, mode=m, gpus=4), load_profile(name))
                  for m in ("vPP", "vDP")]
    for plan, prof in cases:
        assert ceiling(plan, prof) >= host_memory(plan, prof, hw).activations > 0
