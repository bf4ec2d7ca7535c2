"""The planner's deterministic work budget and the search's tuning constants.

Each constant says what it prices or limits and where it was measured: the per-unit prices were
fitted by least squares of wall time on a 2-core machine over the distinct searches of
benchmarks/bench_planner.py (results: benchmarks/results/planner.md, columns ``ours_work_s`` and
``ours_search_s``); a change to any of them changes plans, so rerun that benchmark."""
from __future__ import annotations

import time



from . import dp
from .tasks import Tasks


#: The vPP partitioned start (every_boundary) packs at every layer boundary up to this many
#: (resnet1026's 516: 250,000 tasks), at this many candidate ones beyond.
FINE_CUTS = 641


#: The vPP position model is only built up to this many placement Booleans: beyond, it costs
#: more of the budget than CP-SAT's neighbourhood moves win over the local search.
MAX_PIPELINE_VARIABLES = 20_000


#: Candidates are simulated (beyond the best two) only while the model rates them within this
#: factor of the best: the model is within a few % of the simulator, rarely 10 %.
SIMULATE_WITHIN = 1.10


#: Prices of the binding link traffic (ticks per tick) in the DP over chains that keep gradients on the
#: GPU (handoff_chains), tried in this order while the floor binds.
HANDOFF_PRICES = (0.0, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)


#: The timeline model stops within this gap of its bound: its report proves the plan's schedule to
#: within a few tenths of a percent, and closing them costs seconds of wall time on plans of
#: thousands of events (bert_96 D=64, 6,356 events: the simulator's schedule 0.18 % above the
#: floor, and CP-SAT took 4 s to improve nothing, against 0.2 s to stop at it).
TIMELINE_REL_GAP = 5e-3


#: The least work seconds of search the timeline model runs with (steps/order.py); with less left it is
#: skipped, and what its reserve kept goes to the polish instead (Search.timeline_reserve).
MIN_TIMELINE_LIMIT = 0.05


