"""The GPU experiment (``python -m experiments.gpu``; the stages in ``__main__``)."""
from __future__ import annotations

from harmony_opt.core.errors import UsageError
from harmony_opt.core.io import read_json


def read_result(path):
    """A JSON file an earlier stage wrote; a broken one (a run cut off mid-write, a hand edit) is one
    line naming it and exit code 2, not a traceback."""
    return read_json(path, "result file", UsageError, "run the stage that writes it",
                     "delete it to run its stage again")
