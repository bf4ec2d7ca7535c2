"""The executor of Programs: streams, pinned host buffers, the CPU optimizer, one process per rank.

::

    from harmony_opt.runtime import Executor, run_job, Job
    from harmony_opt.training import train          # the usual way in

See docs/runtime.md for how a Program runs.
"""
from .checkpoint import load_checkpoint, save_checkpoint
from .executor import Executor
from .optim import PackOptimizers, make_factory
from .worker import Job, RankResult, run_job

__all__ = ["Executor", "Job", "PackOptimizers", "RankResult", "load_checkpoint",
           "make_factory", "run_job", "save_checkpoint"]
