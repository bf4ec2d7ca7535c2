"""Helpers shared by the subcommands."""
from __future__ import annotations

import os
from pathlib import Path

from ..core.errors import OutputError, PlanError, ProfileError, UsageError
from ..core.io import check_writable


MODEL_HELP = ("a built-in model name (gpt2-tiny, gpt2-xl, bert-large, ...), or your own: a Hugging Face model folder "
              "(config.json, and its weights when present; --set KEY=VALUE are config fields), or "
              "path/to/file.py:function or package.module:function, a function returning a LayeredModel (--set "
              "KEY=VALUE are its keyword arguments)")


def plan_hardware(plan, plan_path, override: str | None):
    """The hardware a plan is simulated or calibrated on: ``override`` (a --hardware argument), else
    the one the plan records; a plan that records none needs --hardware."""
    from ..core.hardware import Hardware, get_hardware
    if override:
        return get_hardware(override)
    if not plan.hardware:
        raise UsageError(f"{plan_path}: the plan names no hardware; pass --hardware")
    return Hardware.from_dict(plan.hardware, f"{plan_path}: hardware")


def plan_profile(plan, plan_path, override: str | None):
    """The profile a plan is checked or simulated with: ``override`` (a --profile argument), else the
    profile folder the plan records (``profile.path``, written for a plan made from a folder that is
    not a bundled profile; refused, in one line, when the folder is gone or its profile has changed
    since), else the bundled profile the plan names. A plan written before plans recorded the folder
    names only the model, so say to pass --profile when the name is not a bundled profile."""
    from ..core.bundled import bundled_names, load_profile
    if override:
        return load_profile(override)
    recorded = plan.profile.get("path")
    if recorded is not None:
        return _recorded_profile(plan, plan_path, recorded)
    name = plan.profile.get("name")
    if not name:
        raise UsageError(f"{plan_path}: the plan names no profile; pass --profile NAME|DIR")
    try:
        return load_profile(name)
    except ProfileError:
        if name in bundled_names():
            raise
        raise ProfileError(f"{plan_path}: the plan's profile {name!r} is not a bundled profile or a folder here; "
                           f"pass --profile with the profile folder it was made from") from None


def _recorded_profile(plan, plan_path, recorded):
    """The profile in the folder a plan records, if it is still the one the plan was made from."""
    from ..core.profile import Profile
    if not isinstance(recorded, str) or not recorded:
        raise PlanError(f"{plan_path}: field profile.path must be a folder's path, got {recorded!r}; "
                        f"pass --profile with the profile folder the plan was made from")
    folder = Path(recorded)
    if not folder.is_dir():
        raise ProfileError(f"{plan_path}: the plan's profile folder {folder} no longer exists; pass --profile "
                           f"with the profile folder the plan was made from")
    try:
        profile = Profile.load(folder)
    except ProfileError as e:
        why = " ".join(str(e).split())
        raise ProfileError(f"{plan_path}: the plan's profile folder {folder} cannot be read ({why}); pass "
                           f"--profile with the profile folder the plan was made from") from None
    made = plan.profile.get("identity")
    if made and profile.identity != made:
        raise ProfileError(f"{plan_path}: the profile in {folder} has changed since the plan was made (identity "
                           f"{profile.identity}, the plan's {made}); pass --profile with the profile the plan was "
                           f"made from, or re-plan")
    return profile


def writable_folder(path: str, what: str | None = None) -> Path:
    """Create the output folder now, so a bad path fails before a long measurement, not after."""
    p, what = Path(path), what or f"-o {path}"
    if p.exists() and not p.is_dir():
        raise UsageError(f"{what}: {p} exists and is not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{what}: cannot create the folder {p} ({e.strerror or e})") from None
    if not os.access(p, os.W_OK):
        raise UsageError(f"{what}: the folder {p} is not writable")
    return p


def writable_file(path: str, option: str = "-o", example: str = "hardware.toml") -> Path:
    """An output file's path, checked before the work that writes it (io.check_writable), a folder
    named as the option's mistake."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{option} {path}: is a folder; give a file name such as {example}")
    try:
        return check_writable(p)
    except OutputError as e:
        raise UsageError(f"{option}: {e}") from None


def written(save, path, what: str):
    """``save(path)``, an OS error there (disk full, no permission) as one line naming ``what``."""
    try:
        return save(path)
    except OSError as e:
        raise UsageError(f"cannot write {what}: {e.strerror or e}") from None
