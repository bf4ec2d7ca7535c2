"""Training data and options: streamed minibatches, epochs, DataLoaders, LR schedulers, gradient
clipping (each compared with plain PyTorch), and the data and losses refused before step 0."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from harmony_opt.core.errors import DataError, UsageError
from harmony_opt.core.plan import PackOptions
from harmony_opt.measure.decompose import ClassificationLoss, LayeredModel, run_layers
from harmony_opt.training import train

from test_train import _batch, make_plan       # the same model data and plan shape as test_train

pytestmark = pytest.mark.usefixtures("one_thread")

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=1e-2)
STEP_LR = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5)


def mlp(seed: int = 0, loss: nn.Module | None = None) -> LayeredModel:
    torch.manual_seed(seed)
    layers = [nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
              nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4), loss or ClassificationLoss()]
    return LayeredModel("mlp", layers, _batch, {"optimizer": "sgd"})


def dataset(n: int, seed: int = 1) -> list:
    return [_batch(6, torch.Generator().manual_seed(seed * 1000 + k)) for k in range(n)]


def weights(model):
    return [{k: v.clone() for k, v in layer.state_dict().items()} for layer in model.layers]


def same(a, b) -> bool:
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def layer_errors(got, want) -> list[float]:
    out = []
    for a, b in zip(got, want):
        if b:
            diff = torch.cat([(a[k] - b[k]).flatten() for k in b])
            out.append(float(diff.norm() / torch.cat([b[k].flatten() for k in b]).norm()))
    return out


def reference(model: LayeredModel, data, factory, scheduler=None, clip=None):
    """Plain PyTorch: the whole minibatch, one optimizer (and scheduler), clip_grad_norm_ on the model."""
    params = [p for layer in model.layers for p in layer.parameters()]
    opt = factory(params)
    sched = scheduler(opt) if scheduler else None
    for x, y in data:
        opt.zero_grad()
        run_layers(model.layers, x, y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        if sched:
            sched.step()
    return [{k: v.detach().clone() for k, v in layer.state_dict().items()} for layer in model.layers]


# -- refused before step 0 ---------------------------------------------------------------------------------

class SummedLoss(nn.Module):
    """Cross entropy summed over the samples, with no ``reduction`` attribute to give it away."""

    def forward(self, logits, labels):
        return nn.functional.cross_entropy(logits, labels, reduction="sum")


@pytest.mark.parametrize("loss, fragment", [
    (nn.CrossEntropyLoss(reduction="sum"), "has reduction='sum'"),
    (SummedLoss(), "of two samples is .* but the mean of their own losses is"),
])
def test_a_loss_that_does_not_average_is_refused_before_any_step(loss, fragment):
    model = mlp(loss=loss)
    before = weights(model)
    with pytest.raises(UsageError, match=fragment + ".*reduction='mean'"):
        train(model, make_plan(), steps=2, progress=False)
    assert same(weights(model), before)
    train(mlp(loss=nn.CrossEntropyLoss()), make_plan(), steps=1, progress=False)     # the mean passes


def test_make_batch_that_ignores_its_size_is_refused():
    model = mlp()
    model.make_batch = lambda batch, gen: _batch(4, gen)
    before = weights(model)
    with pytest.raises(DataError, match=r"make_batch\(6, generator\) returned 4 inputs and 4 targets; make_batch "
                                        r"must return exactly the number of samples it is asked for"):
        train(model, make_plan(), steps=2, progress=False)
    assert same(weights(model), before)


def test_bad_options_are_refused():
    data = dataset(2)
    for kwargs, fragment in [
        (dict(epochs=2), "give data"),
        (dict(data=iter(data), epochs=2), "needs data that can be read again"),
        (dict(data=data, epochs=0), "epochs must be a whole number >= 1"),
        (dict(data=data, epochs=2, steps=5), "the data has 4 minibatches but 5 steps"),
        (dict(steps=-1), "steps must be"),
        (dict(data=[]), "the data holds no minibatch"),
        (dict(clip_grad_norm=0), "clip_grad_norm must be a number > 0"),
        (dict(scheduler="steplr"), "scheduler must be a factory"),
        (dict(scheduler=lambda opt: opt), "returned SGD, not a torch.optim.lr_scheduler.LRScheduler"),
    ]:
        with pytest.raises((UsageError, DataError), match=fragment):
            train(mlp(), make_plan(), progress=False, **kwargs)
    gpu = make_plan(options=(PackOptions(), PackOptions(optimizer="gpu"), PackOptions()))
    with pytest.raises(UsageError, match="pack.s. 2-2 step on the GPU inside the backward"):
        train(mlp(), gpu, steps=1, clip_grad_norm=1.0, progress=False)


# -- streaming, epochs, data loaders -------------------------------------------------------------------------

def test_minibatches_are_drawn_as_the_steps_run():
    """A generator is read one minibatch per step: when batch k > 0 is drawn, step k - 1 has already
    changed the weights (one rank: the caller's layers are the master weights)."""
    model = mlp()
    initial = weights(model)
    changed = []

    def stream():
        for b in dataset(4):
            changed.append(not same(weights(model), initial))
            yield b
    res = train(model, make_plan(), stream(), optimizer=SGD, progress=False)
    assert changed == [False, True, True, True] and len(res.losses) == 4 and res.steps == 4
    want = reference(mlp(), dataset(4), SGD)
    assert max(layer_errors(res.weights, want)) < 1e-5


def test_epochs_over_a_list_and_a_data_loader_and_steps_that_cut_them():
    data = dataset(3)
    twice = train(mlp(), make_plan(), data, epochs=2, optimizer=SGD, progress=False)
    assert twice.steps == 6 and same(twice.weights, train(mlp(), make_plan(), data + data, optimizer=SGD,
                                                          progress=False).weights)
    xs, ys = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    loader = DataLoader(TensorDataset(xs, ys), batch_size=6, shuffle=False, drop_last=True)
    from_loader = train(mlp(), make_plan(), loader, epochs=2, optimizer=SGD, progress=False)
    assert same(from_loader.weights, twice.weights)
    cut = train(mlp(), make_plan(), loader, epochs=2, steps=4, optimizer=SGD, progress=False)
    assert cut.steps == 4 and same(cut.weights, train(mlp(), make_plan(), (data + data)[:4], optimizer=SGD,
                                                      progress=False).weights)
    ragged = DataLoader(TensorDataset(xs[:16], ys[:16]), batch_size=6)          # 6, 6, 4: no drop_last
    with pytest.raises(DataError, match="data batch 2: inputs hold 4 samples .*drop_last=True"):
        train(mlp(), make_plan(), ragged, progress=False)


def test_a_one_pass_stream_that_runs_short_of_steps_is_refused_where_it_ends():
    with pytest.raises(DataError, match="the data has 2 minibatches but 3 steps were asked for"):
        train(mlp(), make_plan(), iter(dataset(2)), steps=3, progress=False)


def test_resume_over_epochs_continues_exactly(tmp_path):
    data = dataset(3)
    full = train(mlp(), make_plan(), data, epochs=2, optimizer=ADAM, scheduler=STEP_LR, progress=False)
    part = train(mlp(), make_plan(), data, epochs=2, steps=4, optimizer=ADAM, scheduler=STEP_LR,
                 checkpoint_dir=tmp_path, progress=False)
    assert part.steps == 4
    rest = train(mlp(seed=9), make_plan(), data, epochs=2, optimizer=ADAM, scheduler=STEP_LR,
                 checkpoint_dir=tmp_path, resume=True, progress=False)
    assert rest.start_step == 4 and rest.steps == 6 and rest.losses == full.losses
    assert same(rest.weights, full.weights)
    with pytest.raises(DataError, match="written by a run with an LR scheduler"):
        train(mlp(), make_plan(), data, epochs=2, optimizer=ADAM, checkpoint_dir=tmp_path, resume=True,
              progress=False)


@pytest.mark.parametrize("mode", ["vPP", "vDP"])
def test_two_ranks_stream_a_data_loader_like_one_rank(mode):
    data = dataset(3)
    xs, ys = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    loader = DataLoader(TensorDataset(xs, ys), batch_size=6, drop_last=True)
    plan = make_plan(mode=mode, gpus=2, microbatch_bwd=1 if mode == "vPP" else 3)
    res = train(mlp(), plan, loader, epochs=2, optimizer=SGD, progress=False)
    assert res.backend == "gloo" and res.steps == 6
    want = reference(mlp(), data + data, SGD)
    assert max(layer_errors(res.weights, want)) < 1e-5


# -- LR schedulers and gradient clipping, against plain PyTorch ---------------------------------------------

CLIP_PLANS = {
    "1rank-vpp-stash": make_plan(),
    "1rank-naive-swap": make_plan(mode="vDP", packs_fwd=[(0, 0), (1, 2)], packs_bwd=[(0, 0), (1, 2), (3, 4)],
                                  microbatch_fwd=2, microbatch_bwd=2, options=(), input_batch_grouping=False),
    "2rank-vpp": make_plan(gpus=2, microbatch_bwd=1),
    "2rank-vdp": make_plan(mode="vDP", gpus=2, microbatch_bwd=3),
}


@pytest.mark.parametrize("name", list(CLIP_PLANS))
def test_scheduler_and_clipping_match_plain_pytorch(name):
    plan, data, clip = CLIP_PLANS[name], dataset(6), 0.5
    want = reference(mlp(), data, ADAM, STEP_LR, clip)
    unclipped = reference(mlp(), data, ADAM, STEP_LR)
    assert max(layer_errors(unclipped, want)) > 1e-3            # clipping is active: the check can fail
    res = train(mlp(), plan, data, optimizer=ADAM, scheduler=STEP_LR, clip_grad_norm=clip, progress=False)
    errs = layer_errors(res.weights, want)
    assert max(errs) <= 1e-5, (name, errs)


def test_a_scheduler_alone_matches_plain_pytorch_and_the_plateau_scheduler_gets_the_loss():
    data = dataset(5)
    res = train(mlp(), make_plan(), data, optimizer=SGD, scheduler=STEP_LR, progress=False)
    assert max(layer_errors(res.weights, reference(mlp(), data, SGD, STEP_LR))) <= 1e-5
    plateau = functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, patience=0, factor=0.1)
    flat = train(mlp(), make_plan(), data, optimizer=SGD, scheduler=plateau, progress=False)
    assert len(flat.losses) == 5 and not same(flat.weights, res.weights)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", [n for n, p in CLIP_PLANS.items() if p.gpus == 1])
def test_scheduler_and_clipping_on_cuda_match_plain_pytorch(name, monkeypatch):
    """On a GPU the deferred updates read gradients that the swap-out stream copied: the iteration's
    end synchronizes the device before the norm is taken."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    data = dataset(6)
    want = reference(mlp(), data, ADAM, STEP_LR, 0.5)
    res = train(mlp(), CLIP_PLANS[name], data, optimizer=ADAM, scheduler=STEP_LR, clip_grad_norm=0.5,
                device="cuda", progress=False)
    assert max(layer_errors(res.weights, want)) < 1e-4
