"""Cut a model into Harmony's ordered layers ("vLayers"), the loss being the last one.

The planner, the profiler and the executor all see a model as a chain: layer 0 takes
the input batch tensor, layer ``l > 0`` takes the single tensor layer ``l - 1``
returned, and the last layer is the loss, called as ``loss(prev_output, targets)``
and returning the MEAN loss over the samples of its microbatch (so microbatch losses
average to the minibatch loss). A chain is what lets packs be contiguous layer ranges
that swap in and out as units.

Three ways in::

    layers = decompose(nn.Sequential(...), nn.CrossEntropyLoss())          # children
    layers = decompose(my_model, loss, split_at=(MyBlock,), example_input=x)  # torch.fx
    model = decompose_hf(AutoModelForCausalLM.from_config(config))          # Hugging Face (measure.hf)

Layers share their parameters with the model they came from (no copies); a head tied to
the token embedding stays tied (both layers hold the one parameter).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from ..core.errors import UsageError, first_line

MakeBatch = Callable[[int, torch.Generator], "tuple[torch.Tensor, torch.Tensor]"]


@dataclasses.dataclass
class LayeredModel:
    """A model as a chain of layers, with the data it trains on.

    ``make_batch(batch_size, generator)`` returns ``(inputs, targets)`` on the CPU,
    deterministic given the generator, so that every executor and every test trains
    on the same minibatches. ``meta`` holds architecture facts the profile records
    (``sequence_length``, ``optimizer`` "adam" or "sgd", ``description``, ...).
    """

    name: str
    layers: list[nn.Module]
    make_batch: MakeBatch
    meta: dict = dataclasses.field(default_factory=dict)
    #: the undecomposed model the layers share their parameters with, where known (decompose_hf's
    #: Hugging Face model: ``run --save`` writes it with ``save_pretrained``)
    source: nn.Module | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def tied(self) -> list[tuple[tuple[int, str], ...]]:
        """Parameters held by more than one layer (an LM head tied to its embedding), as groups of
        ``(layer, name)``: the executor sums their gradients into one update (runtime/tied.py)."""
        from harmony_opt.runtime.tied import tied_groups
        return tied_groups(self.layers)

    def batch(self, size: int, generator: torch.Generator, error: type[Exception] = UsageError):
        """``make_batch(size, generator)``, refused (``error``) where its inputs or targets do not
        hold ``size`` samples on dimension 0: microbatches are slices along it, so a model that puts
        its samples elsewhere (a sequence-first transformer) would train on slices of its sequence."""
        b = self.make_batch(size, generator)
        got = [t.shape[0] if isinstance(t, torch.Tensor) and t.dim() else None for t in b] \
            if isinstance(b, (tuple, list)) and len(b) == 2 else None
        if got is not None and got != [size] * 2:
            raise error(f"model {self.name!r}: make_batch({size}, generator) returned {got[0]} inputs and "
                        f"{got[1]} targets; make_batch must return exactly the number of samples it is asked "
                        f"for, on dimension 0")
        return b

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The chain's loss on one batch: the reference every executor must reproduce."""
        return run_layers(self.layers, inputs, targets)


