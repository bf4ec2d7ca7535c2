"""`python -m experiments` from the repository root: every table and figure (`harmony-opt reproduce all`)."""
import sys

from harmony_opt.cli import main

if __name__ == "__main__":
    sys.exit(main(["reproduce", "all", *sys.argv[1:]]))
