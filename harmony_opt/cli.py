"""The ``harmony-opt`` command: a thin layer over the library API.

Exit codes: 0 success; 2 bad input or infeasible request (one line on stderr saying
what and where); 1 internal error (with a hint to report it; ``--debug`` shows the
traceback).
"""
from __future__ import annotations

import argparse
import sys
import traceback

from . import __version__
from .core.errors import HarmonyOptError, UsageError

# Each subcommand module registers itself with `register(subparsers)` and sets `func`.
_COMMAND_MODULES = (
    "harmony_opt.commands.profiles",
    "harmony_opt.commands.planning",
    "harmony_opt.commands.measure",
    "harmony_opt.commands.running",
    "harmony_opt.commands.calibrate",
    "harmony_opt.commands.reproduce",
    "harmony_opt.commands.check",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: one line, exit 2
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    p = _Parser(prog="harmony-opt", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"harmony-opt {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in _COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:   # a command module not present in this build
                continue
            raise
        mod.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    # --debug anywhere on the line, as the hint below suggests: `harmony-opt plan ... --debug` works too
    argv = ["--debug"] * debug + [a for a in argv if a != "--debug"]
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        rc = args.func(args)
        return int(rc or 0)
    except HarmonyOptError as e:
        if debug:
            traceback.print_exc()
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"harmony-opt: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("harmony-opt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug: say so, point at --debug
        if debug:
            traceback.print_exc()
        first = str(e).splitlines()[0] if str(e) else ""
        print(f"harmony-opt: internal error: {type(e).__name__}: {first} "
              f"(this is a bug; rerun with --debug and report the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
