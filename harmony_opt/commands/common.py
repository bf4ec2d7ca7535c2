"""Helpers shared by the subcommands."""
from __future__ import annotations

from ..errors import ProfileError, UsageError


def plan_profile(plan, plan_path, override: str | None):
    """The profile a plan is checked or simulated with: ``override`` (a --profile argument), else the
    bundled profile the plan names. A plan made from a profile folder names only the model, so
    say to pass --profile when the name is not a bundled profile."""
    from ..bundled import bundled_names, load_profile
    if override:
        return load_profile(override)
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
