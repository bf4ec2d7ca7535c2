"""Hugging Face transformers models as layered models: one generic path, found through attributes.

::

    model = decompose_hf(AutoModelForCausalLM.from_config(config))     # GPT-2, Llama, Mistral, Qwen2, OPT, ...
    model = decompose_hf(BertForMaskedLM(config), example=(ids, labels))
    model = decompose_hf(hf, attention_mask=True)     # inputs torch.stack([ids, mask], 1): padded text
    harmony_opt.train(model, plan)

A decoder LM is cut into: the embedding (the base model's own ``forward`` run with no blocks and
no final norm, so positions, scaling, dropout and ``project_in`` are computed exactly as the model
computes them), one layer per block (each builds the causal mask with transformers'
``create_causal_mask`` or its sliding-window variant, and the rotary position embeddings with the
model's own ``rotary_emb``, as the base model would pass them), the final norm (with ``project_out``
where there is one), the LM head and the loss. A BERT-style encoder is cut into its embeddings, its
encoder layers, then the pooler and classifier (sequence classification) or the MLM head. With
``attention_mask=True`` the padding mask travels with the activations as one extra feature.

The layers hold the model's own modules and parameters (no copies). A head tied to the token
embedding (``tie_word_embeddings``, transformers' default) stays tied: the embedding layer and the
head layer hold the same ``nn.Parameter``, and the executor sums the two layers' gradients into
one update (:mod:`harmony_opt.runtime.tied`).

Models are never downloaded here and never loaded with ``trust_remote_code``: pass a model you
built (``from_config``) or loaded yourself.
"""
from __future__ import annotations

import functools
import inspect
from pathlib import Path

import torch
from torch import nn

from ..core.errors import UnsupportedModelError, UsageError, first_line
from .decompose import ClassificationLoss, LayeredModel, run_layers

#: Names the base models give the modules that run after the blocks, in the order they run.
_AFTER_BLOCKS = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "final_norm", "norm_f", "project_out")


