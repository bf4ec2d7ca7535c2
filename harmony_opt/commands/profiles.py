"""`harmony-opt profiles` and `harmony-opt show`."""
from __future__ import annotations

from pathlib import Path

from ..core.bundled import bundled_names, load_profile
from ..report import layer_table, plot_profile, profiles_table


def register(sub):
    p = sub.add_parser("profiles", help="list the bundled profiles")
    p.set_defaults(func=_profiles)
    s = sub.add_parser("show", help="per-layer table of a profile, and a PNG of per-layer time and memory")
    s.add_argument("profile", help="bundled profile name or profile folder")
    s.add_argument("--microbatch", "-u", type=int, default=None,
                   help="microbatch size of the table (default: the smallest profiled)")
    s.add_argument("--plot", metavar="PNG", default=None, help="write the per-layer figure here")
    s.set_defaults(func=_show)


def _profiles(args):
    df = profiles_table([load_profile(n) for n in bundled_names()])
    print(df.to_string(index=False))


def _show(args):
    prof = load_profile(args.profile)
    u = int(prof.sizes("BWD")[0]) if args.microbatch is None else args.microbatch
    df = layer_table(prof, u)
    bf16 = f", {prof.precision}" if prof.precision != "fp32" else ""
    print(f"{prof.name}: {prof.num_layers} layers, microbatch {u}  ({prof.meta.get('device', 'device unknown')}{bf16})")
    print(df.to_string(index=False))
    from ..measure.flags import profile_warnings
    for line in profile_warnings(prof):
        print(f"warning: {line}")
    if args.plot:
        out = plot_profile(prof, u, Path(args.plot))
        print(f"wrote {out}")
