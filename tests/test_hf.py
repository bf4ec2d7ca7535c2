"""Hugging Face models through decompose_hf and the executor train exactly like plain HF training.

The reference is ``model(input_ids=x, labels=y).loss`` with one optimizer over the model's parameters
(a tied head and embedding are one parameter there); the executor runs microbatches, packs, swaps and
per-pack optimizers, with a tied parameter's two gradients summed into one update. Only summation
order differs, so every parameter agrees within 1e-5 (relative Frobenius norm) in fp32.
"""
from __future__ import annotations

import copy
import functools
import json

import pytest
import torch

import harmony_opt
from harmony_opt.core.errors import ProgramError, UnsupportedModelError, UsageError
from harmony_opt.core.plan import PackOptions, Plan
from harmony_opt.measure.hf import decompose_hf
from harmony_opt.training import batch_seed

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 3
ADAM = functools.partial(torch.optim.Adam, lr=1e-3)


def _tiny(family: str):
    """A tiny random-init model of ``family``, dropout off, built from its config (never downloaded)."""
    import transformers as tf

    torch.manual_seed(0)
    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=64)
    if family == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32,
                                                bos_token_id=63, eos_token_id=63, resid_pdrop=0.0, embd_pdrop=0.0,
                                                attn_pdrop=0.0))
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**small, num_key_value_heads=2))
    if family == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**small, num_key_value_heads=2, sliding_window=8))
    if family == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**small, num_key_value_heads=2))
    if family == "opt":
        return tf.OPTForCausalLM(tf.OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                              num_attention_heads=4, max_position_embeddings=64,
                                              word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0,
                                              layerdrop=0.0, pad_token_id=1))
    if family == "phi":         # final_layernorm, partial rotary, parallel attention and MLP
        return tf.PhiForCausalLM(tf.PhiConfig(**small, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0))
    if family == "falcon":      # rotary, no ALiBi: its blocks take alibi=None
        return tf.FalconForCausalLM(tf.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=4, alibi=False, hidden_dropout=0.0,
                                                    attention_dropout=0.0, bos_token_id=1, eos_token_id=1))
    if family == "gemma2":      # scaled embedding, sliding and global layers alternating, soft-capped logits
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**small, num_key_value_heads=2, head_dim=8, sliding_window=8,
                                                    pad_token_id=0, final_logit_softcapping=0.5))
    if family == "cohere":      # logits scaled after the head
        return tf.CohereForCausalLM(tf.CohereConfig(**small, num_key_value_heads=4, logit_scale=0.25, pad_token_id=0,
                                                    bos_token_id=1, eos_token_id=2))
    if family == "gpt_neox":
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**small, hidden_dropout=0.0, attention_dropout=0.0,
                                                      bos_token_id=1, eos_token_id=1))
    bert = tf.BertConfig(**small, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    if family == "bert-mlm":
        return tf.BertForMaskedLM(bert)
    if family == "bert-cls":
        return tf.BertForSequenceClassification(bert)
    roberta = tf.RobertaConfig(**small, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
                               pad_token_id=1)
    if family == "roberta-mlm":     # lm_head; positions from the padding index on
        return tf.RobertaForMaskedLM(roberta)
    if family == "roberta-cls":     # no pooler: the classifier reads the first token
        return tf.RobertaForSequenceClassification(roberta)
    if family == "electra-mlm":     # embeddings narrower than the blocks, projected
        return tf.ElectraForMaskedLM(tf.ElectraConfig(**small, embedding_size=16, hidden_dropout_prob=0.0,
                                                      attention_probs_dropout_prob=0.0))
    raise KeyError(family)


def plan(mode: str, gpus: int, R: int, fwd, bwd, options=(), batch: int = 4, uf: int = 2, ub: int = 2) -> Plan:
    return Plan(planner="test", mode=mode, gpus=gpus, batch=batch, microbatch_fwd=uf, microbatch_bwd=ub,
                packs_fwd=fwd, packs_bwd=bwd, num_layers=R, options=options, allow_uneven=True)


def three_packs(R: int, mode: str = "vPP", gpus: int = 1, options=()) -> Plan:
    """Embedding + first block, the rest of the body, head + loss: in vPP over two ranks the first
    and the last backward pack (the tied embedding and head) are both updated on rank 0."""
    return plan(mode, gpus, R, [(0, 1), (2, R - 3)], [(0, 1), (2, R - 3), (R - 2, R - 1)], options)


def reference(hf, model, batch: int, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Plain Hugging Face training on the same minibatches: the model's own loss, one optimizer."""
    opt = ADAM(list(hf.parameters()))
    for s in range(steps):
        x, y = model.make_batch(batch, torch.Generator().manual_seed(batch_seed(0, s)))
        opt.zero_grad()
        hf(input_ids=x, labels=y).loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in hf.named_parameters()}


def layer_errors(model, hf, got: dict, want: dict) -> list[float]:
    """Relative Frobenius error of each layer's parameters (the measure of tests/test_executor.py:
    Adam turns round-off into full steps where a true gradient is zero, such as GPT-2's key bias,
    so single small tensors can differ more)."""
    names = {id(p): n for n, p in hf.named_parameters()}
    out = []
    for layer in model.layers:
        keys = [names[id(p)] for p in layer.parameters()]
        if keys:
            diff = torch.cat([(got[k] - want[k]).flatten() for k in keys])
            out.append(float(diff.norm() / torch.cat([want[k].flatten() for k in keys]).norm()))
    return out


def run(family: str, make_plan) -> tuple[float, float]:
    """Train a tiny ``family`` model with harmony_opt and with plain HF: the largest layer error, and
    how far plain training moved the weights (so that the check can fail)."""
    hf = _tiny(family)
    ours = copy.deepcopy(hf)
    model = decompose_hf(ours)
    p = make_plan(model.num_layers)
    initial = {n: t.detach().clone() for n, t in hf.named_parameters()}
    want = reference(hf, model, p.batch)
    harmony_opt.train(model, p, steps=STEPS, optimizer=ADAM, progress=False)
    got = {n: t.detach().clone() for n, t in ours.named_parameters()}
    return max(layer_errors(model, ours, got, want)), min(layer_errors(model, ours, initial, want))


# -- tied embeddings ------------------------------------------------------------------------------

def test_a_tied_gpt2_keeps_one_parameter_in_the_embedding_and_the_head():
    assert harmony_opt.decompose_hf is decompose_hf and "decompose_hf" in harmony_opt.__all__
    hf = _tiny("gpt2")
    model = harmony_opt.decompose_hf(hf)
    assert hf.config.tie_word_embeddings and hf.lm_head.weight is hf.transformer.wte.weight
    assert model.tied == [((0, "wte.weight"), (model.num_layers - 2, "weight"))]
    x = torch.randint(64, (2, 16))
    torch.testing.assert_close(model.loss(x, x), hf(input_ids=x, labels=x).loss)


TIED_PLANS = {
    "vpp-1rank": lambda R: three_packs(R),
    "vpp-1rank-kept-graph": lambda R: three_packs(R, options=(PackOptions(recompute=False),) * 3),
    "one-pack": lambda R: plan("vPP", 1, R, [], [(0, R - 1)]),
    "vpp-2ranks": lambda R: three_packs(R, "vPP", 2),
    "vdp-2ranks": lambda R: three_packs(R, "vDP", 2),
}


@pytest.mark.parametrize("name", list(TIED_PLANS))
def test_tied_gpt2_trains_like_plain_hugging_face(name):
    err, moved = run("gpt2", TIED_PLANS[name])
    assert moved > 1e-3                     # training moved every layer: the check can fail
    assert err < 1e-5, (name, err)


@pytest.mark.parametrize("name", ["vpp-1rank", "vpp-2ranks"])
def test_clipping_counts_a_tied_weights_summed_gradient_once(name):
    """clip_grad_norm on a tied GPT-2 clips as torch.nn.utils.clip_grad_norm_ does on the Hugging Face
    model, whose tied weight has one gradient, the sum of both uses: the norm must take the summed
    gradient (counting the copies apart, or one of them only, gives another norm)."""
    hf = _tiny("gpt2")
    ours = copy.deepcopy(hf)
    model = decompose_hf(ours)
    p = TIED_PLANS[name](model.num_layers)
    opt = ADAM(list(hf.parameters()))
    for s in range(STEPS):
        x, y = model.make_batch(p.batch, torch.Generator().manual_seed(batch_seed(0, s)))
        opt.zero_grad()
        hf(input_ids=x, labels=y).loss.backward()
        assert torch.nn.utils.clip_grad_norm_(hf.parameters(), 0.5) > 0.5      # clipping binds
        opt.step()
    want = {n: t.detach().clone() for n, t in hf.named_parameters()}
    harmony_opt.train(model, p, steps=STEPS, optimizer=ADAM, progress=False, clip_grad_norm=0.5)
    got = {n: t.detach().clone() for n, t in ours.named_parameters()}
    assert max(layer_errors(model, ours, got, want)) < 1e-5


def test_tied_layers_on_different_ranks_or_a_gpu_optimizer_are_refused_before_any_step():
    hf = _tiny("gpt2")
    model = decompose_hf(hf)
    R = model.num_layers
    before = hf.transformer.wte.weight.detach().clone()
    split = plan("vPP", 2, R, [(0, 2)], [(0, 2), (3, R - 1)])       # head on rank 1, embedding on rank 0
    with pytest.raises(ProgramError, match="updated on different ranks"):
        harmony_opt.train(model, split, steps=1, optimizer=ADAM, progress=False)
    gpu = three_packs(R, options=(PackOptions(optimizer="gpu"), PackOptions(), PackOptions()))
    with pytest.raises(ProgramError, match="optimizer 'cpu'"):
        harmony_opt.train(model, gpu, steps=1, optimizer=ADAM, progress=False)
    assert torch.equal(hf.transformer.wte.weight, before)


def test_a_tied_run_resumes_exactly(tmp_path):
    """The tied parameter's optimizer state is saved with its owner's pack and resumed there."""
    def fresh():
        hf = _tiny("gpt2")
        return hf, decompose_hf(hf)
    hf, model = fresh()
    p = three_packs(model.num_layers)
    full = harmony_opt.train(model, p, steps=STEPS, optimizer=ADAM, progress=False)
    harmony_opt.train(fresh()[1], p, steps=STEPS - 1, optimizer=ADAM, checkpoint_dir=tmp_path, progress=False)
    rest = harmony_opt.train(fresh()[1], p, steps=STEPS, optimizer=ADAM, checkpoint_dir=tmp_path, resume=True,
                             progress=False)
    assert rest.losses == full.losses
    assert all(torch.equal(a[k], b[k]) for a, b in zip(rest.weights, full.weights) for k in a)


# -- the generic path -----------------------------------------------------------------------------

FAMILIES = ["gpt2", "llama", "mistral", "qwen2", "opt", "phi", "falcon", "gemma2", "cohere", "gpt_neox", "bert-mlm", "bert-cls",
            "roberta-mlm", "roberta-cls", "electra-mlm"]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_reproduces_the_models_loss_and_trains_like_it(family):
    hf = _tiny(family)
    model = decompose_hf(hf, example=_tiny_example(hf, family))
    three = family.endswith("-mlm") or family == "roberta-cls"      # no pooler or final norm
    assert model.num_layers == hf.config.num_hidden_layers + (3 if three else 4)
    err, moved = run(family, three_packs)
    assert moved > 1e-3
    assert err < 1e-5, (family, err)


def _tiny_example(hf, family):
    x = torch.randint(hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    return x, (torch.tensor([0, 2]) if family.endswith("-cls") else x.clone())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["vPP", "vDP"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt2"])    # gpt2: TIED_PLANS above
def test_each_family_trains_like_plain_hugging_face_on_two_ranks(family, mode):
    err, moved = run(family, lambda R: three_packs(R, mode, 2))
    assert moved > 1e-3 and err < 1e-5, (family, mode, err)


def test_unsupported_models_are_refused_naming_what_is_missing():
    import transformers as tf

    with pytest.raises(UnsupportedModelError, match="PreTrainedModel"):
        decompose_hf(torch.nn.Linear(2, 2))
    with pytest.raises(UnsupportedModelError, match="ForCausalLM"):
        decompose_hf(tf.LlamaModel(tf.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                  num_attention_heads=4, intermediate_size=64)))
    t5 = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=4,
                                                   d_kv=8))
    with pytest.raises(UnsupportedModelError, match="T5ForConditionalGeneration"):
        decompose_hf(t5)
    bloom = tf.BloomForCausalLM(tf.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4))
    with pytest.raises(UnsupportedModelError, match=r"BloomForCausalLM is not supported: its blocks \(BloomBlock\) "
                                                    r"need alibi from the base model"):
        decompose_hf(bloom)
    assert issubclass(UnsupportedModelError, UsageError)


