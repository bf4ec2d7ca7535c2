"""Checkpoints: every layer's weights and buffers, the optimizer (and LR scheduler) state of every pack, the step.

One file, ``checkpoint.pt`` in the checkpoint folder, written atomically (temporary
file, fsync, rename: :mod:`harmony_opt.core.io`), so an interrupted run leaves the previous
checkpoint or the new one, never half of one. It records the identity of the plan and
the shapes of the model it belongs to; :func:`load_checkpoint` refuses one written for
another plan or model with a :class:`~harmony_opt.core.errors.DataError` before any step.

Nothing else needs saving for a resumed run to continue exactly like an uninterrupted
one: minibatches come from a generator seeded per step, dropout draws from a generator
seeded by (seed, step, layer, samples), and the CPU optimizer is deterministic.
"""
from __future__ import annotations

import io
from pathlib import Path

import torch
from torch import nn

from harmony_opt.core.errors import DataError, first_line
from harmony_opt.core.io import atomic_write_bytes

FORMAT = "harmony-opt-checkpoint"
VERSION = 1
FILENAME = "checkpoint.pt"


def model_signature(layers: list[nn.Module]) -> list[list[tuple[str, tuple[int, ...], str]]]:
    """Per layer, (name, shape, dtype) of every parameter and buffer."""
    return [[(n, tuple(t.shape), str(t.dtype)) for n, t in layer.state_dict().items()] for layer in layers]


def save_checkpoint(folder: str | Path, *, step: int, layers: list[nn.Module], optimizer: dict, losses: list[float],
                    plan_identity: str, plan: dict, seed: int, schedulers: dict | None = None) -> Path:
    """Write the checkpoint; ``schedulers`` (pack name -> LR scheduler state) where the run has one."""
    state = {
        "format": FORMAT, "version": VERSION, "step": step, "plan_identity": plan_identity, "plan": plan,
        "model": {"num_layers": len(layers), "signature": model_signature(layers)},
        "layers": [{k: v.detach().clone() for k, v in layer.state_dict().items()} for layer in layers],
        "optimizer": optimizer, "losses": list(losses), "seed": seed,
    }
    if schedulers is not None:
        state["schedulers"] = schedulers
    buf = io.BytesIO()
    torch.save(state, buf)
    return atomic_write_bytes(Path(folder) / FILENAME, buf.getvalue())


def load_checkpoint(folder: str | Path, *, plan_identity: str, layers: list[nn.Module]) -> dict:
    """Read and check a checkpoint; raise DataError if it belongs to another plan or model."""
    path = Path(folder) / FILENAME
    if not path.is_file():
        raise DataError(f"no checkpoint to resume from: {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise DataError(f"{path}: not a readable checkpoint ({first_line(e)})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("version") != VERSION:
        raise DataError(f"{path}: not a harmony-opt checkpoint of version {VERSION}")
    if state["plan_identity"] != plan_identity:
        raise DataError(f"{path} was written for another plan (identity {state['plan_identity']}, "
                        f"this plan is {plan_identity}); resume with the plan it was written for")
    sig = model_signature(layers)
    got = [[(n, tuple(s), d) for n, s, d in layer] for layer in state["model"]["signature"]]
    if len(got) != len(sig):
        raise DataError(f"{path} holds {len(got)} layers but the model has {len(sig)}")
    for l, (a, b) in enumerate(zip(got, sig)):
        if a != b:
            diff = next(((x, y) for x, y in zip(a, b) if x != y), (a[len(b):] or None, b[len(a):] or None))
            raise DataError(f"{path}: layer {l} does not match the model: checkpoint has {diff[0]}, "
                            f"model has {diff[1]}")
    return state


def restore_layers(layers: list[nn.Module], state: dict) -> None:
    """Copy the checkpoint's weights and buffers into the (host) layers, in place."""
    with torch.no_grad():
        for layer, sd in zip(layers, state["layers"]):
            own = layer.state_dict()
            for k, v in sd.items():
                own[k].copy_(v)
