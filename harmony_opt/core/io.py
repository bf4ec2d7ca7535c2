"""File input and output of the tool, in one place.

Writes are atomic: a temporary file in the same folder, fsync, then rename, so an
interrupted run never leaves a truncated plan, profile, program, checkpoint, result,
figure or trace that a later command would read. A write that the system refuses (no
such folder, no permission, a folder in the way, disk full) raises :class:`~harmony_opt.core.errors.OutputError`,
which is both an ``OSError`` and a :class:`~harmony_opt.core.errors.HarmonyOptError`, so the
command line reports it in one line with exit code 2.

Reads of the tool's own text files (plans, programs, hardware files) go through
:func:`read_text`, which words a missing, unreadable or binary file as the caller's
error class.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from .errors import HarmonyOptError, OutputError


def _temp_beside(path: Path) -> tuple[int, str]:
    """A new temporary file in ``path``'s folder (made if missing), or OutputError saying why not."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            raise IsADirectoryError(21, "is a folder", str(path))
        return tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise _output_error(path, e) from None


def check_writable(path: str | Path) -> Path:
    """Fail now, with the error ``atomic_write_bytes`` would raise later, where ``path`` cannot be
    written: for an output written after long work (a search), so a bad path costs a second."""
    path = Path(path)
    fd, tmp = _temp_beside(path)
    os.close(fd)
    os.unlink(tmp)
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    path = Path(path)
    fd, tmp = _temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), _mode_for(path))    # mkstemp's 0600 would hide results from the group
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, OutputError):
            raise _output_error(path, e) from e
        raise
    return path


def atomic_folder(path: str | Path, write) -> Path:
    """``write(folder)`` into a temporary folder beside ``path``, then each file it wrote moved into
    ``path`` with ``os.replace`` (atomic per file): for writers that only take a folder, such as
    Hugging Face's ``save_pretrained``. Files of ``path`` that ``write`` does not write stay."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    except OSError as e:
        raise _output_error(path, e) from None
    try:
        write(tmp)
        for f in sorted(tmp.rglob("*")):
            target = path / f.relative_to(tmp)
            if f.is_dir():
                target.mkdir(exist_ok=True)
            else:
                os.chmod(f, _mode_for(target))
                os.replace(f, target)
    except OSError as e:
        raise _output_error(path, e) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _mode_for(path: Path) -> int:
    """An existing file's permissions, or what ``open()`` would give a new file under the umask."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_write_figure(path: str | Path, fig, dpi: int = 110) -> Path:
    """A matplotlib figure as PNG, written in one step (no half-written file); the figure is closed."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())


def write_results(out: str | Path, table, markdown: str) -> Path:
    """A benchmark's results: every column in ``out``.csv (a pandas DataFrame), the page in ``out``.md."""
    out = Path(out)
    atomic_write_text(out.with_suffix(".csv"), table.to_csv(index=False, float_format="%.6g"))
    return atomic_write_text(out.with_suffix(".md"), markdown)


def _output_error(path: Path, e: OSError) -> OutputError:
    reason = e.strerror or str(e) or type(e).__name__
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        reason = f"{blocker} is a file, not a folder"
    return OutputError(e.errno, f"cannot write {path}: {reason}; choose another path (a file in a writable "
                                f"folder) or free some space")


def read_json(path: str | Path, what: str, error: type[HarmonyOptError], hint: str, broken: str = ""):
    """The JSON value in ``path`` (``read_text``); text that is not JSON raises ``error`` naming the
    line, with ``broken`` (what to do about it) after it."""
    text = read_text(path, what, error, hint)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: line {e.lineno}: not valid JSON ({e.msg}){'; ' + broken if broken else ''}") from None


def read_text(path: str | Path, what: str, error: type[HarmonyOptError], hint: str) -> str:
    """The text of ``path``; a missing, unreadable or binary file raises ``error`` saying which and
    what to do (``hint``)."""
    path = Path(path)
    if not path.exists():
        raise error(f"{what} {path} does not exist; {hint}")
    if path.is_dir():
        raise error(f"{what} {path} is a folder, not a file; {hint}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {path}: not a text file (byte {e.start} is not UTF-8); {hint}") from None
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from None
