"""Analytic profiles of GPT-2-shaped models, calibrated on a measured GPT-2 profile.

Why: the paper's scaling claims (GPT-2 with 10B to 40B parameters on one server) and our
own (up to 100B, 500+ layers) need profiles of models that no machine here can run. We
build them from layer shapes and a cost model fitted to what was measured:

* bytes are exact from the shapes (fp32): the embedding holds ``(vocab + positions) x h``
  weights, a block ``12 h^2 + 13 h``, the final layer norm ``2 h``, the LM head ``vocab x h``;
  each block has a ``positions^2`` causal-mask buffer; Adam keeps ``2 x W`` of state;
* time is a FLOP-rate model: for each layer kind (embedding, block, final norm, head,
  loss) and each profiled microbatch size ``u``, the reference's measured time divided by
  the kind's FLOPs gives an achieved rate (so small-``u`` inefficiency is kept); a
  block does ``24 s h^2 + 4 s^2 h`` FLOPs per sample forward (matmuls of QKV, projection,
  MLP, and attention scores), the head ``2 s h V``; backward (recompute + backward)
  scales by the same ratio as forward;
* activation memory (peak minus the weights, buffers and, for backward, gradients the
  layer holds) is the reference's, scaled by the activation size of the kind: for a
  block ``s h (34 + 5 a s / h)`` (Korthikanti et al., "Reducing Activation Recomputation
  in Large Transformer Models", 2022), for the others the bytes of their input and output;
* the CPU optimizer step time is linear in parameter bytes, at the reference's rate.

The result is a normal :class:`~harmony_opt.core.profile.Profile` (same tables, same
microbatch sizes as the reference), with ``meta["synthetic"]`` saying how it was made.
Usage::

    from harmony_opt.measure.synthetic import GPT2_SCALING, gpt2_profile
    prof = gpt2_profile(GPT2_SCALING["gpt2_100b"])     # 504 layers
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from ..core.bundled import load_profile
from ..core.errors import ProfileError
from ..core.profile import Profile

FP32 = 4        # bytes per parameter and activation element
TOKEN_ID = 8    # bytes per input token id (int64)
KINDS = ("embed", "block", "ln_f", "head", "loss")


@dataclasses.dataclass(frozen=True)
class GPT2Shape:
    """Hugging Face GPT-2 hyper-parameters; ``n_layer + 4`` vLayers (embedding, blocks, ln_f, head, loss)."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab: int = 50257
    seq: int = 1024          # sequence length of a sample (= n_positions)

    def __post_init__(self):
        for f in ("n_layer", "n_embd", "n_head", "vocab", "seq"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ProfileError(f"GPT2Shape.{f} must be a whole number >= 1, got {getattr(self, f)!r}")

    @property
    def num_layers(self) -> int:
        return self.n_layer + 4

    def kinds(self) -> list[str]:
        return ["embed"] + ["block"] * self.n_layer + ["ln_f", "head", "loss"]

    def param_elems(self, kind: str) -> int:
        h, V, s = self.n_embd, self.vocab, self.seq
        return {"embed": (V + s) * h, "block": 12 * h * h + 13 * h, "ln_f": 2 * h, "head": V * h, "loss": 0}[kind]

    def buffer_bytes(self, kind: str) -> int:
        return self.seq * self.seq * FP32 if kind == "block" else 0

    def flops(self, kind: str) -> float:
        """Forward FLOPs per sample (memory-bound kinds: elements touched)."""
        h, V, s = self.n_embd, self.vocab, self.seq
        return {"embed": s * h, "block": 24 * s * h * h + 4 * s * s * h, "ln_f": s * h,
                "head": 2 * s * h * V, "loss": s * V}[kind]

    def activation(self, kind: str) -> float:
        """Activation size per sample, up to a constant (what scales the measured activation memory)."""
        h, V, s, a = self.n_embd, self.vocab, self.seq, self.n_head
        return {"embed": s * h, "block": s * h * (34 + 5 * a * s / h), "ln_f": s * h, "head": s * (h + V),
                "loss": s * V}[kind]

    def input_bytes(self, kind: str) -> int:
        """Bytes of a layer's input for one sample (the previous layer's output)."""
        return {"embed": self.seq * TOKEN_ID, "loss": self.seq * self.vocab * FP32}.get(kind, self.seq * self.n_embd * FP32)

    def parameters(self) -> int:
        return sum(self.param_elems(k) for k in self.kinds())


#: The paper's GPT-2 XL and the scaling series (10B to 100B: n_embd 4096, 32 heads, 50 to 500 blocks).
GPT2_XL = GPT2Shape(n_layer=48, n_embd=1600, n_head=25)
GPT2_SCALING = {f"gpt2_{10 * k}b": GPT2Shape(n_layer=50 * k, n_embd=4096, n_head=32) for k in range(1, 11)}


def _reference_rows(ref: Profile, shape: GPT2Shape) -> dict[str, list[int]]:
    """Layer indices of each kind in the reference (blocks: all of them, their mean is used)."""
    if ref.num_layers != shape.num_layers:
        raise ProfileError(f"{ref.name} has {ref.num_layers} layers but its shape {shape} implies "
                           f"{shape.num_layers}; pass the reference's own shape")
    R = ref.num_layers
    return {"embed": [0], "block": list(range(1, R - 3)), "ln_f": [R - 3], "head": [R - 2], "loss": [R - 1]}


def gpt2_profile(shape: GPT2Shape, reference: Profile | str = "gpt2_xl", reference_shape: GPT2Shape = GPT2_XL,
                 name: str | None = None) -> Profile:
    """A Profile of ``shape``, scaled from the measured ``reference`` (module docstring)."""
    ref = load_profile(reference)
    rows = _reference_rows(ref, reference_shape)
    kinds = shape.kinds()
    R = shape.num_layers
    w = np.array([shape.param_elems(k) * FP32 for k in kinds], dtype=np.int64)
    buf = np.array([shape.buffer_bytes(k) for k in kinds], dtype=np.int64)
    ref_w = {k: reference_shape.param_elems(k) * FP32 for k in KINDS}
    ref_buf = {k: reference_shape.buffer_bytes(k) for k in KINDS}
    ref_lay = ref.layers.sort_values("layer")
    ref_rate = float(ref_lay.cpu_update_s.sum()) / max(float(ref_lay.param_bytes.sum()), 1.0)   # s per byte
    layers = pd.DataFrame({"layer": np.arange(R), "param_bytes": w, "buffer_bytes": buf,
                           "optimizer_state_bytes": 2 * w, "cpu_update_s": w * ref_rate})
    kind_idx = {k: np.array([i for i, x in enumerate(kinds) if x == k]) for k in KINDS}
    t_ratio = {k: shape.flops(k) / reference_shape.flops(k) for k in KINDS}
    a_ratio = {k: shape.activation(k) / reference_shape.activation(k) for k in KINDS}
    x_per_sample = np.array([shape.input_bytes(k) for k in kinds], dtype=np.int64)
    parts = []
    for phase in ("FWD", "BWD"):
        grads = 1 if phase == "BWD" else 0        # the backward also holds dW
        for u in ref.sizes(phase):
            u = int(u)
            c = ref.costs(phase, u)
            time = np.empty(R)
            peak = np.empty(R, dtype=np.int64)
            for k in KINDS:
                idx = rows[k]
                t_ref = float(np.mean(c.time[idx]))
                act_ref = max(float(np.mean(c.memory[idx])) - ref_w[k] * (1 + grads) - ref_buf[k], 0.0)
                sel = kind_idx[k]
                time[sel] = t_ref * t_ratio[k]
                peak[sel] = (w[sel] * (1 + grads) + buf[sel] + int(act_ref * a_ratio[k])).astype(np.int64)
            parts.append(pd.DataFrame({"phase": phase, "microbatch": u, "layer": np.arange(R),
                                       "gpu_time_s": time, "peak_memory_bytes": peak,
                                       "input_bytes": x_per_sample * u}))
    micro = pd.concat(parts, ignore_index=True)
    name = name or f"gpt2_{shape.n_layer}x{shape.n_embd}"
    meta = {"model": name, "description": f"GPT-2 n_layer {shape.n_layer}, n_embd {shape.n_embd}, "
                                          f"n_head {shape.n_head}, seq {shape.seq}: "
                                          f"{shape.parameters() / 1e9:.1f}B parameters",
            "dtype": "float32", "optimizer": "Adam", "sequence_length": shape.seq,
            "synthetic": {"builder": "harmony_opt.measure.synthetic.gpt2_profile", "calibrated_on": ref.name,
                          "shape": dataclasses.asdict(shape)}}
    return Profile(name, layers, micro, meta, source=f"<synthetic {name}>")
