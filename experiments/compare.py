"""Reproduce the compare experiment into experiments/results/ (see experiments/README.md).

    python experiments/compare.py [--time-limit S] [--out DIR] ...   # same options as `harmony-opt reproduce compare`
"""
import sys

from harmony_opt.cli import main

if __name__ == "__main__":
    sys.exit(main(["reproduce", "compare", *sys.argv[1:]]))