class Embedding(nn.Module):
    """The base model's forward with its blocks and final modules taken out: its embedding output.

    It runs a shallow copy of the base model (the *shell*) whose block list is empty and whose final
    norm is an identity, so the embedding is computed as the model computes it. The shell's other
    children are this layer's own submodules, under the base model's names (``wte``, ``wpe``,
    ``embed_tokens``, ...), so this layer holds exactly the embedding's parameters and a
    ``functional_call`` of it reaches the shell (they are the same module objects).
    """

    def __init__(self, container: nn.Module, blocks_attr: str, after: list[str]):
        super().__init__()
        if container._parameters:
            raise UnsupportedModelError(f"{type(container).__name__} holds parameters of its own "
                                        f"({', '.join(container._parameters)}) beside its modules")
        shell = _shell(container, blocks_attr, after)
        for name, m in container._modules.items():
            if m is not None and name != blocks_attr and name not in after:
                self.add_module(name, m)
        self.__dict__["shell"] = shell      # not a submodule: its modules are registered above

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.shell(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


@functools.cache
def _cache_kwarg() -> str:
    """``create_causal_mask``'s name for the key/value cache, which transformers renamed."""
    from transformers.masking_utils import create_causal_mask
    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


class DecoderBlock(nn.Module):
    """One decoder block with what the base model passes it: the causal mask (sliding-window for a
    sliding-attention layer), the position ids and, for rotary models, the position embeddings."""

    def __init__(self, block: nn.Module, config, sliding: bool, rotary: nn.Module | None, extra: dict | None = None):
        super().__init__()
        self.block = block
        self.config = config
        self.sliding = sliding
        self.rotary_emb = rotary
        self.extra = dict(extra or {})      # further arguments, as the base model passes them
        self.takes_positions = "position_ids" in inspect.signature(block.forward).parameters

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        from transformers import masking_utils

        make = masking_utils.create_sliding_window_causal_mask if self.sliding else masking_utils.create_causal_mask
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = make(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask, position_ids=positions,
                    **{_cache_kwarg(): None})
        kwargs = {"attention_mask": mask, **self.extra}
        if self.takes_positions:
            kwargs["position_ids"] = positions
        if self.rotary_emb is not None:
            kwargs["position_embeddings"] = self.rotary_emb(hidden, position_ids=positions)
        out = self.block(hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out


# kept under its old name: the built-in GPT-2's blocks
GPT2Layer = DecoderBlock


class FirstOutput(nn.Module):
    """Runs a Hugging Face block and keeps its hidden states: some versions return tuples."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.block(hidden)
        return out[0] if isinstance(out, tuple) else out


class EncoderBlock(nn.Module):
    """One encoder layer given a padding mask, made as ``BertModel`` makes it
    (``create_bidirectional_mask``)."""

    def __init__(self, block: nn.Module, config):
        super().__init__()
        self.block = block
        self.config = config

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        out = self.block(hidden, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out


# -- the attention mask, carried as one extra feature channel --------------------------------------
# A layer takes one tensor, so a model cut with attention_mask=True takes inputs of shape
# (batch, 2, seq) (token ids, then the 0/1 mask) and every activation up to the final norm carries
# the mask as its last feature (0.0 or 1.0, exact in any float type); its gradient is zero.

class SplitInput(nn.Module):
    """The first layer: splits ``(batch, 2, seq)`` into ids and mask, appends the mask to its output."""

    def __init__(self, layer: nn.Module, takes_mask: bool):
        super().__init__()
        self.layer = layer
        self.takes_mask = takes_mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, mask = x[:, 0], x[:, 1]
        h = self.layer(ids, mask) if self.takes_mask else self.layer(ids)
        return torch.cat([h, mask.unsqueeze(-1).to(h.dtype)], dim=-1)


class CarryMask(nn.Module):
    """A block given the mask from the last feature of its input, which it passes on."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, mask = x[..., :-1], x[..., -1:]
        return torch.cat([self.layer(h, mask.squeeze(-1).to(torch.long)), mask], dim=-1)


class DropMask(nn.Module):
    """The first layer after the blocks: runs on the hidden states without the mask feature."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x[..., :-1])


def _with_mask(layers: list[nn.Module], blocks: int, config, encoder: bool) -> list[nn.Module]:
    """The cut ``[embedding, *blocks, after, ...]`` rewired to carry the attention mask."""
    first = layers[0]
    body = [CarryMask(EncoderBlock(b.block, config) if encoder else b) for b in layers[1:1 + blocks]]
    return [SplitInput(first, takes_mask=not encoder), *body, DropMask(layers[1 + blocks]), *layers[2 + blocks:]]


class LogitHead(nn.Module):
    """The LM head with what the causal LM's own forward does to its logits after it: a scale
    (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``), then a soft cap (Gemma 2's and 3's
    ``final_logit_softcapping``)."""

    def __init__(self, head: nn.Module, scale: float = 1.0, softcap: float | None = None):
        super().__init__()
        self.head = head
        self.scale = scale
        self.softcap = softcap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class CausalLMLoss(nn.Module):
    """Next-token cross entropy as a causal LM computes it from ``labels``: shifted inside, ``-100``
    ignored, mean over the predicted tokens (with every token labelled, also the mean over samples)."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shifted = logits[:, :-1, :].float()
        return nn.functional.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), labels[:, 1:].reshape(-1))


