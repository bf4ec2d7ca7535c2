"""The one vocabulary of tasks, tensors and media.

The task graph (:mod:`harmony_opt.sim.taskgraph`), the re-implementation of Harmony's
scheduler (:mod:`harmony_opt.harmony`) and the compiled program
(:mod:`harmony_opt.compile.program`, :mod:`harmony_opt.compile.compiler`) name the same things: a
forward, backward or update task, the weights or the stashed input it moves, the medium
it moves by. They share these enums, so a tensor or a medium is one value everywhere.

The values are the short forms that reach users and files (task names such as
``F[0-3]@1``, instruction names such as ``RX[4-4]#0(0+2)``); Harmony's own spelling of
a task kind is :attr:`TaskKind.harmony` (``FWD``, ``BWD``, ``UPD``).
"""
from __future__ import annotations

from enum import Enum

__all__ = ["TaskKind", "Tensor", "Medium"]


class TaskKind(str, Enum):
    """What a task does (Harmony's FWD, BWD, UPD); the value is the letter of a task's name."""

    FWD = "F"     # forward of a pack over all its microbatches
    BWD = "B"     # recompute (unless stashed) and backward of a pack
    UPD = "U"     # optimizer step of a pack's weights (on the CPU, or on the GPU)
    F = FWD
    B = BWD
    U = UPD

    @property
    def harmony(self) -> str:
        """Harmony's name of the kind: ``"FWD"``, ``"BWD"`` or ``"UPD"`` (also a profile's phase)."""
        return self.name


class Tensor(str, Enum):
    """Kinds of tensors a task reads or writes (HARMONY_REFERENCE.md 5), plus sA.

    Activations are named by the layer whose input they are (X, Y, sX) or whose input's
    gradient they are (dX, dY)."""

    W = "W"             # weights
    B = "B"             # buffers
    X = "X"             # forward activation: the input of a pack's first layer
    Y = "Y"             # a pack's output = the next layer's input X
    DX = "dX"           # gradient of a backward pack's input, leaving it
    DY = "dY"           # gradient of a backward pack's output, entering it
    DW = "dW"           # weight gradients
    K = "K"             # optimizer state
    T = "T"             # targets
    SX = "sX"           # kept for a backward pack: its input (recompute) or its saved activations (stash)
    SA = "sA"           # saved activations (autograd graph) of a pack's microbatch (program only)


class Medium(str, Enum):
    """How a tensor gets from one place to another (Harmony's media)."""

    DAT = "DAT"   # from the data loader in host memory: swapped in
    SWP = "SWP"   # swapped out to host memory and back in by the same GPU
    MSG = "MSG"   # through host memory to another process (GPU or microbatching): out, then in
    P2P = "P2P"   # GPU to GPU over the GPU link (for dW with no peer: the all-reduce among replicas)
    SHM = "SHM"   # the shared host copy of the model and optimizer state: swapped in/out by GPU tasks
    LOC = "LOC"   # to this GPU's CPU process (gradients for the CPU optimizer): swapped out
    PIN = "PIN"   # stays on the GPU
