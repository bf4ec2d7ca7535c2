"""Reproduce the scaling experiment into experiments/results/ (see experiments/README.md).

    python experiments/scaling.py [--time-limit S] [--out DIR] ...   # same options as `harmony-opt reproduce scaling`
"""
import sys

from harmony_opt.cli import main

if __name__ == "__main__":
    sys.exit(main(["reproduce", "scaling", *sys.argv[1:]]))
