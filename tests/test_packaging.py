"""What `pip install` puts on a user's path: one top-level name, every subpackage, nothing shadowed."""
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _config():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_folder_with_an_init_is_an_installed_package():
    """A new subpackage left out of pyproject.toml would be missing from a wheel (not from an
    editable install, so the other tests would not notice)."""
    cfg = _config()
    dirs = {v: k for k, v in cfg["package-dir"].items()}
    found = set()
    for top in ("harmony_opt", *dirs):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).parts
            found.add(".".join((dirs.get(rel[0], rel[0]).split(".")) + list(rel[1:])))
    assert found == set(cfg["packages"])
    assert all(p == "harmony_opt" or p.startswith("harmony_opt.") for p in cfg["packages"])


def test_a_users_own_runtime_and_solver_models_modules_change_nothing(tmp_path):
    """A script beside a user's own runtime.py (first on sys.path) still gets our executor and
    planner, and the user's module stays importable as theirs."""
    for name in ("runtime", "solver_models"):
        (tmp_path / f"{name}.py").write_text(f"MINE = {name!r}\n")
    code = ("import harmony_opt.runtime.worker, harmony_opt.solver_models.planner, harmony_opt.training\n"
            "import runtime, solver_models\n"
            "assert runtime.MINE == 'runtime' and solver_models.MINE == 'solver_models'\n"
            "print(harmony_opt.runtime.worker.__name__, harmony_opt.solver_models.planner.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["harmony_opt.runtime.worker", "harmony_opt.solver_models.planner"]


def test_the_pipeline_is_one_import_away():
    """profile -> plan -> simulate -> compile -> train from ``import harmony_opt`` alone (each loaded on
    first use, so that planning does not import torch)."""
    import harmony_opt
    for name in ("decompose", "decompose_hf", "LayeredModel", "profile_model", "plan", "PlannerOptions",
                 "simulate", "compile_plan", "train"):
        assert name in harmony_opt.__all__ and callable(getattr(harmony_opt, name)), name
    code = "import sys, harmony_opt; harmony_opt.plan; harmony_opt.simulate; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
