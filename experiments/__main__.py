"""`python -m experiments [table1|compare|scaling|servers|all] [options]` from the repository root
(see experiments/cli.py, or `python -m experiments --help`)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
