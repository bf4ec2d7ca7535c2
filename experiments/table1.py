"""Reproduce the table1 experiment into experiments/results/ (see experiments/README.md).

    python experiments/table1.py [--time-limit S] [--out DIR] ...   # same options as `harmony-opt reproduce table1`
"""
import sys

from harmony_opt.cli import main

if __name__ == "__main__":
    sys.exit(main(["reproduce", "table1", *sys.argv[1:]]))
