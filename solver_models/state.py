"""The state one ``plan()`` call shares between its steps: the inputs, the budget, the candidates."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math


from harmony_opt.planners.baselines import feasible_sizes, played
from harmony_opt.core.errors import InfeasibleError
from harmony_opt.core.hardware import Hardware
from harmony_opt.sim.host_memory import model_host_memory, require_fits
from harmony_opt.core.memory import explain_infeasible
from harmony_opt.core.plan import PackOptions, Plan, data_shares, split_microbatches
from harmony_opt.core.profile import Profile
from harmony_opt.sim.simulator import count_events

from . import dp
from .budget import MIN_TIMELINE_LIMIT, Budget, timeline_slowness
from .options import PlannerOptions
from .tasks import (MAX_ARCS_PER_START, MAX_LAYERS_WITH_STASH, MEM_UNIT, Config, Tasks, build_tasks, candidate_cuts,
                    stashable_layers)
from .timing import packs_of


@dataclasses.dataclass
class Candidate:
    cfg: Config
    tasks: Tasks
    seq: list
    value: float                    # the model's iteration time (s)
    bound: float                    # a valid lower bound on the model's optimum for cfg
    floor: float                    # ... on the optimum of every variant of the model (stash, handoff)
    how: str                        # "dp", "balanced", "search", "cp-sat": what found the sequence
    solve: object = None            # cpsat.SolveResult where CP-SAT ran
    proof: str | None = None        # "dp" where the DP proved the sequence optimal for the model
    handoff: bool = False           # its plans keep gradients on the GPU (Plan.gpu_handoff)
    tight: bool = True              # ``bound`` already holds the DP's with the stash variants (tighten)
    tight_floor: bool = True        # ``floor`` already holds the DP's on every variant (tighten)
    pathed: bool = False            # vPP: ``bound`` already holds vpp_bound's (tighten)
    shapes: bool = False            # vPP: every shape of plans below the best model value was solved (exact_shapes)


@dataclasses.dataclass
class Search:
    """What every phase of one ``plan()`` call reads: the inputs, the options, the budget."""

    profile: Profile
    hw: Hardware
    batch: int
    cap: int
    opts: PlannerOptions
    budget: Budget
    say: object
    ident: dict
    host_check: bool = False        # some plan could exceed the host's memory budgets (host_memory.may_bind)
    host_error: InfeasibleError | None = None   # the least host memory overrun of a plan judged
    host_blocked: list = dataclasses.field(default_factory=list)   # configurations without a plan that fits
    pool: concurrent.futures.Executor | None = None    # other processes (processes), or None
    events: dict = dataclasses.field(default_factory=dict)    # plan decisions -> events its simulation played

    @property
    def options(self) -> bool:
        """Whether per-pack options (stash, GPU optimizer) are searched at all: not in Harmony's
        space, nor under Harmony's cost model, whose simulator plays recompute with the optimizer
        on the CPU only (a candidate using them would be refused, not judged)."""
        return self.opts.options and not self.opts.harmony_space and self.opts.cost_model == "default"

    def handoff(self, cfg: Config) -> bool:
        """Whether plans of ``cfg`` may keep gradients on the GPU (Plan.gpu_handoff): one GPU runs
        the whole chain and a backward pack holds one microbatch (not in Harmony's space or under
        Harmony's cost model, which has no such rule)."""
        if not self.opts.gpu_handoff or self.opts.harmony_space or self.opts.cost_model != "default":
            return False
        shares = [self.batch] if cfg.mode == "vPP" else data_shares(self.batch, cfg.gpus)
        return cfg.ranks == 1 and any(len(split_microbatches(n, cfg.u_bwd)) == 1 for n in shares)

    def stash(self, cfg: Config) -> bool:
        """Whether stash variants are searched for ``cfg``: coupled memory limits them to small
        models, and in vPP to the layers whose saved activations the shared link moves faster than
        they are recomputed (tasks.stashable_layers)."""
        if not (self.options and self.profile.num_layers <= MAX_LAYERS_WITH_STASH):
            return False
        if cfg.u_fwd != cfg.u_bwd:     # a stashed autograd graph cannot be re-batched: the runtime would run
            return False                # the pack's backward at the forward's microbatch, as no model here does
        uf, ub = (split_microbatches(self.batch, u) for u in (cfg.u_fwd, cfg.u_bwd))
        timed = self.profile.with_compute_scale(self.hw.compute_scale)      # as build_tasks times it
        return cfg.ranks == 1 or bool(stashable_layers(timed, self.hw, cfg, uf, ub).any())

    @property
    def timeline_share(self) -> float:  # of the budget, kept for the timeline model
        return 0.15 if self.opts.cost_model == "default" else 0.0

    def timeline_limit(self, plan_: Plan, besides: float = 0.0) -> float:
        """The deterministic seconds of search the timeline model of ``plan_`` gets from what is
        left of the budget, less ``besides`` and its building (steps/order.py): at most a second
        and a tenth of the time limit; below MIN_TIMELINE_LIMIT it is skipped."""
        events = self.events_of(plan_)
        return min(1.0, 0.1 * self.opts.time_limit,
                   (self.budget.left() - besides - Budget.PER_TIMELINE_EVENT * events) / timeline_slowness(events))

    def timeline_reserve(self, plan_: Plan, besides: float = 0.0) -> float:
        """Work seconds to keep for the timeline model of ``plan_``: its size, plus a short search;
        nothing where what is left, less ``besides`` (kept for other steps), is too little for it to
        run (timeline_limit): keeping it would leave the budget unspent (gpt2_xl D=64 on 1-4 GPUs:
        1.8 of 9 work seconds)."""
        if self.timeline_share <= 0 or self.timeline_limit(plan_, besides) < MIN_TIMELINE_LIMIT:
            return 0.0
        events = self.events_of(plan_)
        short = max(0.3, 0.1 * timeline_slowness(events))
        return min(0.3 * self.budget.total, Budget.PER_TIMELINE_EVENT * events + short)

    def events_of(self, plan_: Plan) -> int:
        """The events the simulator plays for ``plan_``: remembered from its judging, else counted (the
        simulator's expansion, without playing it)."""
        key = decisions(plan_)
        if key not in self.events:
            self.events[key] = count_events(plan_, self.profile, self.hw)
        return self.events[key]

    def tasks(self, cfg: Config, stash: bool = False, cuts=None, keep=(), per_start: int = MAX_ARCS_PER_START,
              gpu_handoff: bool = False) -> Tasks:
        tasks = build_tasks(self.profile, self.hw, self.batch, cfg, self.cap, gpu_opt=self.options, stash=stash,
                            cuts=candidate_cuts(self.profile, cfg.u_bwd, keep=keep) if cuts is None else cuts,
                            per_start=per_start, gpu_handoff=gpu_handoff)
        self.budget.spend(Budget.PER_CONFIG + Budget.PER_ROW * len(tasks.table))
        return tasks

    def plan_of(self, c: Candidate, seq) -> Plan:
        f, b, o = packs_of(c.tasks, seq)
        return Plan("cp-sat", c.cfg.mode, c.cfg.gpus, self.batch, c.cfg.u_fwd, c.cfg.u_bwd, f, b,
                    c.tasks.num_layers, options=tuple(PackOptions(r, "gpu" if g else "cpu") for r, g in o),
                    allow_uneven=self.opts.uneven, gpu_handoff=c.handoff, memory_cap=self.cap,
                    cost_model=self.opts.cost_model, **self.ident)

    def judge(self, plan_: Plan, result: tuple[float, int] | None = None) -> float:
        """Simulated iteration time (inf if the simulator rejects the plan), charged to the budget by
        the events the simulator played; ``result``: ``played``'s, where another process simulated."""
        t, events = played(plan_, self.profile, self.hw, self.opts.cost_model) if result is None else result
        self.budget.spend(Budget.simulation(events, self.opts.cost_model))
        if events and self.opts.cost_model == "default":
            self.events[decisions(plan_)] = events
        return t if math.isinf(t) or self.fits_host(plan_) else float("inf")

    def fits_host(self, plan_: Plan) -> bool:
        """Whether ``plan_``'s host memory fits the host's budgets; keeps the least overrun for the
        explanation where no plan fits."""
        if not self.host_check:
            return True
        try:
            require_fits(plan_, self.profile, self.hw, f"plan {plan_.mode} x{plan_.gpus} u={plan_.microbatch_fwd}/"
                                                       f"{plan_.microbatch_bwd} of {self.profile.name} at minibatch "
                                                       f"{self.batch}")
        except InfeasibleError as e:
            if self.host_error is None or e.needed_bytes < self.host_error.needed_bytes:
                self.host_error = e
            return False
        return True

    @staticmethod
    def shown(t: float) -> str:
        return f"{t:.4f} s" if math.isfinite(t) else "not playable (over the GPU or host memory)"

    def infeasible(self) -> InfeasibleError:
        if self.host_error is not None:
            return self.host_error
        # where the host memory may be why: the least any configuration searched needs (dp.least_host)
        least = min((m for m in (dp.least_host(self.tasks(c)) for c in self.host_blocked) if m is not None),
                    default=None)
        if least is not None:
            need = dataclasses.replace(model_host_memory(self.profile), activations=least * MEM_UNIT)
            try:
                need.check(self.hw, f"every plan of {self.profile.name} at minibatch {self.batch} searched")
            except InfeasibleError as e:
                return e
        return explain_infeasible(self.profile, self.cap,
                                  feasible_sizes(self.profile, self.batch, "vDP", self.hw.gpus, "FWD"),
                                  feasible_sizes(self.profile, self.batch, "vDP", self.hw.gpus, "BWD"))


def decisions(p: Plan) -> tuple:
    """What the simulator plays of a plan."""
    return (p.mode, p.gpus, p.microbatch_fwd, p.microbatch_bwd, p.packs_fwd, p.packs_bwd, p.options, p.gpu_handoff)
