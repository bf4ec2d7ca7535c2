"""Decomposer and built-in models: layers reproduce the original model; full-size cuts match the profiles."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from harmony_opt.core.bundled import load_profile
from harmony_opt.measure.decompose import LayeredModel, decompose, decompose_bert, decompose_gpt2, run_layers
from harmony_opt.core.errors import UsageError
from harmony_opt.measure.models import MODEL_NAMES, BasicBlock, build_model, build_original, layer_count

TINY = ("gpt2-tiny", "bert-tiny", "vgg-tiny", "resnet-tiny")
FULL = {"gpt2-medium": "gpt2_medium", "gpt2-xl": "gpt2_xl", "bert-large": "bert_large", "bert-96": "bert_96",
        "vgg416": "vgg416", "resnet1026": "resnet1026"}


def _reference(original: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The undecomposed model's own logits and loss (Hugging Face computes its loss itself)."""
    if isinstance(original, nn.Sequential):
        logits = original(x)
        return logits, nn.functional.cross_entropy(logits, y)
    out = original(input_ids=x, labels=y)
    return out.logits, out.loss


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_layers_reproduce_original_output_loss_and_gradients(name):
    original, model = build_original(name)
    x, y = model.make_batch(3, torch.Generator().manual_seed(1))
    want_logits, want_loss = _reference(original, x, y)
    want_grads = torch.autograd.grad(want_loss, list(original.parameters()))

    h = x
    for k, layer in enumerate(model.layers[:-1]):
        h = layer(h)
        assert isinstance(h, torch.Tensor), f"layer {k} returns {type(h).__name__}"
    loss = model.layers[-1](h, y)
    grads = torch.autograd.grad(loss, list(original.parameters()), allow_unused=True)

    torch.testing.assert_close(h, want_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert loss.ndim == 0


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_is_small_deterministic_and_dropout_free(name):
    a, b = build_model(name, seed=3), build_model(name, seed=3)
    params = [p for layer in a.layers for p in layer.parameters()]
    assert sum(p.numel() * 4 for p in params) < 8e6
    for pa, pb in zip(params, (p for layer in b.layers for p in layer.parameters())):
        assert torch.equal(pa, pb)
    assert all(m.p == 0 for layer in a.layers for m in layer.modules() if isinstance(m, nn.Dropout))
    xa, ya = a.make_batch(2, torch.Generator().manual_seed(5))
    xb, yb = b.make_batch(2, torch.Generator().manual_seed(5))
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert a.meta["optimizer"] in ("adam", "sgd") and a.meta["description"]


def test_layers_share_the_original_parameters():
    original, model = build_original("bert-tiny")
    assert {id(p) for layer in model.layers for p in layer.parameters()} == {id(p) for p in original.parameters()}


@pytest.mark.parametrize("name, profile", FULL.items())
def test_full_size_cut_matches_the_shipped_profile_without_allocating(name, profile):
    model = build_model(name, device="meta")
    prof = load_profile(profile)
    assert model.num_layers == prof.num_layers == layer_count(name)
    got = np.array([sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.layers])
    want = prof.layers.sort_values("layer")["param_bytes"].to_numpy()
    np.testing.assert_array_equal(got, want)


def test_layer_counts_of_the_paper_models():
    counts = {n: layer_count(n) for n in FULL}
    assert counts == {"gpt2-medium": 28, "gpt2-xl": 52, "bert-large": 28, "bert-96": 100,
                      "vgg416": 417, "resnet1026": 515}


def test_names_are_case_insensitive_and_unknown_names_list_the_valid_ones():
    assert build_model("VGG_Tiny").name == "vgg-tiny"
    with pytest.raises(UsageError, match="valid names: .*gpt2-tiny"):
        build_model("gpt3")
    assert set(TINY) | set(FULL) == set(MODEL_NAMES)


def test_overrides_change_the_spec_and_are_checked():
    assert build_model("gpt2-tiny", n_layer=2).num_layers == 6
    assert build_model("resnet-tiny", blocks=[1, 1, 1, 1]).num_layers == 7
    with pytest.raises(UsageError, match="unknown option.*valid"):
        build_model("gpt2-tiny", n_layers=2)
    with pytest.raises(UsageError, match="n_layer must be"):
        build_model("gpt2-tiny", n_layer=0)
    with pytest.raises(UsageError, match="norm must be"):
        build_model("resnet-tiny", norm="layer")


def test_resnet_tiny_defaults_to_group_norm_and_offers_batch_norm():
    kinds = lambda m: {type(x) for layer in m.layers for x in layer.modules()}  # noqa: E731
    assert nn.GroupNorm in kinds(build_model("resnet-tiny")) and nn.BatchNorm2d not in kinds(build_model("resnet-tiny"))
    assert nn.BatchNorm2d in kinds(build_model("resnet-tiny", norm="batch"))


# -- decompose ---------------------------------------------------------------------------------

class Stem(nn.Sequential):
    pass


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class TinyResNet(nn.Module):
    """Not a Sequential: a loop over blocks and functional ops, so only fx can cut it."""

    def __init__(self):
        super().__init__()
        self.stem = Stem(nn.Conv2d(3, 8, 3), nn.ReLU())
        self.blocks = nn.ModuleList([BasicBlock(8, 8, 1, "group"), BasicBlock(8, 16, 2, "group")])
        self.head = Head()

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(torch.relu(x))


def test_decompose_sequential_cuts_at_children_and_reproduces_the_loss():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    layers = decompose(model, nn.CrossEntropyLoss())
    assert len(layers) == 4 and layers[0] is model[0]
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    torch.testing.assert_close(run_layers(layers, x, y), nn.functional.cross_entropy(model(x), y))


def test_decompose_fx_splits_at_module_types_and_reproduces_output():
    torch.manual_seed(0)
    model, x = TinyResNet(), torch.randn(2, 3, 12, 12)
    layers = decompose(model, nn.CrossEntropyLoss(), split_at=(Stem, BasicBlock, Head), example_input=x)
    assert len(layers) == 5
    h = x
    for layer in layers[:-1]:
        h = layer(h)
    torch.testing.assert_close(h, model(x))
    assert {id(p) for layer in layers for p in layer.parameters()} == {id(p) for p in model.parameters()}
    lm = LayeredModel("tiny-resnet", layers, lambda b, g: (torch.randn(b, 3, 12, 12, generator=g),
                                                           torch.randint(5, (b,), generator=g)))
    assert lm.num_layers == 5 and lm.loss(x, torch.tensor([1, 2])).ndim == 0


def test_decompose_refuses_cuts_across_skip_connections_and_missing_split_types():
    with pytest.raises(UsageError, match="crossed by more than one tensor"):
        decompose(TinyResNet(), nn.CrossEntropyLoss(), split_at=(nn.Conv2d,))
    with pytest.raises(UsageError, match="split_at"):
        decompose(TinyResNet(), nn.CrossEntropyLoss())
    with pytest.raises(UsageError, match="no module of type"):
        decompose(TinyResNet(), nn.CrossEntropyLoss(), split_at=(nn.LSTM,))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_decompose_gpt2_with_tied_head_and_either_attention(attn):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=16, bos_token_id=63,
                        eos_token_id=63, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = attn
    hf = GPT2LMHeadModel(config)
    layers = decompose_gpt2(hf)
    assert len(layers) == 2 + 4
    assert layers[-2].weight is hf.transformer.wte.weight       # the head stays tied to the embedding
    x = torch.randint(64, (2, 16))
    out = hf(input_ids=x, labels=x)
    torch.testing.assert_close(run_layers(layers, x, x), out.loss)


def test_decompose_hf_refuses_other_models():
    with pytest.raises(UsageError, match="GPT2LMHeadModel"):
        decompose_gpt2(nn.Linear(2, 2))
    with pytest.raises(UsageError, match="BertForSequenceClassification"):
        decompose_bert(nn.Linear(2, 2))
