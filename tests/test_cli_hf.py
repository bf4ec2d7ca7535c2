"""A Hugging Face model folder on the command line (`--model DIR`): profiled, planned and trained on a
data file, and written back with `run --save` in save_pretrained form, equal to plain Hugging Face
training; its bad inputs are one line with exit code 2. The folder is data: no remote code."""
from __future__ import annotations

import json

import pytest
import torch

from harmony_opt.cli import main

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, BATCH, SEQ = 3, 4, 12


def _tiny_gpt2(folder, weights: bool):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    hf = transformers.GPT2LMHeadModel(config)
    if weights:
        hf.save_pretrained(folder)
    else:
        config.architectures = ["GPT2LMHeadModel"]
        config.save_pretrained(folder)
    return hf


def _plan(tmp_path, num_layers: int):
    plan = {"version": 1, "planner": "manual", "mode": "vPP", "gpus": 1, "batch": BATCH,
            "microbatch": {"fwd": 2, "bwd": 2},
            "packs": {"fwd": [[0, 1]], "bwd": [[0, 1], [2, num_layers - 1]]}, "num_layers": num_layers,
            "memory_cap": 10**9, "profile": {"name": "hf"}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    return str(tmp_path / "plan.json")


def test_a_hugging_face_folder_trains_on_a_data_file_and_saves_like_plain_training(tmp_path, capsys):
    hf = _tiny_gpt2(tmp_path / "gpt2", weights=True)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(64, (STEPS * BATCH + 2, SEQ), generator=gen)       # the last 2 samples: dropped
    torch.save({"inputs": ids, "targets": ids.clone()}, tmp_path / "data.pt")
    assert main(["profile", str(tmp_path / "gpt2"), "--device", "cpu", "-u", "1,2", "--repeats", "1",
                 "--warmup", "0", "--no-progress", "-o", str(tmp_path / "prof")]) == 0
    out = capsys.readouterr().out
    num_layers = int(out.split(" layers")[0].rsplit(" ", 1)[-1])      # "wrote DIR: gpt2, 6 layers, ..."
    plan = _plan(tmp_path, num_layers)
    assert main(["run", plan, "--model", str(tmp_path / "gpt2"), "--data", str(tmp_path / "data.pt"),
                 "--optimizer", "sgd", "--lr", "0.1", "--no-progress", "--save", str(tmp_path / "out")]) == 0
    opt = torch.optim.SGD(hf.parameters(), lr=0.1)
    for s in range(STEPS):
        x = ids[s * BATCH:(s + 1) * BATCH]
        opt.zero_grad()
        hf(input_ids=x, labels=x).loss.backward()
        opt.step()
    saved = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    assert saved.lm_head.weight is saved.transformer.wte.weight          # still tied, and trained
    want = dict(hf.named_parameters())
    for name, p in saved.named_parameters():
        assert torch.allclose(p, want[name], rtol=1e-5, atol=1e-6), name


def test_a_config_only_folder_builds_a_seeded_random_model_and_set_changes_its_config(tmp_path, capsys):
    _tiny_gpt2(tmp_path / "cfg", weights=False)
    assert main(["profile", str(tmp_path / "cfg"), "--set", "n_layer=3", "--device", "cpu", "-u", "1",
                 "--repeats", "1", "--warmup", "0", "--no-progress", "-o", str(tmp_path / "prof")]) == 0
    assert ", 7 layers," in capsys.readouterr().out          # two more than the folder's two blocks give


@pytest.mark.parametrize("make, argv_tail, fragment", [
    (lambda d: d.mkdir(), [], "no config.json in this folder"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text("{not json")), [], "config.json:"),
    (lambda d: _tiny_gpt2(d, weights=False), ["--set", "no_such_field=1"], "not a field of its config"),
    (lambda d: _tiny_gpt2(d, weights=False), ["--set", "n_layer=0"], "num_hidden_layers is 0 (config.json or --set)"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "architectures": ["GPT2Model"]}))), [], "is not a causal LM"),
    # a config the model's own forward fails on (more key/value heads than heads): the config, not the cut
    (lambda d: (d.mkdir(), (d / "config.json").write_text(json.dumps(
        {"model_type": "stablelm", "architectures": ["StableLmForCausalLM"], "vocab_size": 64, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 8}))),
     [], "StableLmForCausalLM: the model's own forward fails on a batch of (2, 8) tokens: RuntimeError"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text(json.dumps(
        {"model_type": "bloom", "architectures": ["BloomForCausalLM"], "vocab_size": 64, "hidden_size": 32,
         "n_layer": 1, "n_head": 4}))), [], "BloomForCausalLM is not supported: its blocks (BloomBlock) need alibi"),
])
def test_bad_hugging_face_folders_are_one_line_with_exit_2(tmp_path, capsys, make, argv_tail, fragment):
    make(tmp_path / "m")
    argv = ["profile", str(tmp_path / "m"), *argv_tail, "--device", "cpu", "-u", "1", "--no-progress",
            "-o", str(tmp_path / "prof")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("harmony-opt: error: ") and err.count("\n") == 1 and fragment in err, err
    assert not (tmp_path / "prof").exists()
