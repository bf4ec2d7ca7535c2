"""Profiles shipped in the repository's ``profiles/`` folder, found by name."""
from __future__ import annotations

import os
from pathlib import Path

from .errors import ProfileError
from .profile import Profile


def profiles_dir() -> Path:
    """``$HARMONY_OPT_PROFILES``, else the ``profiles/`` folder beside the package."""
    env = os.environ.get("HARMONY_OPT_PROFILES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "profiles"


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
