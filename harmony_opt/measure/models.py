"""Built-in models by name: the Harmony paper's models at full size, and tiny versions.

::

    model = build_model("gpt2-tiny")                 # LayeredModel, a few MB, CPU in milliseconds
    model = build_model("gpt2-xl", device="meta")    # full size, shapes only (no memory)
    layer_count("resnet1026")                        # 515, without allocating weights
    build_model("gpt2-tiny", n_layer=2, dropout=0.1) # any field of the model's spec

Full-size models are built from their published configurations (no download) and cut
exactly like the shipped profiles in ``profiles/`` (same layer count, same parameter
bytes per layer), so a model profiled here is comparable with the paper's profile.
Tiny models have dropout 0, so that training is deterministic and an executor's result
can be compared with plain training; ``resnet-tiny`` uses GroupNorm for the same reason
(BatchNorm statistics depend on the microbatch). Names are case-insensitive and ``_``
may stand for ``-`` (``gpt2_xl`` works).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..core.errors import UsageError, first_line
from .decompose import LayeredModel, decompose
from .hf import decompose_bert, decompose_gpt2

# -- specifications ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GPT2Spec:
    """GPT-2 (``GPT2LMHeadModel``, LM head untied from the embedding as in Harmony's profiles)."""

    n_embd: int
    n_layer: int
    n_head: int
    vocab_size: int = 50257
    max_positions: int = 1024       # rows of the position embedding (n_positions)
    sequence_length: int = 1024     # tokens per sample in make_batch
    dropout: float = 0.1            # embedding, attention and residual dropout


@dataclasses.dataclass(frozen=True)
class BertSpec:
    """BERT (``BertForSequenceClassification``: the pooler and a ``num_labels``-way head)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int = 30522
    max_positions: int = 512
    sequence_length: int = 512
    num_labels: int = 2
    dropout: float = 0.1            # hidden, attention and classifier dropout


@dataclasses.dataclass(frozen=True)
class VGGSpec:
    """VGG: ``stages[i]`` 3x3 convolutions of ``channels[i]`` each, a 2x2 max-pool after each
    stage (fused into the stage's last conv layer), then linear layers ``fc`` and the classifier."""

    stages: tuple[int, ...]
    channels: tuple[int, ...]
    fc: tuple[int, ...] = (4096, 4096)
    num_classes: int = 1000
    image_size: int = 224
    dropout: float = 0.5            # after each hidden linear layer


@dataclasses.dataclass(frozen=True)
class ResNetSpec:
    """ResNet with basic blocks: ``blocks[i]`` blocks of ``channels[i]`` in stage ``i``.

    ``norm`` is "batch" (the paper's) or "group". BatchNorm normalizes with the
    statistics of the microbatch it sees, so microbatched training differs from
    full-batch training; GroupNorm does not depend on the batch and keeps them equal.
    """

    blocks: tuple[int, ...]
    channels: tuple[int, ...]
    num_classes: int = 1000
    image_size: int = 224
    norm: str = "batch"


@dataclasses.dataclass(frozen=True)
class _Entry:
    spec: GPT2Spec | BertSpec | VGGSpec | ResNetSpec
    description: str


# -- transformers ------------------------------------------------------------------------------

def _gpt2(spec: GPT2Spec):
    from transformers import GPT2Config, GPT2LMHeadModel

    if spec.sequence_length > spec.max_positions:
        raise UsageError(f"sequence_length {spec.sequence_length} exceeds max_positions {spec.max_positions}")
    config = GPT2Config(n_embd=spec.n_embd, n_layer=spec.n_layer, n_head=spec.n_head,
                        vocab_size=spec.vocab_size, n_positions=spec.max_positions,
                        resid_pdrop=spec.dropout, embd_pdrop=spec.dropout, attn_pdrop=spec.dropout,
                        bos_token_id=spec.vocab_size - 1, eos_token_id=spec.vocab_size - 1,
                        tie_word_embeddings=False)
    make = functools.partial(_token_batch, spec.vocab_size, spec.sequence_length, None)
    return GPT2LMHeadModel(config), make, {"sequence_length": spec.sequence_length, "optimizer": "adam"}


def _bert(spec: BertSpec):
    from transformers import BertConfig, BertForSequenceClassification

    if spec.sequence_length > spec.max_positions:
        raise UsageError(f"sequence_length {spec.sequence_length} exceeds max_positions {spec.max_positions}")
    config = BertConfig(hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
                        num_attention_heads=spec.num_heads, intermediate_size=spec.intermediate_size,
                        vocab_size=spec.vocab_size, max_position_embeddings=spec.max_positions,
                        num_labels=spec.num_labels, hidden_dropout_prob=spec.dropout,
                        attention_probs_dropout_prob=spec.dropout, classifier_dropout=spec.dropout)
    make = functools.partial(_token_batch, spec.vocab_size, spec.sequence_length, spec.num_labels)
    return BertForSequenceClassification(config), make, {"sequence_length": spec.sequence_length, "optimizer": "adam"}


def _token_batch(vocab: int, seq: int, num_labels: int | None, batch: int, gen: torch.Generator):
    """Random token ids; targets are the ids themselves (language model) or class labels."""
    ids = torch.randint(vocab, (batch, seq), generator=gen)
    if num_labels is None:
        return ids, ids.clone()
    return ids, torch.randint(num_labels, (batch,), generator=gen)


# -- CNNs --------------------------------------------------------------------------------------

def _vgg(spec: VGGSpec):
    if len(spec.stages) != len(spec.channels):
        raise UsageError(f"vgg: stages {spec.stages} and channels {spec.channels} differ in length")
    layers: list[nn.Module] = []
    cin, size = 3, spec.image_size
    for n, c in zip(spec.stages, spec.channels):
        for i in range(n):
            mods = [nn.Conv2d(cin, c, 3, padding=1), nn.ReLU()]
            layers.append(nn.Sequential(*mods, nn.MaxPool2d(2)) if i == n - 1 else nn.Sequential(*mods))
            cin = c
        size //= 2
    if size < 1:
        raise UsageError(f"vgg: image_size {spec.image_size} is too small for {len(spec.stages)} max-pools")
    width = cin * size * size
    widths = (*spec.fc, spec.num_classes)
    for k, w in enumerate(widths):
        lead = [nn.Flatten()] if k == 0 else []
        tail = [nn.ReLU(), nn.Dropout(spec.dropout)] if k < len(spec.fc) else []
        layers.append(nn.Sequential(*lead, nn.Linear(width, w), *tail))
        width = w
    return _sequential(layers, spec.num_classes, spec.image_size)


def _norm(kind: str, c: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(c)
    if kind == "group":
        return nn.GroupNorm(math.gcd(32, c), c)
    raise UsageError(f"resnet: norm must be 'batch' or 'group', got {kind!r}")


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convolutions and a skip (1x1 conv when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = _norm(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = _norm(norm, cout)
        self.relu = nn.ReLU()
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), _norm(norm, cout))
                           if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.downsample(x))


def _resnet(spec: ResNetSpec):
    if len(spec.blocks) != len(spec.channels):
        raise UsageError(f"resnet: blocks {spec.blocks} and channels {spec.channels} differ in length")
    c0 = spec.channels[0]
    layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, c0, 7, 2, 3, bias=False), _norm(spec.norm, c0),
                                             nn.ReLU(), nn.MaxPool2d(3, 2, 1))]
    cin = c0
    for stage, (n, c) in enumerate(zip(spec.blocks, spec.channels)):
        for i in range(n):
            layers.append(BasicBlock(cin, c, 2 if stage > 0 and i == 0 else 1, spec.norm))
            cin = c
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, spec.num_classes)))
    return _sequential(layers, spec.num_classes, spec.image_size)


