"""`harmony-opt check FILE`: load and validate a profile, hardware, plan or program file.

The loaders are the ones every other command uses, so a file that passes here will not
be refused later for its shape; a profile's suspicious times are printed as warnings, one
line each (``measure.flags``: they do not make it invalid); a plan is also checked against its profile and memory
cap when they can be found, and a program is replayed by the program validator.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..core.errors import PlanError, ProgramError, UsageError
from .common import plan_profile


def register(sub):
    c = sub.add_parser("check", help="validate a profile folder, hardware file, plan or program")
    c.add_argument("path", help="profile folder, hardware .toml/.json, plan .json or program .json")
    c.add_argument("--profile", default=None, help="plans: check against this profile (default: the plan's)")
    c.add_argument("--hardware", default=None, help="plans: check against this hardware (default: the plan's)")
    c.add_argument("--memory-cap", default=None, help="plans and programs: bytes per GPU to check against")
    c.set_defaults(func=_check)


def _kind(path: Path) -> str:
    """What a file holds, from its shape: a folder is a profile, TOML is hardware, JSON by its keys."""
    if path.is_dir():
        return "profile"
    if path.suffix == ".toml":
        return "hardware"
    if path.suffix != ".json":
        raise UsageError(f"{path}: expected a profile folder or a .toml/.json file")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "plan"            # the plan loader words the parse error
    if isinstance(d, dict) and "ranks" in d:
        return "program"
    if isinstance(d, dict) and not {"packs", "planner", "microbatch"} & set(d):
        return "hardware"
    return "plan"


def _check(args):
    from ..core.units import parse_bytes
    path = Path(args.path)
    if not path.exists():
        raise UsageError(f"{path} does not exist")
    cap = parse_bytes(args.memory_cap, "--memory-cap") if args.memory_cap else None
    kind = _kind(path)
    if kind == "profile":
        from ..core.profile import Profile
        p = Profile.load(path)
        print(f"ok: profile {p.name}, {p.num_layers} layers, FWD sizes {p.sizes('FWD').tolist()}, "
              f"BWD sizes {p.sizes('BWD').tolist()}")
        from ..measure.flags import profile_warnings
        for line in profile_warnings(p):
            print(f"warning: {line}")
    elif kind == "hardware":
        from ..core.hardware import Hardware
        hw = Hardware.load(path)
        print(f"ok: hardware {hw.name}, {hw.gpus} GPU(s), {hw.gpu_memory_bytes} bytes each"
              + (f", on {hw.servers} servers ({hw.network_bandwidth:g} bytes/s between two)" if hw.servers > 1 else ""))
    elif kind == "program":
        from ..compile.program import Program
        from ..compile.validate import validate_program
        prog = Program.load(path)
        try:
            stats = validate_program(prog, cap_bytes=cap)
        except ProgramError as e:
            raise ProgramError(f"{path}: {e}") from None
        print(f"ok: program for {prog.gpus} rank(s), {sum(stats.instructions)} instructions")
    else:
        _check_plan(path, args, cap)


def _check_plan(path: Path, args, cap):
    from ..core.hardware import Hardware, get_hardware
    from ..core.plan import Plan
    from ..sim.simulator import check_memory
    plan = Plan.load(path)
    pname = args.profile or plan.profile.get("name")
    hw = get_hardware(args.hardware) if args.hardware else (
        Hardware.from_dict(plan.hardware, f"{path}: hardware") if plan.hardware else None)
    try:
        plan.check_against(None, hw)
        if pname:
            profile = plan_profile(plan, path, args.profile)
            plan.check_against(profile, hw)
            cap = cap or plan.memory_cap or (hw.gpu_memory_bytes if hw else None)
            if cap:
                check_memory(plan, profile, cap)
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from None
    print(f"ok: {plan.planner} plan, {plan.mode} on {plan.gpus} GPU(s), {len(plan.packs_fwd)} forward + "
          f"{len(plan.packs_bwd)} backward packs" + ("" if pname else " (no profile to check against)"))