class Budget:
    """Work seconds, counted deterministically so that the same inputs give the same plan on a busy
    or an idle machine: CP-SAT's deterministic time plus fixed costs per unit of the other work,
    measured on a 2-core machine (benchmarks/results/planner.md); they track wall time within a
    small factor, which drifts with the machine's load (1.0-2.6x by stage within one day).

    With ``wall`` seconds, each step also stops where its share of them has passed (``left``) and
    CP-SAT at the wall seconds left (``wall_left``): the search ends in time on a slow machine,
    and ``stopped_by_wall`` records that the wall clock, not the work, decided where it stopped."""

    # Fitted on a 2-core machine in one of its slow hours, one process, over the 12 distinct searches of
    # benchmarks/bench_planner.py (least squares of wall time on the units; docs/planner.md, section 4);
    # benchmarks/results/planner.md compares the work charged (ours_work_s) with the wall time it took
    PER_FLOOR = 2e-4        # a configuration's floor (compute_floor), which orders them all ...
    PER_BOUND = 2.7e-3      # ... and its cheap bound (config_bound), where the search reaches it
    PER_PATH_LAYER = 6.5e-4  # a vPP configuration's bound from its paths (vpp_bound), per layer: the fitted
                            # 5e-4 of its serial paths alone, x 1.33 (the mean ratio of their times on Table 1)
    PER_CONFIG = 6e-3       # building a configuration's candidate tasks: fixed part ...
    PER_ROW = 5e-7          # ... and per candidate task
    PER_DP = 5e-3           # the DP: fixed part ...
    PER_NODE = 4.5e-5       # ... per layer boundary ...
    PER_PAIR = 2e-8         # ... and per (predecessor, task) pair it weighs
    PER_START = 6e-6        # a balanced first solution, per task evaluated
    PER_PARTITION = 0.03    # the packings that minimise the largest pack (search.partitioned), besides
                            # PER_START per task they evaluate
    PER_STEP = 5.5e-5       # a local-search step: fixed part ...
    PER_TASK = 2.5e-6       # ... and per task of the evaluated sequence
    PER_SIMULATION = 3e-3   # the simulator judging a plan: fixed part (the task graph, the checks) ...
    PER_EVENT = 2.4e-5      # ... and per event
    PER_HARMONY_EVENT = 1.55e-5  # Harmony's simulator (--cost-model harmony), per event it plays besides
                                 # PER_SIMULATION (1.8 ms + 8.9 us per event measured on 22 plans in an
                                 # hour 1.75x faster than the calibration's; hspace_* of planner.md)
    PER_PACKING = 6.5e-6    # Harmony's search: its packing heuristics, per candidate and layer
    PER_MODEL_ROW = 9e-5    # building a CP-SAT model and completing its hint, per Boolean
    PER_SOLVE = 0.05        # CP-SAT's start-up, which its deterministic clock barely counts
    PER_TIMELINE_EVENT = 2.5e-4  # the timeline model, per event, besides its time limit
    # A vPP shape's model (vpp_exact, steps/improve.py exact_shapes): building and solving one costs a
    # fixed part, a part per Boolean and CP-SAT's deterministic time, which undercounts these small
    # solves (least squares over 301 shapes of a 12-layer Llama and bert_large: 2.3-10 ms, 5-20 us
    # per Boolean, 1.4-2.6 wall seconds per deterministic one)
    PER_SHAPE = 8e-3
    PER_SHAPE_ROW = 2e-5
    SHAPE_SLOWNESS = 2.5
    PER_SHAPE_PATH = 1e-4       # a shape's path bound (vpp_exact.path_bound): fixed part ...
    PER_SHAPE_PATH_ROW = 1.5e-6  # ... per candidate task (0.3 ms at 207, 1.2 ms at 845)

    @staticmethod
    def shape(size: int, deterministic_time: float = 0.0) -> float:
        """One shape's model of ``size`` Booleans built and solved in ``deterministic_time``."""
        return Budget.PER_SHAPE + Budget.PER_SHAPE_ROW * size + Budget.SHAPE_SLOWNESS * deterministic_time

    @staticmethod
    def shape_path(rows: int) -> float:
        """One shape's path bound over a table of ``rows`` candidate tasks."""
        return Budget.PER_SHAPE_PATH + Budget.PER_SHAPE_PATH_ROW * rows

    @staticmethod
    def dp(tasks: Tasks) -> float:
        """One DP over ``tasks`` (dp.solve_chain)."""
        return Budget.PER_DP + Budget.PER_NODE * 2 * tasks.num_layers + Budget.PER_PAIR * dp.pairs(tasks)

    @staticmethod
    def simulation(events: int, cost_model: str = "default", runs: int = 1) -> float:
        """``runs`` simulations by the cost model's simulator that played ``events`` events in all."""
        per_event = Budget.PER_HARMONY_EVENT if cost_model == "harmony" else Budget.PER_EVENT
        return Budget.PER_SIMULATION * runs + per_event * events

    def __init__(self, total: float, wall: float | None = None):
        self.total, self.used = float(total), 0.0
        self.wall, self.started, self.stopped_by_wall = wall, time.perf_counter(), False

    def spend(self, seconds: float) -> None:
        self.used += seconds

    def left(self, share: float = 1.0, reserve: float = 0.0) -> float:
        """Work seconds left of ``share`` of the budget, less ``reserve`` (kept for a later step)."""
        work = share * self.total - self.used - reserve
        if self.wall is not None:
            wall = self.wall_left(share) - reserve
            if wall <= 0 < work:
                self.stopped_by_wall = True
                return wall
        return work

    def wall_left(self, share: float = 1.0) -> float | None:
        """Wall seconds left of ``share`` of the wall limit (None without one)."""
        return None if self.wall is None else share * self.wall - (time.perf_counter() - self.started)

    def cp_sat_limits(self, limit: float, share: float = 1.0) -> dict:
        """CP-SAT's limits for a solve of ``limit`` work seconds within ``share`` of the wall limit."""
        wall = self.wall_left(share)
        return {"time_limit": limit, "wall_limit": None if wall is None else max(0.05, wall)}

    def solved(self, status: str, wall_time: float, limits: dict) -> None:
        """Note a CP-SAT solve (``limits`` from cp_sat_limits) that its wall limit stopped unfinished."""
        if limits["wall_limit"] is not None and status != "OPTIMAL" and wall_time >= 0.95 * limits["wall_limit"]:
            self.stopped_by_wall = True


class NeedsBudget(Exception):
    """A step that reads the budget (what is left), which a process computing ahead cannot know."""


class Tally(Budget):
    """A budget that lists what is spent (to be spent again, one by one, in the planner's own
    process: the same float sums) and cannot say what is left."""

    def __init__(self, total: float):
        super().__init__(total)
        self.spent = []

    def spend(self, seconds: float) -> None:
        super().spend(seconds)
        self.spent.append(seconds)

    def left(self, share: float = 1.0, reserve: float = 0.0) -> float:
        raise NeedsBudget


def timeline_slowness(events: int) -> float:
    """Wall seconds per deterministic second of CP-SAT on the timeline model of ``events`` events, as
    the budget counts them: measured 0.4-1.3 at 500-1,500 events, 3.8 at 9,900 (vPP on 4 GPUs) and
    11 at 7,900 (vDP on 8); 2.5-3.0 at 174-2,092 events in a slow hour (benchmarks/results/swap_order.md
    and planner.md's timeline columns)."""
    return max(2.5, events / 1000)
