"""The executor of Programs: streams, pinned host buffers, the CPU optimizer, one process per rank.

::

    from runtime import Executor, run_job, Job
    from harmony_opt.training import train          # the usual way in

See docs/runtime.md for how a Program runs.
"""
from .checkpoint import load_checkpoint, save_checkpoint
from .executor import Executor
from .optim import PackOptimizers, make_factory
from .shapes import boundary_shapes, measure_layer_bytes
from .worker import Job, RankResult, run_job

__all__ = ["Executor", "Job", "PackOptimizers", "RankResult", "boundary_shapes", "load_checkpoint",
           "make_factory", "measure_layer_bytes", "run_job", "save_checkpoint"]