def _sequential(body: list[nn.Module], num_classes: int, image_size: int):
    """CNNs are an ``nn.Sequential`` of their layers (cut at its children)."""
    make = functools.partial(_image_batch, num_classes, image_size)
    return nn.Sequential(*body), make, {"sequence_length": None, "image_size": image_size, "optimizer": "sgd"}


def _image_batch(num_classes: int, size: int, batch: int, gen: torch.Generator):
    return torch.randn(batch, 3, size, size, generator=gen), torch.randint(num_classes, (batch,), generator=gen)


# -- registry ----------------------------------------------------------------------------------

def _cut_sequential(model: nn.Sequential) -> list[nn.Module]:
    return decompose(model, nn.CrossEntropyLoss())


#: spec type -> (spec -> (original model, make_batch, facts), original model -> layers)
_FAMILIES: dict[type, tuple[Callable, Callable[[nn.Module], list[nn.Module]]]] = {
    GPT2Spec: (_gpt2, decompose_gpt2),
    BertSpec: (_bert, decompose_bert),
    VGGSpec: (_vgg, _cut_sequential),
    ResNetSpec: (_resnet, _cut_sequential),
}

_VGG416 = VGGSpec(stages=(82, 82, 83, 83, 83), channels=(64, 128, 256, 512, 512))