def test_a_folder_whose_model_the_cut_would_change_is_refused(tmp_path, monkeypatch):
    """A Hugging Face folder is checked on a short batch: where the layers' loss is not the model's
    (here Cohere's logit scale left out), loading it is refused, not trained as another model."""
    from harmony_opt.measure import hf as hf_module
    from harmony_opt.measure.hf import load_hf_directory

    _tiny("cohere").config.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["CohereForCausalLM"]}))
    assert load_hf_directory(tmp_path).num_layers == 2 + 4
    monkeypatch.setattr(hf_module.LogitHead, "forward", lambda self, h: self.head(h))
    with pytest.raises(UnsupportedModelError, match=rf"--model {tmp_path}: the layers of CohereForCausalLM give "
                                                    r"loss [\d.]+ on the example but the model gives [\d.]+"):
        load_hf_directory(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tied_gpt2_on_cuda_trains_like_plain_hugging_face(monkeypatch):
    """The CUDA path: the owner's update waits for the head's dW swap-out event before summing."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    hf = _tiny("gpt2")
    ours = copy.deepcopy(hf)
    model = decompose_hf(ours)
    p = three_packs(model.num_layers)
    want = reference(hf, model, p.batch)
    harmony_opt.train(model, p, steps=STEPS, optimizer=ADAM, progress=False, device="cuda")
    got = {n: t.detach().clone() for n, t in ours.named_parameters()}
    assert max(layer_errors(model, ours, got, want)) < 1e-4


# -- padded text: the attention mask --------------------------------------------------------------

def padded_batches(hf, family: str, batch: int = 4, seq: int = 16, pad: int = 4, steps: int = STEPS):
    """Minibatches of ``torch.stack([ids, mask], 1)`` and labels: even samples right-padded, odd ones
    left-padded, ``pad`` pads each, pads labelled -100. Every sample has as many labelled tokens (a
    causal LM's first real token of a left-padded sample is unlabelled too), so each microbatch's
    mean weighted by its samples is the minibatch's mean over tokens, as the model computes it."""
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        ids = torch.randint(hf.config.vocab_size, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[0::2, seq - pad:] = 0
        mask[1::2, :pad] = 0
        labels = ids.masked_fill(mask == 0, -100)
        if not family.endswith(("-mlm", "-cls")):      # a causal LM: its first real token is not predicted
            labels[1::2, pad] = -100
        if family.endswith("-cls"):
            labels = torch.randint(hf.config.num_labels, (batch,), generator=g)
        out.append((torch.stack([ids, mask], 1), labels))
    return out


def padded_reference(hf, data, masked: bool) -> dict[str, torch.Tensor]:
    opt = ADAM(list(hf.parameters()))
    for x, y in data:
        opt.zero_grad()
        hf(input_ids=x[:, 0], attention_mask=x[:, 1] if masked else None, labels=y).loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in hf.named_parameters()}


@pytest.mark.parametrize("family, mode, gpus", [*((f, "vPP", 1) for f in FAMILIES), ("gpt2", "vDP", 2)])
def test_padded_text_trains_like_hugging_face_given_the_attention_mask(family, mode, gpus):
    hf = _tiny(family)
    ours = copy.deepcopy(hf)
    data = padded_batches(hf, family)
    model = decompose_hf(ours, attention_mask=True, example=data[0])
    want = padded_reference(hf, data, masked=True)
    unmasked = padded_reference(_tiny(family), data, masked=False)
    assert max(layer_errors(model, ours, unmasked, want)) > 1e-4      # the mask matters: the check can fail
    harmony_opt.train(model, three_packs(model.num_layers, mode, gpus), data, steps=STEPS, optimizer=ADAM,
                      progress=False)
    got = {n: t.detach().clone() for n, t in ours.named_parameters()}
    assert max(layer_errors(model, ours, got, want)) < 1e-5


def test_a_masked_cut_takes_ids_and_mask_and_makes_batches_of_ones():
    hf = _tiny("llama")
    model = decompose_hf(hf, attention_mask=True)
    x, y = model.make_batch(2, torch.Generator().manual_seed(0))
    assert x.shape == (2, 2, 64) and torch.equal(x[:, 1], torch.ones(2, 64, dtype=torch.long))
    torch.testing.assert_close(model.loss(x, y), hf(input_ids=x[:, 0], labels=y).loss)
