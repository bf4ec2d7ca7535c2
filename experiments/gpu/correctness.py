"""Does the executor train exactly like plain PyTorch on this device?

Each case trains a model for 10 steps twice from the same weights on the same
minibatches: through the executor (packs, microbatches, swaps, recompute or stashed
activations, CPU or GPU optimizer) and plain PyTorch (whole minibatch, one optimizer, the
model resident on the device). TF32 is off, so both compute in float32 and only the order
of summation differs; the largest relative (Frobenius) error over the layers' weights is
reported.
"""
from __future__ import annotations

import functools

import torch

from harmony_opt.measure.decompose import run_layers
from harmony_opt.core.plan import PackOptions, Plan
from harmony_opt.training import batch_seed, train

STEPS = 10
NO_RC = PackOptions(recompute=False)
GPU_OPT = PackOptions(optimizer="gpu")


def _plan(mode, batch, uf, ub, fwd, bwd, R, options=(), gpu_handoff=False) -> Plan:
    return Plan(planner="correctness", mode=mode, gpus=1, batch=batch, microbatch_fwd=uf, microbatch_bwd=ub,
                packs_fwd=fwd, packs_bwd=bwd, num_layers=R, options=options, allow_uneven=True,
                gpu_handoff=gpu_handoff)


def cases(quick: bool):
    """(name, model name, overrides, plan, optimizer factory); packs cut at fixed layers, the last to the loss."""
    from harmony_opt.measure.models import layer_count
    from harmony_opt.runtime.optim import make_factory

    gpt = ("gpt2-tiny", {}) if quick else ("gpt2-medium", {"n_layer": 4, "sequence_length": 128, "dropout": 0.0})
    adam = functools.partial(torch.optim.Adam, lr=1e-4)
    sgd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    R, Rv = layer_count(gpt[0], **gpt[1]), layer_count("vgg-tiny")
    return [
        ("gpt2 vPP recompute, CPU Adam", *gpt, _plan("vPP", 8, 4, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, R - 1)], R),
         adam),
        ("gpt2 vPP stashed activations, GPU Adam", *gpt,
         _plan("vPP", 8, 4, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, R - 1)], R, (NO_RC, GPU_OPT, GPU_OPT)), adam),
        ("gpt2 vDP uneven microbatches", *gpt,
         _plan("vDP", 7, 3, 2, [(0, 2)], [(0, 2), (3, R - 1)], R, (NO_RC, PackOptions())), adam),
        ("gpt2 vDP gradients kept on the GPU", *gpt,
         _plan("vDP", 4, 2, 4, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, R - 1)], R, (NO_RC, GPU_OPT, PackOptions()),
               gpu_handoff=True),
         adam),
        ("gpt2 vPP CPU and GPU steps, Adam by name (fused)", *gpt,
         _plan("vPP", 8, 4, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, R - 1)], R, (NO_RC, GPU_OPT, PackOptions())),
         make_factory("adam", 1e-4)),
        ("vgg-tiny vPP, SGD", "vgg-tiny", {},
         _plan("vPP", 8, 4, 4, [(0, 3), (4, 7)], [(0, 3), (4, 7), (8, Rv - 1)], Rv, (PackOptions(), NO_RC, GPU_OPT)),
         sgd),
    ]


def _reference(model, batch: int, factory, device: torch.device):
    layers = [layer.to(device) for layer in model.layers]
    opt = factory([p for layer in layers for p in layer.parameters()])
    for s in range(STEPS):
        x, y = model.make_batch(batch, torch.Generator().manual_seed(batch_seed(0, s)))
        opt.zero_grad()
        run_layers(layers, x.to(device), y.to(device)).backward()
        opt.step()
    return [{k: v.detach().cpu().clone() for k, v in layer.state_dict().items()} for layer in layers]


def _max_error(got, want) -> float:
    errs = []
    for a, b in zip(got, want):
        keys = [k for k in b if b[k].is_floating_point()]
        if keys:
            diff = torch.cat([(a[k].cpu() - b[k]).flatten() for k in keys])
            errs.append(float(diff.norm() / torch.cat([b[k].flatten() for k in keys]).norm()))
    return max(errs)


def check_all(device: str, quick: bool, done=()) -> list[dict]:
    """One row per case not named in ``done``."""
    from harmony_opt.measure.models import build_model

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    rows = []
    for name, model_name, overrides, plan, factory in cases(quick):
        if name in done:
            continue
        initial = build_model(model_name, **overrides)
        before = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in initial.layers]
        want = _reference(build_model(model_name, **overrides), plan.batch, factory, dev)
        res = train(initial, plan, steps=STEPS, device=dev.type, optimizer=factory, progress=False)
        rows.append({"case": name, "model": model_name, "overrides": overrides, "device": device,
                     "steps": STEPS, "max_rel_error": _max_error(res.weights, want),
                     "moved_by_training": _max_error(before, want)})
    return rows