def run_layers(layers: list[nn.Module], inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Chain ``layers`` on one batch; the last layer gets ``(output, targets)``."""
    x = inputs
    for layer in layers[:-1]:
        x = layer(x)
    return layers[-1](x, targets)


# -- generic models --------------------------------------------------------------------------

def decompose(model: nn.Module, loss: nn.Module, *, split_at: tuple[type, ...] = (),
              example_input: torch.Tensor | None = None) -> list[nn.Module]:
    """Layers of ``model`` followed by ``loss``.

    An ``nn.Sequential`` (with no ``split_at``) is cut at its children. Any other model
    is traced with ``torch.fx`` (modules of the ``split_at`` types stay opaque) and cut
    before every module of those types; the operations between two such modules join
    the layer of the module before them (so a max-pool after a conv fuses into the
    conv's layer, as in Harmony), and operations before the first one join the first
    layer. Every cut must be crossed by exactly one tensor; a skip connection across a
    cut is refused with the name of the module where it happens.

    ``example_input``, when given, is run through the model and through the layers and
    the two outputs must agree: a cheap proof that the cut is faithful.
    """
    if isinstance(model, nn.Sequential) and not split_at:
        body = list(model.children())
    elif not split_at:
        raise UsageError(f"{type(model).__name__} is not an nn.Sequential: give split_at, the module "
                         f"types to cut before (e.g. split_at=(MyBlock,))")
    else:
        body = _fx_split(model, tuple(split_at))
    if example_input is not None:
        _check_same_output(model, body, example_input)
    return [*body, loss]


class _LeafTracer(torch.fx.Tracer):
    """fx tracer that keeps the split types opaque, so each becomes one call_module node."""

    def __init__(self, leaves: tuple[type, ...]):
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, self.leaves) or super().is_leaf_module(m, qualname)


def _fx_split(model: nn.Module, split_at: tuple[type, ...]) -> list[nn.Module]:
    from torch.fx.passes.split_module import split_module

    names = ", ".join(t.__name__ for t in split_at)
    try:
        graph = _LeafTracer(split_at).trace(model)
    except Exception as e:  # fx raises TraceError, TypeError, ... on data-dependent control flow
        raise UsageError(f"cannot trace {type(model).__name__} with torch.fx ({first_line(e)}); "
                         f"add the untraceable module's type to split_at or pass an nn.Sequential") from None
    gm = torch.fx.GraphModule(model, graph)
    part, heads = _partition(gm, split_at)
    if not heads:
        raise UsageError(f"{type(model).__name__} calls no module of type {names}; nothing to split at")
    split = split_module(gm, model, lambda node: part[node], keep_original_order=True)
    return _chain_of(split, heads, type(model).__name__)


def _partition(gm: torch.fx.GraphModule, split_at: tuple[type, ...]) -> tuple[dict, list[str]]:
    """Partition id of every node: a new one starts at each module of a split type.

    Returns the node -> partition map and, per partition, the qualified name of the
    module that starts it (for error messages).
    """
    part, heads = {}, []
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), split_at):
            heads.append(str(node.target))
        part[node] = max(len(heads) - 1, 0)
    return part, heads


def _chain_of(split: torch.fx.GraphModule, heads: list[str], model_name: str) -> list[nn.Module]:
    """The partitions of ``split`` as a chain, refusing any cut crossed by more than one tensor."""
    nodes = list(split.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise UsageError(f"{model_name}.forward takes {len(inputs)} inputs; a layered model takes one tensor")
    calls = [n for n in nodes if n.op == "call_module"]
    prev = inputs[0]
    for k, node in enumerate(calls):
        if node.args != (prev,) or node.kwargs or len(prev.users) != 1:
            where = heads[k] if k < len(heads) else heads[-1]
            raise UsageError(f"{model_name}: the cut before module {where!r} is crossed by more than one tensor "
                             f"(a skip connection or a second input); split at a coarser module type that "
                             f"contains the whole connection")
        prev = node
    (out,) = [n for n in nodes if n.op == "output"]
    if out.args != (prev,) or any(n.op not in ("placeholder", "call_module", "output") for n in nodes):
        raise UsageError(f"{model_name}: the last layer returns more than one tensor; a layered model's body "
                         f"must return one tensor")
    return [getattr(split, str(n.target)) for n in calls]


def _check_same_output(model: nn.Module, body: list[nn.Module], x: torch.Tensor) -> None:
    with torch.no_grad():
        want = model(x)
        got = x
        for k, layer in enumerate(body):
            got = layer(got)
            if not isinstance(got, torch.Tensor):
                raise UsageError(f"layer {k} ({type(layer).__name__}) returns {type(got).__name__}; "
                                 f"every layer must return one tensor")
    if not isinstance(want, torch.Tensor) or want.shape != got.shape or not torch.allclose(want, got, atol=1e-5):
        raise UsageError(f"the layers of {type(model).__name__} do not reproduce its output on example_input; "
                         f"the model's forward does more than call its modules in order (is it deterministic, "
                         f"with dropout off?)")


# -- Hugging Face transformers (harmony_opt.measure.hf) ----------------------------------------------

class ClassificationLoss(nn.Module):
    """Cross entropy over the classes, mean over samples (``BertForSequenceClassification``'s loss)."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def decompose_gpt2(hf_model: nn.Module) -> list[nn.Module]:
    """Layers of a ``GPT2LMHeadModel`` (:func:`harmony_opt.measure.hf.decompose_gpt2`)."""
    from .hf import decompose_gpt2 as cut
    return cut(hf_model)


def decompose_bert(hf_model: nn.Module) -> list[nn.Module]:
    """Layers of a ``BertForSequenceClassification`` (:func:`harmony_opt.measure.hf.decompose_bert`)."""
    from .hf import decompose_bert as cut
    return cut(hf_model)
