"""The configuration objective shared by the CP-SAT model and the DP oracle.

For chosen forward packs F, backward packs B and the criterion pack c (the backward
pack holding the loss):

* one chain (N = 1, or vDP where every GPU runs the chain on its data share)::

      T = sum_{k in F+B+c} task_k + first_load + tail

  where ``task_k = max(compute_k, h2d_k / bw_in, d2h_k / bw_out)`` (the next pack's
  weights and the next microbatch's input are prefetched while a pack computes),
  ``first_load`` is the first pack's weight load (nothing to overlap it with) and
  ``tail`` the CPU update of the pack holding layer 0 (nothing after it to overlap).
  With N vDP replicas sharing one host link, also ``T >= N * sum h2d / link`` (and d2h).

* vPP over N GPUs (packs dealt round-robin, microbatches pipelined)::

      T = sum task_k / N + fill_F + fill_B + first_load + tail,
      fill_phase >= (N - 1) * task_k / m_phase   for every chosen pack k of the phase,
      T >= sum h2d_k / link,  T >= sum d2h_k / link   (one shared host link)

All times are integers in microseconds inside CP-SAT.
"""
from __future__ import annotations

SCALE = 1e6  # seconds -> integer microseconds


def chain(cfg) -> bool:
    return cfg.mode == "vDP" or cfg.gpus == 1
