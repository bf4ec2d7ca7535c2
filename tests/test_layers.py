"""The package's layers import one way (docs/design.md, "Where things live"): every import, at module
level or inside a function, goes to the module's own layer or to one listed before it in LAYERS.
So one rule changes in one place, and no package cycle can come back unnoticed."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# folder in the repository -> the package it installs as (pyproject.toml, package-dir)
INSTALLED_AS = {"solver_models": "harmony_opt.solver_models", "runtime": "harmony_opt.runtime"}
LAYERS = ("core", "api", "compile", "sim", "harmony", "planners", "solver_models", "runtime", "measure",
          "training", "calibrate", "report", "fuzzing", "commands", "cli")


def _module(f: Path) -> tuple[str, bool]:
    parts = list(f.relative_to(ROOT).with_suffix("").parts)
    parts = INSTALLED_AS.get(parts[0], parts[0]).split(".") + parts[1:]
    package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if package else parts), package


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "harmony_opt":
        return None
    return "api" if len(parts) == 1 else parts[1]


def _imports(f: Path):
    """(imported module, line) of every import in ``f``, relative ones resolved."""
    name, package = _module(f)
    here = name.split(".") if package else name.split(".")[:-1]
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                yield ".".join(base + ([node.module] if node.module else [])), node.lineno
            else:
                yield node.module, node.lineno


def _edges():
    for top in ("harmony_opt", *INSTALLED_AS):
        for f in sorted((ROOT / top).rglob("*.py")):
            src = _layer(_module(f)[0])
            for target, line in _imports(f):
                dst = _layer(target)
                if dst is not None and dst != src:
                    yield src, dst, f"{f.relative_to(ROOT)}:{line} imports {target}"


def test_every_module_belongs_to_a_listed_layer():
    layers = {_layer(_module(f)[0]) for top in ("harmony_opt", *INSTALLED_AS) for f in (ROOT / top).rglob("*.py")}
    assert layers <= set(LAYERS), f"add these to LAYERS (and docs/design.md): {sorted(layers - set(LAYERS))}"


def test_imports_only_go_down_the_layers():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = [why for src, dst, why in _edges() if rank[dst] > rank[src]]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)
