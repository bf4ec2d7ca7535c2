# Sourced by the scripts of experiments/gpu/ on a GPU machine without a package index, from the
# repository's root: installs the wheels in .whl/ (ortools and its needs) into /tmp/site, and makes the
# checkout importable without installing it (the subpackages that pyproject.toml maps from runtime/
# and solver_models/ are linked into harmony_opt/ of this copy).
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
[ -e harmony_opt/runtime ] || ln -s ../runtime harmony_opt/runtime
[ -e harmony_opt/solver_models ] || ln -s ../solver_models harmony_opt/solver_models
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
