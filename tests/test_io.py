"""Files the tool writes are replaced atomically: an interrupted write leaves the old file or none.

Two guards that every write goes through harmony_opt.core.io: a scanner of the source (every Python
file of the repository outside tests/, every form of writing a file that Python, numpy, pandas,
matplotlib, torch and the standard library offer), and a run of every writing command with
Python's ``open`` refusing to write."""
from __future__ import annotations

import ast
import builtins
import json
import os
import subprocess
from pathlib import Path

import pytest

from harmony_opt.core import io
from harmony_opt.cli import main
from harmony_opt.core.errors import HarmonyOptError, OutputError

from conftest import synthetic_profile

ROOT = Path(__file__).resolve().parent.parent


def test_interrupted_write_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "plan.json"
    io.atomic_write_text(target, "old\n")

    def interrupt(fd):
        raise KeyboardInterrupt     # as if the user pressed Ctrl-C after half the bytes were written
    monkeypatch.setattr(os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        io.atomic_write_bytes(target, b"new" * 100_000)
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_written_files_get_the_usual_permissions(tmp_path):
    """A new file is readable as open() would make it under the umask, not mkstemp's 0600;
    rewriting a file keeps the permissions its owner gave it."""
    mask = os.umask(0o022)
    try:
        new = io.atomic_write_text(tmp_path / "plan.json", "{}")
        assert new.stat().st_mode & 0o777 == 0o644
        new.chmod(0o640)
        io.atomic_write_text(new, "{ }")
        assert new.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(mask)


def test_interrupted_first_write_leaves_no_target(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        synthetic_profile(R=4).save(tmp_path / "prof")
    assert not any(p.is_file() for p in (tmp_path / "prof").iterdir())


def test_check_writable_fails_as_the_write_would_and_leaves_nothing(tmp_path):
    """The CLI checks an output path before a search with this; it must refuse what the write
    would refuse, in the same words, and leave the folder as it found it."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for bad in (blocker / "plan.json", tmp_path):
        with pytest.raises(OutputError) as checked:
            io.check_writable(bad)
        with pytest.raises(OutputError) as written:
            io.atomic_write_text(bad, "{}")
        assert str(checked.value) == str(written.value)
    good = tmp_path / "new" / "plan.json"
    assert io.check_writable(good) == good and not good.exists() and list(good.parent.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "new"]


def test_a_refused_write_is_a_one_line_user_error(tmp_path, monkeypatch):
    """Disk full, no permission, a folder or a file in the way: an OutputError (exit code 2 in the CLI)
    that is still an OSError, and no temporary file is left."""
    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OutputError) as e:
        io.atomic_write_text(tmp_path / "a.json", "x")
    assert isinstance(e.value, OSError) and isinstance(e.value, HarmonyOptError) and e.value.errno == 28
    assert str(e.value) == (f"cannot write {tmp_path / 'a.json'}: No space left on device; choose another path "
                            f"(a file in a writable folder) or free some space")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    (tmp_path / "f").write_text("a file")
    with pytest.raises(OutputError, match="f is a file, not a folder"):
        io.atomic_write_text(tmp_path / "f" / "b.json", "x")
    with pytest.raises(OutputError, match="is a folder"):
        io.atomic_write_text(tmp_path, "x")


def test_plan_save_goes_through_the_atomic_helper(tmp_path, monkeypatch):
    from harmony_opt.planners.baselines import plan_l2l
    from harmony_opt.core.hardware import get_hardware
    plan = plan_l2l(synthetic_profile(R=4), get_hardware("1080ti-x4"), 4, 10 * 2**30)
    calls = []
    real = io.atomic_write_bytes
    monkeypatch.setattr(io, "atomic_write_bytes", lambda p, d: calls.append(p) or real(p, d))
    plan.save(tmp_path / "p.json")
    assert calls == [tmp_path / "p.json"]


# -- the source scanner --------------------------------------------------------------------------------

#: calls that write a file when given a path (a name or expression that is not an in-memory buffer)
_WRITERS = {
    "to_csv", "to_parquet", "to_json", "to_pickle", "to_feather", "to_excel", "to_hdf", "to_html", "to_markdown",
    "to_latex", "to_xml", "to_stata", "to_orc", "to_string", "savefig", "imsave", "save", "savez",
    "savez_compressed", "savetxt", "tofile", "dump", "write_image", "write_html",
}
#: calls that write, copy or move files whatever their arguments
_ALWAYS = {"write_text", "write_bytes", "copy", "copy2", "copyfile", "copytree", "copyfileobj", "move", "rename",
           "replace", "mkstemp", "NamedTemporaryFile", "TemporaryFile", "mkfifo", "symlink_to", "hardlink_to",
           "link_to", "touch"}
#: names that also mean something else: a file operation only as os./shutil. calls, or Path.rename(target)
_AMBIGUOUS = {"copy", "replace", "rename"}
_NOT_FILES = {"str", "dict", "list", "tuple", "set"}     # str.replace, dict.copy, list.copy, ...


def _is_buffer(node: ast.AST) -> bool:
    """An in-memory buffer: a variable named *buf*, or io.BytesIO()/StringIO()."""
    if isinstance(node, ast.Name):
        return "buf" in node.id.lower()
    if isinstance(node, ast.Call):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        return name in ("BytesIO", "StringIO")
    return False


def _mode(call: ast.Call, position: int) -> str | None:
    """The literal mode of an open()-like call ('r' by default); None when it is not a literal."""
    node = next((k.value for k in call.keywords if k.arg == "mode"), None)
    if node is None and len(call.args) > position:
        node = call.args[position]
    if node is None:
        return "r"
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def write_calls(source: str) -> list[tuple[int, str]]:
    """(line, what) for every call in ``source`` that writes a file other than through harmony_opt.core.io."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        owner = f.value if isinstance(f, ast.Attribute) else None
        owner_name = getattr(owner, "id", None) or getattr(owner, "attr", None)
        if name in ("open", "fdopen"):
            # open(path, mode) / io.open / os.fdopen(fd, mode); Path(...).open(mode) has the mode first
            position = 0 if isinstance(f, ast.Attribute) and owner_name not in ("io", "os", "codecs") else 1
            if owner_name == "os" and name == "open":
                found.append((node.lineno, "os.open"))
                continue
            mode = _mode(node, position)
            if mode is None or set(mode) & set("wax+"):
                found.append((node.lineno, f"{name}(..., {mode!r})"))
        elif name in _ALWAYS:
            if name in _AMBIGUOUS and owner_name not in ("shutil", "os") and not (
                    name == "rename" and len(node.args) == 1 and not node.keywords
                    and not isinstance(node.args[0], ast.Dict)):
                continue    # str.replace, dict.copy, DataFrame.rename(columns=...)
            found.append((node.lineno, name))
        elif name in _WRITERS and owner is not None and owner_name not in _NOT_FILES:   # methods: df.to_csv(p)
            if name in ("save", "dump"):
                # torch.save(obj, f), np.save(f, a), json/pickle/yaml.dump(obj, f), image.save(f)
                target = node.args[1] if owner_name in ("torch", "json", "pickle", "yaml", "tomli_w") and \
                    len(node.args) > 1 else (node.args[0] if node.args else None)
                if owner_name in ("json", "pickle", "yaml", "tomli_w") and len(node.args) < 2:
                    continue        # dump(obj) with no file: returns the text
                if owner_name not in ("torch", "np", "numpy", "json", "pickle", "yaml", "tomli_w", "Image", "img",
                                      "image"):
                    continue        # Plan.save, Profile.save, ...: the tool's own savers, scanned themselves
            else:
                path_kw = next((k.value for k in node.keywords
                                if k.arg in ("path_or_buf", "path", "buf", "fname", "file", "excel_writer")), None)
                target = node.args[0] if node.args else path_kw
            if target is not None and not _is_buffer(target):
                found.append((node.lineno, name))
    return found


def test_scanner_finds_every_form_of_writing():
    bad = [
        'open(p, "w")', "open(p, 'ab')", 'open(p, mode="x")', 'open(p, "r+")', "open(p, mode)", 'io.open(p, "w")',
        'Path(p).open("w")', 'p.open(mode="wb")', 'os.fdopen(fd, "w")', "os.open(p, os.O_WRONLY | os.O_CREAT)",
        "p.write_text(s)", "p.write_bytes(b)", "df.to_csv(path)", "df.to_csv(\n    out / 'x.csv', index=False)",
        "df.to_parquet(p)", "df.to_json(path_or_buf=p)", "df.to_markdown(p)", "df.to_pickle(p)",
        "fig.savefig(p)", "plt.savefig('x.png')", "plt.imsave(p, a)", "torch.save(state, p)",
        "np.save(p, a)", "np.savez(p, a=a)", "np.savetxt(p, a)", "a.tofile(p)", "json.dump(d, f)",
        "pickle.dump(d, f)", "shutil.copy(a, b)", "shutil.move(a, b)", "shutil.copyfile(a, b)", "os.rename(a, b)",
        "tmp.rename(path)",
        "os.replace(a, b)", "tempfile.mkstemp()", "tempfile.NamedTemporaryFile(delete=False)", "p.touch()",
        "img.save(p)",
    ]
    for src in bad:
        assert write_calls(src), f"the scanner misses {src!r}"
    good = [
        'open("/proc/cpuinfo")', "open(p)", 'open(p, "rb")', 'p.open("r")', "df.to_csv(index=False)",
        "df.to_json()", "df.to_markdown(index=False)", 'fig.savefig(buf, format="png")', "torch.save(state, buf)",
        "df.to_parquet(io.BytesIO())", "json.dumps(d)", "json.dump(d)", "plan.save(path)", "s.replace('a', 'b')",
        "d.copy()", "text.replace(x, y)", "np.save(buf, a)", "df.to_string(index=False)",
        "df.rename(columns={'a': 'b'})", "df.rename({'a': 'b'}, axis=1)", "to_markdown(df)",
    ]
    for src in good:
        assert not write_calls(src), f"the scanner flags {src!r}"


def _python_files():
    """Every Python file of the repository outside tests/, as git sees it (tracked or not ignored)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        files = [ROOT / f for f in out.stdout.split()]
    else:       # not a git checkout (an sdist): walk the tree
        files = [f for f in ROOT.rglob("*.py") if not {".venv", "build", "dist"} & set(f.parts)]
    return sorted(f for f in files if f.exists() and f.relative_to(ROOT).parts[0] != "tests")


def test_no_module_writes_files_around_the_atomic_helpers():
    files = _python_files()
    folders = {f.relative_to(ROOT).parts[0] for f in files}
    assert {"harmony_opt", "runtime", "solver_models", "benchmarks", "experiments"} <= folders
    offenders = []
    for f in files:
        if f == ROOT / "harmony_opt" / "core" / "io.py":
            continue
        offenders += [f"{f.relative_to(ROOT)}:{n}: {what}" for n, what in write_calls(f.read_text())]
    assert not offenders, "write through harmony_opt.core.io instead:\n" + "\n".join(offenders)


# -- every writing command, with open() refusing to write ----------------------------------------------

@pytest.fixture
def no_direct_writes(monkeypatch, tmp_path):
    """builtins.open (also io.open, and pandas, torch and matplotlib's route to a path) refuses to write
    under ``tmp_path``, where the commands below put their outputs."""
    real = builtins.open

    def guarded(file, mode="r", *a, **kw):
        if (isinstance(file, (str, os.PathLike)) and set(mode) & set("wax+")
                and Path(file).resolve().is_relative_to(tmp_path.resolve())):
            raise AssertionError(f"direct write to {file} (mode {mode!r}); use harmony_opt.core.io")
        return real(file, mode, *a, **kw)
    monkeypatch.setattr(builtins, "open", guarded)
    import io as stdio
    monkeypatch.setattr(stdio, "open", guarded)


def test_every_writing_command_goes_through_the_atomic_helpers(tmp_path, capsys, no_direct_writes, monkeypatch):
    written = []            # every rename of a finished temporary onto its target (io.atomic_write_bytes)
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: written.append(Path(dst).name) or real(src, dst))
    t = tmp_path
    plan = {"version": 1, "planner": "manual", "mode": "vPP", "gpus": 1, "batch": 4,
            "microbatch": {"fwd": 2, "bwd": 1}, "packs": {"fwd": [[0, 2], [3, 4]], "bwd": [[0, 2], [3, 4], [5, 7]]},
            "num_layers": 8, "memory_cap": 10**8, "profile": {"name": "gpt2-tiny"}}
    io.atomic_write_json(t / "tiny.json", plan)
    commands = [
        ["baseline", "--planner", "l2l", "--profile", "gpt2_medium", "--batch", "8", "--gpus", "2",
         "-o", t / "l2l.json"],
        ["simulate", t / "l2l.json", "--trace", t / "trace.json", "--plot", t / "gantt.png"],
        ["show", "gpt2_medium", "--plot", t / "layers.png"],
        ["compare", "--profile", "gpt2_medium", "--batch", "4", "--gpus", "1", "--time-limit", "1",
         "-o", t / "compare.csv", "--plot", t / "compare.png"],
        ["compile", t / "tiny.json", "-o", t / "program.json", "--model", "gpt2-tiny"],
        ["run", t / "tiny.json", "--model", "gpt2-tiny", "--steps", "1", "--checkpoint", t / "ck", "--no-progress"],
        ["profile", "gpt2-tiny", "--device", "cpu", "-u", "1", "-o", t / "prof", "--repeats", "1", "--warmup", "0",
         "--no-progress", "--set", "n_layer=1"],
        ["probe", "--device", "cpu", "-o", t / "hw.toml", "--sizes", "1MiB", "--repeats", "1"],
    ]
    for argv in commands:
        rc = main([str(a) for a in argv])
        assert rc == 0, (argv, capsys.readouterr().err)
    assert {"l2l.json", "trace.json", "gantt.png", "layers.png", "compare.csv", "compare.png", "program.json",
            "checkpoint.pt", "layers.csv", "microbatch.csv", "meta.json", "hw.toml"} <= set(written)
    assert json.loads((t / "l2l.json").read_text())["planner"] == "l2l"
    assert not [p for p in t.rglob("*.tmp")]          # no temporary left anywhere