class TokenLoss(nn.Module):
    """Masked-LM cross entropy over every labelled token (``-100`` ignored), as ``BertForMaskedLM``."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


# -- the cut -------------------------------------------------------------------------------------

def _task(hf_model: nn.Module) -> str:
    name = type(hf_model).__name__
    for suffix, task in (("ForCausalLM", "causal"), ("LMHeadModel", "causal"), ("ForMaskedLM", "masked"),
                         ("ForSequenceClassification", "classify")):
        if name.endswith(suffix):
            return task
    raise UnsupportedModelError(f"{name} is not a Hugging Face causal LM, masked LM or sequence classifier "
                                f"(class name ending ForCausalLM, LMHeadModel, ForMaskedLM or "
                                f"ForSequenceClassification)")


def _blocks(base: nn.Module, what: str) -> tuple[nn.Module, str, nn.ModuleList]:
    """The module holding the block list, the list's attribute name, and the list: the outermost
    ``nn.ModuleList`` in the base model with ``num_hidden_layers`` entries."""
    want = getattr(base.config, "num_hidden_layers", None)
    if isinstance(want, int) and want < 1:
        raise UsageError(f"{what}: config.num_hidden_layers is {want}; the cut needs at least one block")
    found = [(name, m) for name, m in base.named_modules() if isinstance(m, nn.ModuleList) and len(m) == want]
    if not found:
        raise UnsupportedModelError(f"{what}: no list of {want} blocks (config.num_hidden_layers) found in "
                                    f"{type(base).__name__}")
    name, blocks = min(found, key=lambda f: f[0].count("."))
    parent_name, _, attr = name.rpartition(".")
    return base.get_submodule(parent_name) if parent_name else base, attr, blocks


def _shell(container: nn.Module, blocks_attr: str, after: list[str]) -> nn.Module:
    """A shallow copy of ``container`` with no blocks and identities for the modules after them."""
    shell = object.__new__(type(container))
    shell.__dict__ = dict(container.__dict__)
    shell._modules = dict(container._modules)
    shell._parameters = dict(container._parameters)
    shell._buffers = dict(container._buffers)
    shell._modules[blocks_attr] = nn.ModuleList()
    for name in after:
        shell._modules[name] = nn.Identity() if name != "project_out" else None
    return shell


def _decoder_layers(hf_model: nn.Module, what: str) -> list[nn.Module]:
    base = hf_model.base_model
    container, attr, blocks = _blocks(base, what)
    head = getattr(hf_model, "lm_head", None)
    if not isinstance(head, nn.Module):
        raise UnsupportedModelError(f"{what}: no lm_head module found")
    after = [n for n in _AFTER_BLOCKS if container._modules.get(n) is not None]
    if not any(n != "project_out" for n in after):
        raise UnsupportedModelError(f"{what}: no final norm found beside the blocks (looked for "
                                    f"{', '.join(_AFTER_BLOCKS[:-1])})")
    config = hf_model.config
    types = getattr(config, "layer_types", None)
    rotary = container._modules.get("rotary_emb")
    missing = _inputs_not_given(blocks[0], rotary is not None)
    # Falcon's blocks take an ``alibi`` argument, None where its config turns ALiBi off (Bloom's always use it)
    extra = {"alibi": None} if "alibi" in missing and getattr(config, "alibi", True) is False else {}
    needs = [n for n in missing if n not in extra]
    if needs:       # an ALiBi bias, say, which only the base model's forward computes
        raise UnsupportedModelError(f"{what} is not supported: its blocks ({type(blocks[0]).__name__}) need "
                                    f"{', '.join(needs)} from the base model, and the cut passes a block only the "
                                    f"causal mask, the position ids and the rotary embeddings")
    wrapped = []
    for i, block in enumerate(blocks):
        sliding = (types[i] == "sliding_attention") if types else getattr(config, "sliding_window", None) is not None
        wrapped.append(DecoderBlock(block, config, sliding, rotary, extra))
    final = [container._modules[n] for n in after]
    scale = getattr(hf_model, "logit_scale", None)          # Cohere's, a number
    scale = float(scale) if isinstance(scale, (int, float)) else 1.0
    scale /= float(getattr(config, "logits_scaling", None) or 1.0)     # Granite's
    softcap = getattr(config, "final_logit_softcapping", None)        # Gemma 2's and 3's
    if scale != 1.0 or softcap is not None:
        head = LogitHead(head, scale, softcap)
    return [Embedding(container, attr, after), *wrapped,
            final[0] if len(final) == 1 else nn.Sequential(*final), head, CausalLMLoss()]


def _inputs_not_given(block: nn.Module, rotary: bool) -> list[str]:
    """The arguments a decoder block's ``forward`` requires beside the hidden states that
    DecoderBlock does not pass it."""
    given = {"attention_mask", "position_ids"} | ({"position_embeddings"} if rotary else set())
    params = list(inspect.signature(block.forward).parameters.values())[1:]
    return [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in given
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _encoder_layers(hf_model: nn.Module, task: str, what: str) -> list[nn.Module]:
    base = hf_model.base_model
    embeddings, encoder = getattr(base, "embeddings", None), getattr(base, "encoder", None)
    if not isinstance(embeddings, nn.Module) or not isinstance(getattr(encoder, "layer", None), nn.ModuleList):
        raise UnsupportedModelError(f"{what}: no embeddings and encoder.layer found in {type(base).__name__}")
    project = base._modules.get("embeddings_project")      # ELECTRA's, where its embeddings are narrower
    body = [embeddings if project is None else nn.Sequential(embeddings, project),
            *(FirstOutput(layer) for layer in encoder.layer)]
    if task == "masked":
        # BERT's cls, RoBERTa's lm_head, ELECTRA's generator_predictions then generator_lm_head
        found = [m for m in (hf_model._modules.get(n) for n in ("cls", "lm_head")) if m is not None]
        if not found and hf_model._modules.get("generator_lm_head") is not None:
            found = [nn.Sequential(hf_model.generator_predictions, hf_model.generator_lm_head)]
        if not found:
            raise UnsupportedModelError(f"{what}: no MLM head (cls, lm_head or generator_lm_head) found")
        return [*body, found[0], TokenLoss()]
    classifier, pooler = getattr(hf_model, "classifier", None), getattr(base, "pooler", None)
    if not isinstance(classifier, nn.Module) or not isinstance(pooler, (nn.Module, type(None))):
        raise UnsupportedModelError(f"{what}: the classification head needs a classifier, after a pooler or "
                                    f"reading the first token itself; found pooler={type(pooler).__name__}, "
                                    f"classifier={type(classifier).__name__}")
    config = hf_model.config
    if getattr(config, "problem_type", None) not in (None, "single_label_classification") or config.num_labels < 2:
        raise UnsupportedModelError(f"{what}: only single-label classification (num_labels >= 2) is supported")
    if pooler is None:          # RoBERTa's, ELECTRA's classifier reads the first token itself
        return [*body, classifier, ClassificationLoss()]
    dropout = getattr(hf_model, "dropout", None) or nn.Identity()
    return [*body, pooler, nn.Sequential(dropout, classifier), ClassificationLoss()]


def hf_layers(hf_model: nn.Module, *, attention_mask: bool = False) -> list[nn.Module]:
    """The layers of a Hugging Face model (the cut of :func:`decompose_hf`), loss last; with
    ``attention_mask``, rewired to carry the mask from ``(batch, 2, seq)`` inputs."""
    if not isinstance(hf_model, nn.Module) or not hasattr(hf_model, "config") or not hasattr(hf_model, "base_model"):
        raise UnsupportedModelError(f"expected a Hugging Face PreTrainedModel, got {type(hf_model).__name__}")
    task, what = _task(hf_model), type(hf_model).__name__
    if hf_model.base_model is hf_model:
        raise UnsupportedModelError(f"{what}: a bare base model has no head; pass the model with its head")
    layers = _decoder_layers(hf_model, what) if task == "causal" else _encoder_layers(hf_model, task, what)
    if attention_mask:
        layers = _with_mask(layers, hf_model.config.num_hidden_layers, hf_model.config, task != "causal")
    return layers


def decompose_hf(hf_model: nn.Module, *, example: tuple[torch.Tensor, torch.Tensor] | None = None,
                 sequence_length: int | None = None, attention_mask: bool = False,
                 name: str | None = None) -> LayeredModel:
    """A Hugging Face causal LM, masked LM or sequence classifier as a :class:`LayeredModel`.

    Targets are what the model takes as ``labels`` (a causal LM shifts them inside the loss), so a
    step equals ``hf_model(input_ids=x, labels=y).loss``. ``example`` (``(input_ids, labels)``), when
    given, is run through both and the losses must agree; its length sets the synthetic batches'
    ``sequence_length`` (otherwise the model's maximum positions, at most 128). ``make_batch`` draws
    random token ids with every token labelled (a causal or masked LM) or random class labels.

    With ``attention_mask=True`` the inputs are ``torch.stack([input_ids, attention_mask], 1)``
    (shape ``(batch, 2, seq)``) and a step equals ``hf_model(input_ids=..., attention_mask=...,
    labels=y).loss``: padded text can be fine-tuned. The mask reaches every block as one extra
    feature of the activations; ``make_batch`` then gives a mask of ones.
    """
    layers = hf_layers(hf_model, attention_mask=attention_mask)
    config = hf_model.config
    task = _task(hf_model)
    if example is not None:
        _check_example(hf_model, layers, example)
        sequence_length = sequence_length or example[0].shape[-1]
    if sequence_length is None:
        limit = next((getattr(config, k) for k in ("max_position_embeddings", "n_positions")
                      if getattr(config, k, None)), 128)
        # RoBERTa's positions count from its padding index on: max_position_embeddings - pad - 1 tokens
        pad = getattr(getattr(hf_model.base_model, "embeddings", None), "padding_idx", None)
        sequence_length = min(int(limit) - (pad + 1 if isinstance(pad, int) else 0), 128)
    labels = config.num_labels if task == "classify" else None
    make = functools.partial(_token_batch, config.vocab_size, sequence_length, labels, attention_mask)
    meta = {"sequence_length": sequence_length, "optimizer": "adam", "family": config.model_type,
            "description": f"{type(hf_model).__name__} ({config.model_type}), {len(layers)} layers",
            "dtype": str(next(hf_model.parameters()).dtype).removeprefix("torch.")}
    return LayeredModel(name or config.model_type, layers, make, meta, source=hf_model)


#: The weight files of a Hugging Face model folder (one file, or shards with an index)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def load_hf_directory(path: str | Path, *, seed: int = 0, trust_remote_code: bool = False,
                      **config_overrides) -> LayeredModel:
    """A Hugging Face model folder as a :class:`LayeredModel` (:func:`decompose_hf`): its
    ``config.json`` (``config_overrides``, e.g. ``num_hidden_layers=2``, replace fields of it), and its
    weights where the folder has them, else a random initialisation seeded by ``seed``. The class
    comes from the config's ``architectures`` (a causal LM, masked LM or sequence classifier). The
    folder is data: code in it runs only with ``trust_remote_code=True``, and ``.bin`` weights load
    as transformers loads them (``weights_only``)."""
    path = Path(path)
    where = f"--model {path}"
    if not (path / "config.json").is_file():
        raise UsageError(f"{where}: no config.json in this folder; give a Hugging Face model folder "
                         f"(save_pretrained writes one), a built-in name or path/to/file.py:function")
    try:
        import transformers
    except ImportError:
        raise UsageError(f"{where}: a Hugging Face folder needs transformers: pip install 'harmony-opt[hf]'") from None
    try:
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code,
                                                         **config_overrides)
    except Exception as e:      # a broken config.json, remote code refused, an unknown model type
        raise UsageError(f"{where}: config.json: {first_line(e)}") from None
    unknown = [k for k in config_overrides if not hasattr(config, k)]
    if unknown:
        raise UsageError(f"{where}: --set {unknown[0]}: not a field of its config ({type(config).__name__})")
    blocks = getattr(config, "num_hidden_layers", None)
    if isinstance(blocks, int) and blocks < 1:
        raise UsageError(f"{where}: num_hidden_layers is {blocks} (config.json or --set); give at least 1")
    arch = next(iter(getattr(config, "architectures", None) or []), "")
    auto = next((getattr(transformers, cls) for ends, cls in _AUTO if arch.endswith(ends)), None)
    if auto is None:
        raise UnsupportedModelError(f"{where}: architecture {arch or '(none named)'} is not a causal LM, masked "
                                    f"LM or sequence classifier (config.json 'architectures')")
    weights = any((path / f).is_file() for f in WEIGHT_FILES)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if weights:
                hf = auto.from_pretrained(path, config=config, trust_remote_code=trust_remote_code)
            else:
                hf = auto.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise UsageError(f"{where}: {'loading its weights' if weights else 'building it'}: {first_line(e)}") from None
    model = decompose_hf(hf, name=path.resolve().name)
    # the generic cut must compute what the model computes: checked on a short batch, dropout off
    training = hf.training
    hf.eval()
    try:
        labels = config.num_labels if _task(hf) == "classify" else None
        _check_example(hf, list(model.layers), _token_batch(config.vocab_size, 8, labels, False, 2,
                                                             torch.Generator().manual_seed(seed)), where)
    finally:
        hf.train(training)
    model.meta.update(hf_directory=str(path.resolve()), hf_weights=weights)
    return model


_AUTO = (("ForCausalLM", "AutoModelForCausalLM"), ("LMHeadModel", "AutoModelForCausalLM"),
         ("ForMaskedLM", "AutoModelForMaskedLM"), ("ForSequenceClassification", "AutoModelForSequenceClassification"))


def _token_batch(vocab: int, seq: int, num_labels: int | None, masked: bool, batch: int, gen: torch.Generator):
    """Random token ids (with a mask of ones when ``masked``); targets are the ids themselves (language
    models) or class labels."""
    ids = torch.randint(vocab, (batch, seq), generator=gen)
    labels = ids.clone() if num_labels is None else torch.randint(num_labels, (batch,), generator=gen)
    return (torch.stack([ids, torch.ones_like(ids)], 1) if masked else ids), labels


def _check_example(hf_model: nn.Module, layers: list[nn.Module], example, where: str | None = None) -> None:
    """The layers' loss on ``example`` is the model's own, to within its precision's rounding."""
    x, y = example
    given = {"input_ids": x[:, 0], "attention_mask": x[:, 1]} if x.dim() == 3 else {"input_ids": x}
    what = f"{where + ': ' if where else ''}{type(hf_model).__name__}"
    with torch.no_grad():
        try:
            want = hf_model(**given, labels=y).loss
        except Exception as e:      # the model itself fails: its config, not the cut
            raise UsageError(f"{what}: the model's own forward fails on a batch of {tuple(x.shape)} tokens: "
                             f"{first_line(e)}") from None
        try:
            got = run_layers(layers, x, y)
        except Exception as e:
            raise UnsupportedModelError(f"{what}: the model runs but its layers fail: {first_line(e)}") from None
    dtype = next(hf_model.parameters()).dtype
    rtol = max(1e-4, 16 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-4
    if not torch.allclose(want.float(), got.float(), rtol=rtol, atol=1e-5):
        raise UnsupportedModelError(f"{where + ': ' if where else ''}the layers of {type(hf_model).__name__} give "
                                    f"loss {float(got):.6g} on the example but the model gives {float(want):.6g}: "
                                    f"its forward does something the generic cut does not"
                                    + ("" if where else " (is dropout off, with model.eval()?)"))


# -- the built-in models' cuts (models.py) ----------------------------------------------------------

def decompose_gpt2(hf_model: nn.Module) -> list[nn.Module]:
    """Layers of a ``GPT2LMHeadModel``: embeddings, each block, final norm, LM head, loss (``n_layer + 4``,
    as in Harmony's GPT-2 profiles). A head tied to the token embedding stays tied."""
    if not (hasattr(hf_model, "transformer") and hasattr(hf_model, "lm_head")):
        raise UsageError(f"expected a Hugging Face GPT2LMHeadModel (with transformer, lm_head), "
                         f"got {type(hf_model).__name__}")
    return hf_layers(hf_model)


def decompose_bert(hf_model: nn.Module) -> list[nn.Module]:
    """Layers of a ``BertForSequenceClassification``: embeddings, each encoder layer, pooler, head, loss
    (``num_hidden_layers + 4``, the cut of Harmony's BERT profiles). No attention mask: every token
    attends to every token, as ``BertModel`` does when given no mask."""
    if not (hasattr(hf_model, "bert") and hasattr(hf_model, "classifier")):
        raise UsageError(f"expected a Hugging Face BertForSequenceClassification (with bert, classifier), "
                         f"got {type(hf_model).__name__}")
    if hf_model.bert.pooler is None:
        raise UsageError("the BERT model has no pooler (add_pooling_layer=False); the classification "
                         "head needs the pooled output")
    return hf_layers(hf_model)
