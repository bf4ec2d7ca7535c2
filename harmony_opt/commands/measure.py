"""`harmony-opt profile` (measure a model's layers) and `harmony-opt probe` (measure the machine).

::

    harmony-opt profile gpt2-xl --device cuda --microbatch 1,2,4,8 -o profiles/gpt2_xl_h100
    harmony-opt profile gpt2-tiny --device cpu --microbatch 1-9:4 --set n_layer=2 -o /tmp/tiny
    harmony-opt profile my_model.py:build --set width=256 -o /tmp/mine
    harmony-opt profile gpt2-tiny --device cpu --precision bf16 -o /tmp/tiny_bf16
    harmony-opt probe -o hardware.toml
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from ..core.errors import UsageError
from .common import MODEL_HELP, writable_file, writable_folder, written

_RANGE = re.compile(r"^(\d+)(?:-(\d+)(?::(\d+))?)?$")


def register(sub):
    p = sub.add_parser("profile", help="measure a model's layers on this machine and write a profile folder")
    p.add_argument("model", help=MODEL_HELP + "; built-in: gpt2-medium, gpt2-xl, bert-large, bert-96, vgg416, "
                                 "resnet1026, gpt2-tiny, bert-tiny, vgg-tiny, resnet-tiny")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available, else cpu")
    p.add_argument("--microbatch", "-u", default="1,2,4",
                   help="sizes to measure: a comma list of N or A-B or A-B:STEP (default 1,2,4)")
    p.add_argument("-o", "--output", required=True, help="profile folder to write")
    p.add_argument("--repeats", type=int, default=5,
                   help="fewest timed runs per measurement (default 5); the median of the runs is kept, outliers "
                        "dropped")
    p.add_argument("--max-repeats", type=int, default=None,
                   help="most timed runs per measurement, until the median settles (default 4 x --repeats)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before them (default 1)")
    add_threads(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the input batches")
    add_precision(p, "measure in (default fp32): bf16 runs every forward and backward under bf16 autocast "
                     "with fp32 weights, as `run` then trains the plans made from the profile")
    add_overrides(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_profile)

    q = sub.add_parser("probe", help="measure transfers (latency + bandwidth), the CPU optimizer's cost per call, "
                                     "the executor's dispatch cost, copy/compute overlap and memory, through the "
                                     "executor's code; write a hardware file")
    q.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when available, else cpu (the executor's CPU swaps: for testing and CPU runs)")
    q.add_argument("-o", "--output", required=True, help="hardware file to write (.toml, or .json)")
    q.add_argument("--sizes", default=None,
                   help="transfer sizes, e.g. 64KiB,1MiB,16MiB,256MiB (the default on a GPU; on the CPU "
                        "4KiB,16KiB,64KiB,1MiB,16MiB); each at 1, 4 and 16 tensors")
    q.add_argument("--repeats", type=int, default=5,
                   help="timed runs of each measurement, the fastest kept (default 5)")
    add_threads(q)
    q.set_defaults(func=_probe)


def _profile(args):
    from ..measure.models import resolve_model
    from ..measure.profiler import check_sizes, profile_model, resolve_device

    device = resolve_device(args.device or _default_device())
    sizes = check_sizes(parse_microbatches(args.microbatch))
    overrides = parse_overrides(args.overrides)
    model = resolve_model(args.model, seed=args.seed, trust_remote_code=args.trust_remote_code, **overrides)    # a bad --model: refused before -o is made
    existed = Path(args.output).exists()
    out = writable_folder(args.output)
    try:
        prof = profile_model(model, sizes, str(device), repeats=args.repeats, max_repeats=args.max_repeats,
                             warmup=args.warmup, threads=args.threads, progress=not args.no_progress, seed=args.seed,
                             precision=args.precision or "fp32")
    except BaseException:
        if not existed and not any(out.iterdir()):
            out.rmdir()         # made for this profile, which failed: not left behind empty
        raise
    written(prof.save, out, f"the profile to {out}")
    print(f"wrote {out}: {prof.name}, {prof.num_layers} layers, microbatch {', '.join(map(str, prof.sizes('FWD')))}"
          f" on {prof.meta['device']}, {prof.meta['threads']} intra-op thread(s)"
          + (f", {prof.precision}" if prof.precision != "fp32" else ""))
    for note in prof.meta.get("skipped", []):
        print(f"note: {note}")
    for line in prof.meta.get("warnings", []):
        print(f"warning: {line}")


def _probe(args):
    from ..measure.probe import probe_hardware, probe_summary
    from ..core.units import parse_bytes

    path = writable_file(args.output)
    sizes = None if args.sizes is None else tuple(
        parse_bytes(s, "--sizes") for s in args.sizes.split(",") if s.strip())
    if sizes == () or args.repeats < 1 or (sizes and min(sizes) < 1):
        raise UsageError("--sizes needs at least one size and --repeats must be >= 1")
    hw = probe_hardware(args.device or _default_device(), sizes, repeats=args.repeats, threads=args.threads)
    written(hw.save, path, f"the hardware file {path}")
    print(f"wrote {path}: {probe_summary(hw)}")


def add_precision(p, what: str) -> None:
    from ..core.precision import PRECISIONS
    p.add_argument("--precision", choices=PRECISIONS, default=None, help="precision to " + what)


def add_threads(p) -> None:
    """``--threads N``: intra-op threads while measuring; the default is what the executor's rank uses."""
    p.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                   help="intra-op threads while measuring (default: as the executor runs one rank on this "
                        "device: the usable cores, two fewer with a GPU); recorded in the output")


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise UsageError(f"--threads: expected a whole number >= 1, got {text!r}")
    return n


def parse_microbatches(text: str) -> list[int]:
    """``1,2,4`` or ``1-9:4`` (1, 5, 9) or a mix; sizes ascending, each once."""
    sizes: set[int] = set()
    for token in str(text).split(","):
        m = _RANGE.match(token.strip())
        if not m:
            raise UsageError(f"--microbatch: cannot read {token.strip()!r} in {text!r}; write sizes like 1,2,4 "
                             f"or a range like 1-9:4")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        step = int(m.group(3)) if m.group(3) else 1
        if lo < 1 or hi < lo or step < 1:
            raise UsageError(f"--microbatch: {token.strip()!r} is not a range of sizes >= 1 (A-B:STEP with "
                             f"1 <= A <= B, STEP >= 1)")
        sizes.update(range(lo, hi + 1, step))
    return sorted(sizes)


def add_overrides(p, also: str = "") -> None:
    """The ``--set KEY=VALUE`` option (repeatable) of every command that builds a built-in model; read
    it with :func:`parse_overrides`."""
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the model's spec, e.g. --set n_layer=2 --set sequence_length=512"
                        + also)
    p.add_argument("--trust-remote-code", action="store_true",
                   help="a Hugging Face model folder may run the code it ships (transformers' trust_remote_code); "
                        "off by default: a folder is data")


def parse_overrides(items: list[str]) -> dict:
    """``["n_layer=2", "norm=batch", "stages=[1,1]"]`` -> dict; values read as Python literals, else strings."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set {item!r}: write KEY=VALUE, e.g. --set n_layer=2")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
