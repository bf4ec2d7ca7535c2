"""`harmony-opt reproduce {table1,compare,scaling,servers,all} [options]`: the experiments of a checkout.

The experiments are the repository's (experiments/, run as ``python -m experiments``), not the
installed package's: this command runs them where harmony_opt itself was imported from a checkout
(an editable install), and otherwise says, in one line, to run them from one.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from ..core.errors import UsageError

EXPERIMENTS = ("table1", "compare", "scaling", "servers", "all")


def register(sub):
    p = sub.add_parser("reproduce", help="regenerate the experiments' tables and figures (from a checkout)",
                       description="Runs `python -m experiments EXPERIMENT [options]` of the checkout harmony_opt "
                                   "was imported from; `harmony-opt reproduce all --help` lists the options.")
    p.add_argument("experiment", choices=EXPERIMENTS, help="which experiment (all: every one, in one go)")
    p.add_argument("options", nargs=argparse.REMAINDER,
                   help="the experiments' own options (--out, --time-limit, --models, --batches, --gpus, --jobs, "
                        "--baseline-budget)")
    p.set_defaults(func=_reproduce)


def _checkout() -> Path:
    """The checkout harmony_opt was imported from, or UsageError where it is an installed copy."""
    import harmony_opt
    root = Path(harmony_opt.__file__).resolve().parents[1]
    if not (root / "experiments" / "cli.py").is_file():
        raise UsageError("reproduce runs the experiments of a checkout of the repository, and this harmony_opt is "
                         "installed without them: from a checkout, run `python -m experiments "
                         f"{{{','.join(EXPERIMENTS)}}} [options]`")
    return root


def experiments_cli(root: Path | None = None):
    """experiments.cli of the checkout at ``root`` (default: harmony_opt's own), imported with the
    checkout on sys.path (so the compare grid's worker processes find it too)."""
    root = root or _checkout()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    mod = importlib.import_module("experiments")
    if Path(mod.__file__).resolve().parent != root / "experiments":
        raise UsageError(f"another package named experiments ({mod.__file__}) hides the checkout's "
                         f"({root / 'experiments'}); run `python -m experiments ...` from {root}")
    return importlib.import_module("experiments.cli")


def _reproduce(args):
    cli = experiments_cli()
    return cli.run(cli.build_parser("harmony-opt reproduce").parse_args([args.experiment, *args.options]))