_REGISTRY: dict[str, _Entry] = {
    "gpt2-medium": _Entry(GPT2Spec(n_embd=1024, n_layer=24, n_head=16),
                          "GPT-2 medium, n_embd 1024, 24 layers, seq 1024"),
    "gpt2-xl": _Entry(GPT2Spec(n_embd=1600, n_layer=48, n_head=25),
                      "GPT-2 XL, n_embd 1600, 48 layers, seq 1024"),
    "bert-large": _Entry(BertSpec(hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096),
                         "BERT-Large, hidden 1024, 24 layers, seq 512"),
    "bert-96": _Entry(BertSpec(hidden_size=1024, num_layers=96, num_heads=16, intermediate_size=4096),
                      "BERT with 96 encoder layers, hidden 1024, seq 512"),
    "vgg416": _Entry(_VGG416, "VGG-416: VGG-16 with 80 extra 3x3 convolutions per stage, 224x224"),
    "resnet1026": _Entry(ResNetSpec(blocks=(128, 128, 128, 128), channels=(64, 128, 256, 512)),
                         "ResNet-1026: basic blocks, 128 per stage, 224x224"),
    "gpt2-tiny": _Entry(GPT2Spec(n_embd=64, n_layer=4, n_head=4, vocab_size=512, max_positions=32,
                                 sequence_length=32, dropout=0.0),
                        "tiny GPT-2 for tests: n_embd 64, 4 layers, seq 32"),
    "bert-tiny": _Entry(BertSpec(hidden_size=64, num_layers=4, num_heads=4, intermediate_size=256, vocab_size=512,
                                 max_positions=32, sequence_length=32, dropout=0.0),
                        "tiny BERT for tests: hidden 64, 4 layers, seq 32"),
    "vgg-tiny": _Entry(VGGSpec(stages=(2, 2, 2), channels=(8, 16, 32), fc=(64, 64), num_classes=10, image_size=32,
                               dropout=0.0),
                       "tiny VGG for tests: 6 convolutions, 3 linear, 32x32"),
    "resnet-tiny": _Entry(ResNetSpec(blocks=(2, 2, 2, 2), channels=(8, 16, 32, 64), num_classes=10, image_size=32,
                                     norm="group"),
                          "tiny ResNet for tests: 8 basic blocks, GroupNorm, 32x32"),
}

MODEL_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def _entry(name: str) -> tuple[str, _Entry]:
    key = str(name).strip().lower().replace("_", "-")
    if key not in _REGISTRY:
        raise UsageError(f"unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)}")
    return key, _REGISTRY[key]


