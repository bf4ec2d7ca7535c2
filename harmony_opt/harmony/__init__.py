"""Harmony's original scheduler, re-implemented to the letter (the ``harmony`` cost model).

In pipeline order: packing.py (the candidate sizes and packing heuristics), graph.py (the task
graph), events.py (the event simulator), search.py (the search and its Top-K rule).

Harmony (VLDB 2022) searches microbatch sizes and layer packs by enumerating a few packing
heuristics and scoring each candidate with an event-driven simulator; its Top-1 estimate
is ``global_endtime``. This module reproduces that search and simulator exactly as
HARMONY_REFERENCE.md sections 1-6 describe them, so the project can compare against
Harmony's own choices and estimates. It follows the reference and does not deviate: the
same candidate sizes, packers (:mod:`harmony_opt.harmony.packing`), enumeration order
and Top-K rule, task graph (order, placement, media and the two vPP patches), event
expansion with and without ``prefetch_offload``, durations, rendezvous, re-batching,
deadlock handling and per-task memory estimate. Its known weaknesses (bandwidth divided by
the number of busy GPUs, prefetch off while scoring, a reported memory that is not what
the packers check, a fixed 40 ms per deletion) are kept on purpose; the project's default
cost model does not share them. Flags not offered: ``--reverse_bwd`` (deprecated),
``--memory_cap_scale`` (pass the scaled cap), ``--no_offload_optim`` (the simulator
requires offload) and the debug flags. Where the original would crash (no size to search,
a re-batching mismatch) this module raises InfeasibleError or PlanError instead.

Usage::

    profile = load_profile("bert_96")
    res = harmony_search(profile, batch=32, gpus=2, mode="vPP", memory_cap=10 * 2**30,
                         rank_fit_normally=True)             # res.best.time: 17.873845 s
    plan = res.best_plan()
    timeline = simulate_harmony(plan, profile)        # timeline.iteration_time == plan's time

Pieces, in pipeline order: :func:`candidate_sizes` and the ``PACKERS`` (search space),
:func:`compose_task_graph` (a networkx DiGraph of FWD/BWD/UPD tasks whose nodes carry their
rank and the medium of every input and output), :func:`expand_events` (the graph as
events on per-rank FIFO streams), :func:`run_events` (begin/end times, or a deadlock) and
:func:`task_memory` (the reported per-task memory).

Implementation notes: numbers are exact where Harmony's are integers (memory, bytes); pack
times are prefix-sum differences, which differ from Harmony's sequential sums only in the
last bits. Identical candidates (same sizes and packs from different methods) are
simulated once, and the dependency graph is resolved in topological order, which gives the
same times as Harmony's round-robin dispatcher (the reference shows that the order does
not matter).
"""
from __future__ import annotations

from ..core.kinds import Medium, TaskKind, Tensor
from .events import (EventKind, Stream, expand_events, merge_rendezvous, run_events, simulate_harmony,
                     task_memory)
from .graph import Port, Rebatch, compose_task_graph, rebatch
from .packing import PACKERS, PACKING_SETS, candidate_sizes, get_packer, packing_methods
from .search import HarmonyCandidate, HarmonySearchResult, harmony_search

__all__ = [
    "PACKERS", "PACKING_SETS", "get_packer", "packing_methods", "candidate_sizes",
    "TaskKind", "Medium", "Tensor", "Stream", "EventKind", "Port", "Rebatch", "rebatch",
    "compose_task_graph", "expand_events", "merge_rendezvous", "run_events", "task_memory", "simulate_harmony",
    "HarmonyCandidate", "HarmonySearchResult", "harmony_search",
]
