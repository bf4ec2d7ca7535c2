"""The experiments of the paper and beyond, run from a checkout of the repository:

    python -m experiments all                      # every table and figure into experiments/results/
    python -m experiments table1 --time-limit 20   # one experiment (table1, compare, scaling, servers)

One module per experiment (table1, compare, scaling, servers), each a function from settings
to a pandas table (no printing, no files) and a ``write_*`` function that turns the table into
CSV, markdown and PNG files; common.py holds what they share and cli.py the command line.
``harmony-opt reproduce ...`` runs the same command line where this package is importable.
The package is not installed with harmony_opt: it is the repository's, like benchmarks/.
"""