def model_spec(name: str, **overrides):
    """The spec dataclass of a built-in model, with ``overrides`` applied (checked by name)."""
    key, entry = _entry(name)
    fields = {f.name for f in dataclasses.fields(entry.spec)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise UsageError(f"model {key}: unknown option(s) {', '.join(unknown)}; valid: {', '.join(sorted(fields))}")
    kinds = {f.name: f.type for f in dataclasses.fields(entry.spec)}
    return dataclasses.replace(entry.spec, **{k: _coerce(key, k, kinds[k], v) for k, v in overrides.items()})


def _coerce(model: str, field: str, kind: str, value):
    """Check one override against its field's type: counts >= 1, dropout in [0, 1), tuples of counts."""
    def count(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    if kind == "int" and count(value):
        return value
    if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1:
        return float(value)
    if kind == "str" and isinstance(value, str):
        return value
    if kind.startswith("tuple") and isinstance(value, (list, tuple)) and all(count(v) for v in value):
        return tuple(value)
    raise UsageError(f"model {model}: option {field} must be {_KIND_WORDS.get(kind, kind)}, got {value!r}")


_KIND_WORDS = {"int": "a whole number >= 1", "float": "a number in [0, 1)", "str": "a string",
               "tuple[int, ...]": "a list of whole numbers >= 1"}


def build_original(name: str, *, seed: int = 0, device: str | torch.device | None = None,
                   **overrides) -> tuple[nn.Module, LayeredModel]:
    """The undecomposed model (a Hugging Face model or an ``nn.Sequential``) and its layers.

    The layers share the original's parameters, so the original is the reference that
    the chain of layers must reproduce (tests compare their outputs and losses).
    """
    key, entry = _entry(name)
    spec = model_spec(key, **overrides)
    with torch.random.fork_rng(devices=[]), torch.device(device or "cpu"):
        torch.manual_seed(seed)
        build, cut = _FAMILIES[type(spec)]
        original, make_batch, facts = build(spec)
        layers = cut(original)
    description = entry.description if not overrides else f"{entry.description}, with {overrides}"
    meta = {**facts, "description": description, "family": type(spec).__name__.removesuffix("Spec").lower(),
            "spec": dataclasses.asdict(spec), "seed": seed, "dtype": "float32"}
    return original, LayeredModel(key, layers, make_batch, meta)


def build_model(name: str, *, seed: int = 0, device: str | torch.device | None = None,
                **overrides) -> LayeredModel:
    """Build a built-in model as a :class:`LayeredModel`.

    ``seed`` fixes the initial weights without touching the global RNG. ``device``
    "meta" builds shapes only (no memory), which is how full-size models are inspected
    cheaply; the default builds on the CPU. ``overrides`` replace fields of the
    model's spec (e.g. ``n_layer=2``, ``dropout=0.1``, ``norm="batch"``).
    """
    return build_original(name, seed=seed, device=device, **overrides)[1]


def layer_count(name: str, **overrides) -> int:
    """Number of layers (loss included) of a built-in model, built on the meta device."""
    return build_model(name, device="meta", **overrides).num_layers


# -- a user's own model ------------------------------------------------------------------------

def resolve_model(spec: str, *, seed: int = 0, trust_remote_code: bool = False, **overrides) -> LayeredModel:
    """The model a command's ``--model`` names: a built-in name (``overrides`` are fields of its
    spec), a Hugging Face model folder (``overrides`` are fields of its config; measure.hf.
    load_hf_directory, its code run only with ``trust_remote_code``), or ``path/to/file.py:function``
    or ``package.module:function``, a function returning a
    :class:`LayeredModel`, called with ``overrides`` as keyword arguments (``--set k=v``) and the
    global random generator seeded with ``seed`` (so its initial weights repeat from command to
    command). A file's folder goes on ``sys.path`` and the file is imported under its own name,
    so that rank processes can import the module that defines its layers. The user's code runs
    only because the user named it; anything wrong is a UsageError in one line."""
    text = str(spec).strip()
    if Path(text).expanduser().is_dir():
        from .hf import load_hf_directory
        return load_hf_directory(Path(text).expanduser(), seed=seed, trust_remote_code=trust_remote_code,
                                 **overrides)
    if ":" not in text:
        try:
            model_spec(text, **overrides)   # name and options checked before anything is created
        except UsageError as e:
            if str(e).startswith("unknown model"):
                raise UsageError(f"{e}; or your own model as path/to/file.py:function or "
                                 f"package.module:function") from None
            raise
        return build_model(text, seed=seed, **overrides)
    where, _, name = text.rpartition(":")
    module = _user_module(text, where)
    fn = getattr(module, name, None)
    if not name.isidentifier() or fn is None:
        raise UsageError(f"--model {text}: {where} has no function {name!r}")
    if not callable(fn):
        raise UsageError(f"--model {text}: {name} is a {type(fn).__name__}, not a function")
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = fn(**overrides)
    except Exception as e:      # the user's code: its failure is the user's to read, in one line
        args = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
        raise UsageError(f"--model {text}: {name}({args}) raised {first_line(e)}") from None
    if not isinstance(model, LayeredModel):
        raise UsageError(f"--model {text}: {name}() returned {type(model).__name__}, not a "
                         f"harmony_opt.measure.decompose.LayeredModel")
    return model


def _user_module(text: str, where: str):
    """The module of a ``file.py:function`` or ``package.module:function`` spec, imported."""
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise UsageError(f"--model {text}: no such file {where}")
        mod_name = path.stem
        known = sys.modules.get(mod_name)
        if known is not None:
            if Path(getattr(known, "__file__", "") or "").resolve() == path:
                return known
            raise UsageError(f"--model {text}: a module named {mod_name!r} is already imported from elsewhere; "
                             f"rename {path.name}")
        if not mod_name.isidentifier():
            raise UsageError(f"--model {text}: {path.name} is not importable as a module (name it like my_model.py)")
        loader_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[mod_name] = module
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        try:
            loader_spec.loader.exec_module(module)
        except BaseException as e:
            del sys.modules[mod_name]
            if not isinstance(e, Exception):
                raise
            raise UsageError(f"--model {text}: importing {where} failed: {first_line(e)}") from None
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        raise UsageError(f"--model {text}: no module named {e.name!r}") from None
    except Exception as e:
        raise UsageError(f"--model {text}: importing {where} failed: {first_line(e)}") from None
