"""Profiles shipped in the repository's ``profiles/`` folder, found by name."""
from __future__ import annotations

import os
from pathlib import Path

from .errors import ProfileError
from .profile import Profile


def profiles_dir() -> Path:
    """``$HARMONY_OPT_PROFILES``, else the ``profiles/`` folder beside the package (``harmony_opt/core/`` is
    two levels below it)."""
    env = os.environ.get("HARMONY_OPT_PROFILES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "profiles"


def bundled_names() -> list[str]:
    root = profiles_dir()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if p.is_dir() and ((p / "layers.csv").exists() or (p / "layers.parquet").exists()))


_CACHE: dict[str, Profile] = {}


def load_profile(spec: str | Path | Profile) -> Profile:
    """A bundled profile's name or a profile folder; bundled profiles are loaded once per process."""
    if isinstance(spec, Profile):
        return spec
    s = str(spec)
    if s in bundled_names():
        if s not in _CACHE:
            _CACHE[s] = Profile.load(profiles_dir() / s)
        return _CACHE[s]
    p = Path(s)
    if p.is_dir():
        return Profile.load(p)
    names = ", ".join(bundled_names()) or "none found"
    raise ProfileError(f"no profile {s!r}: not a bundled name ({names}) and not a folder")


def profile_ident(profile: Profile) -> dict:
    """What a plan records of the profile it was made from (``Plan.profile``): the name and content
    hash, and, for a profile loaded from a folder that is not the bundled profile of that name, the
    folder's absolute path, so that the commands that take the plan (simulate, check) find the profile
    without --profile. Plans of bundled (and in-memory) profiles carry only the name and the hash, as
    they always have; a profile measured in another precision than fp32 adds it ("precision": "bf16"),
    which the runtime runs the plan in."""
    ident = {"name": profile.name, "identity": profile.identity}
    if profile.precision != "fp32":
        ident["precision"] = profile.precision
    folder = Path(profile.source)
    if profile.source.startswith("<") or not folder.is_dir():
        return ident
    folder = folder.resolve()
    if profile.name in bundled_names() and (profiles_dir() / profile.name).resolve() == folder:
        return ident
    return {**ident, "path": str(folder)}


def plan_ident(profile: Profile, hardware) -> dict:
    """The inputs a plan records (``Plan.profile`` and ``Plan.hardware``), for every planner alike."""
    return {"profile": profile_ident(profile), "hardware": hardware.to_dict()}
