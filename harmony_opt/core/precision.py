"""Training precision: ``fp32``, or ``bf16`` (mixed precision).

With ``bf16`` every forward (and a backward's recompute) runs under
``torch.autocast(device_type, dtype=torch.bfloat16)``: matmuls and convolutions compute in
bfloat16 from bf16 copies of the weights that autocast makes (and caches for as long as the
autocast region lasts), ops that autocast keeps in fp32 (softmax, layer norm, the losses) stay
fp32. Weights, gradients and optimizer state stay fp32: the master weights. The precision is
measured into a profile (``meta["precision"]``), carried by the plans made from it
(``Plan.profile["precision"]``, absent for fp32) and used by the runtime, so that the bytes the
profile records, the planner charges and the executor holds are measured the same way.
"""
from __future__ import annotations

import contextlib

from .errors import UsageError

PRECISIONS = ("fp32", "bf16")


def check_precision(value, what: str = "precision") -> str:
    """``value`` as one of PRECISIONS, or a UsageError naming them."""
    if not isinstance(value, str) or value.strip().lower() not in PRECISIONS:
        raise UsageError(f"{what} must be one of {', '.join(PRECISIONS)}, got {value!r}")
    return value.strip().lower()


def autocast(device_type: str, precision: str):
    """The autocast region of ``precision`` on ``device_type`` ("cpu" or "cuda"); none for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type, dtype=torch.bfloat16)


def inner_view(leaf):
    """What a layer is called on where its input is a leaf (a profiled layer, a pack's first layer):
    a view of it where it requires grad, as a layer inside a pack gets the previous layer's output.
    Autocast caches its casts of a leaf that requires grad (it takes it for a weight), so on the leaf
    itself an input that several matmuls use would be cast, and saved, once instead of once per use
    (BERT's query, key and value: one bf16 copy instead of three)."""
    return leaf.view_as(leaf) if leaf.requires_grad else leaf


def low_dtype(precision: str):
    """The dtype autocast computes in (None for fp32)."""
    if precision == "fp32":
        return None
    import torch

    return torch.bfloat16


def resolve(plan, precision: str | None) -> str:
    """The precision to run ``plan`` with: the plan's, or ``precision`` if it is the same. A run
    in another precision than the plan's profile was measured in would be priced with the wrong
    bytes, so it is refused."""
    made = plan.precision
    if precision is None:
        return made
    asked = check_precision(precision)
    if asked != made:
        raise UsageError(f"the plan was made from a profile measured in {made} but precision {asked} was asked "
                         f"for; profile with --precision {asked} and plan again, or run in {made}")
    return asked
