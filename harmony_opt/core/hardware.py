"""The machine a plan runs on: GPUs, memories and link bandwidths.

Constants carry their units (bytes, bytes/s) and their provenance, FlexGen-style.
Load a preset by name (``1080ti-x4``, ``h100-x1``) or a small TOML/JSON file with the
same field names; ``harmony-opt probe`` writes such a file for the real machine.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from pathlib import Path

from .errors import HardwareError
from .io import atomic_write_json, atomic_write_text, read_text
from .units import GB, GiB, parse_bytes


def usable_cores(most: int | None = None) -> int:
    """The CPU cores this process may run on (its affinity; all of them where the OS has none), at
    most ``most``: the planner's default process count and the runtime's host threads."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores if most is None else min(most, cores))


@dataclasses.dataclass(frozen=True)
class Hardware:
    """``servers`` identical servers of ``gpus // servers`` identical GPUs each, behind host links.

    Bandwidths are bytes/s per direction. With ``shared_host_link`` all GPUs of a server share one
    host<->GPU link (a PCIe switch): each transfer runs at ``h2d_bandwidth`` /
    ``d2h_bandwidth`` and at most ``link_bandwidth`` in total flows per direction. The link, host
    memory and pinned memory fields are per server; rank r runs on server ``r // gpus_per_server``,
    and GPUs on different servers exchange data at ``network_bandwidth`` (docs/scaling.md).

    ``d2h_bandwidth`` and at most ``link_bandwidth`` in total flows per direction.

    The execution terms after ``gpu_optimizer_bandwidth`` (docs/cost_model.md, "Execution terms")
    describe how the executor runs on the device: their defaults are neutral (CUDA streams overlap
    copies with compute, no fixed costs), so a description without them times plans as before, and
    ``to_dict`` leaves out those at their default.
    """

    name: str
    gpus: int
    gpu_memory_bytes: int            # usable per GPU: the memory cap the planner respects
    host_memory_bytes: int
    pinned_memory_bytes: int         # how much host memory may be page-locked
    h2d_bandwidth: float             # host -> GPU, one transfer, bytes/s
    d2h_bandwidth: float             # GPU -> host, one transfer, bytes/s
    shared_host_link: bool = True
    link_bandwidth: float | None = None   # total per direction through the shared link; None = h2d
    p2p_bandwidth: float = 0.0       # GPU <-> GPU, bytes/s (0: through host memory)
    host_copy_bandwidth: float = 16 * GiB   # host memory copies between processes, bytes/s
    cpu_optimizer_scale: float = 1.0   # multiplies the profile's cpu_update_s (other CPU than profiled)
    gpu_optimizer_bandwidth: float = 300 * GB  # bytes of 3 W + 2 K per second for an optimizer step on GPU
                                     # (W and dW read, W written, the state K read and written)
    copy_overlap: bool = True        # copies and GPU<->GPU transfers run beside compute (False: one at a time)
    h2d_latency_s: float = 0.0       # fixed seconds per host -> GPU transfer, on top of bytes / bandwidth
    d2h_latency_s: float = 0.0       # fixed seconds per GPU -> host transfer
    p2p_latency_s: float = 0.0       # fixed seconds per GPU -> GPU transfer (an activation handed between ranks)
    compute_scale: float = 1.0       # multiplies the profile's forward, backward and recompute times
    cpu_optimizer_call_s: float = 0.0   # fixed seconds per CPU optimizer step (one per backward pack and rank)
    gpu_optimizer_call_s: float = 0.0   # fixed seconds per optimizer step on the GPU (one per backward pack and rank)
    gpu_optimizer_tensor_s: float = 0.0  # and per parameter tensor it steps (the executor's per-parameter work)
    issue_overhead_s: float = 0.0    # fixed seconds per compute instruction (forward, recompute, backward, GPU step)
    collective_bandwidth: float | None = None   # bytes/s of the vDP gradient all-reduce; None = p2p_bandwidth
    collective_latency_s: float = 0.0   # fixed seconds per all-reduce call (one per backward pack and sweep)
    instruction_gap_s: float = 0.0   # of each fixed cost above, the executor's own time between instructions
                                     # that calibrate measured and added (the CPU device); not charged apart
    host_instruction_s: float = 0.0  # the host's seconds per instruction it issues, beyond a compute
                                     # instruction's kernels: a GPU step lasts at least the issuing thread's work
    description: str = ""
    servers: int = 1                 # identical servers; gpus must be a multiple
    network_bandwidth: float = 0.0   # between two servers, bytes/s per direction (required when servers > 1)

    def __post_init__(self):
        where = f"hardware {self.name!r}"
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise HardwareError(f"{where}: gpus must be a whole number >= 1, got {self.gpus!r}")
        for f in ("gpu_memory_bytes", "host_memory_bytes", "pinned_memory_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise HardwareError(f"{where}: {f} must be a positive number of bytes, got {v!r}")
        for f in ("h2d_bandwidth", "d2h_bandwidth", "host_copy_bandwidth", "gpu_optimizer_bandwidth"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
                raise HardwareError(f"{where}: {f} must be a positive finite bandwidth in bytes/s, got {v!r}")
        if self.link_bandwidth is not None and not self.link_bandwidth > 0:
            raise HardwareError(f"{where}: link_bandwidth must be positive, got {self.link_bandwidth!r}")
        if self.p2p_bandwidth < 0:
            raise HardwareError(f"{where}: p2p_bandwidth must be >= 0, got {self.p2p_bandwidth!r}")
        if not self.cpu_optimizer_scale > 0:
            raise HardwareError(f"{where}: cpu_optimizer_scale must be positive")
        if not isinstance(self.copy_overlap, bool):
            raise HardwareError(f"{where}: copy_overlap must be true or false, got {self.copy_overlap!r}")
        for f in ("h2d_latency_s", "d2h_latency_s", "p2p_latency_s", "cpu_optimizer_call_s", "gpu_optimizer_call_s",
                  "gpu_optimizer_tensor_s", "issue_overhead_s", "collective_latency_s", "instruction_gap_s",
                  "host_instruction_s"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise HardwareError(f"{where}: {f} must be a finite number of seconds >= 0, got {v!r}")
        v = self.compute_scale
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise HardwareError(f"{where}: compute_scale must be a finite number > 0, got {v!r}")
        v = self.collective_bandwidth
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
            raise HardwareError(f"{where}: collective_bandwidth must be a positive finite bandwidth in bytes/s "
                                f"(or left out: p2p_bandwidth), got {v!r}")
        if isinstance(self.servers, bool) or not isinstance(self.servers, int) or self.servers < 1:
            raise HardwareError(f"{where}: servers must be a whole number >= 1, got {self.servers!r}")
        if self.gpus % self.servers:
            raise HardwareError(f"{where}: gpus ({self.gpus}) must be a multiple of servers ({self.servers}): "
                                f"every server has the same number of GPUs")
        nb = self.network_bandwidth
        if not isinstance(nb, (int, float)) or nb < 0 or nb == float("inf"):
            raise HardwareError(f"{where}: network_bandwidth must be a finite bandwidth >= 0 in bytes/s, got {nb!r}")
        if self.servers > 1 and not nb > 0:
            raise HardwareError(f"{where}: {self.servers} servers need network_bandwidth (bytes/s per direction "
                                f"between two servers), e.g. network_bandwidth = 3125000000.0 for 25 GbE")
        if self.pinned_memory_bytes > self.host_memory_bytes:
            raise HardwareError(f"{where}: pinned_memory_bytes ({self.pinned_memory_bytes}) exceeds "
                                f"host_memory_bytes ({self.host_memory_bytes})")

    @property
    def link_slots(self) -> int:
        """How many transfers per direction can run at full speed at once on the shared link."""
        if not self.shared_host_link:
            return self.gpus
        total = self.link_bandwidth or max(self.h2d_bandwidth, self.d2h_bandwidth)
        return max(1, int(total // max(self.h2d_bandwidth, self.d2h_bandwidth) + 1e-9))

    # -- servers ----------------------------------------------------------------------------------
    @property
    def gpus_per_server(self) -> int:
        return self.gpus // self.servers

    def server_of(self, rank: int) -> int:
        """The server rank ``rank`` runs on: ranks fill the servers in order."""
        return rank // self.gpus_per_server

    def servers_used(self, gpus: int) -> int:
        """Servers that ranks 0 .. gpus-1 span."""
        return -(-gpus // self.gpus_per_server)

    def gpu_bandwidth(self, src: int, dst: int) -> float:
        """GPU<->GPU bytes/s from rank ``src`` to rank ``dst``: P2P inside a server, the network between."""
        return self.p2p_bandwidth if self.server_of(src) == self.server_of(dst) else self.network_bandwidth

    def can_allreduce(self, gpus: int) -> bool:
        """Whether ``gpus`` vDP replicas can all-reduce on GPU links: P2P inside every server that holds
        two or more of them, the network between servers."""
        if gpus < 2:
            return False
        inside = min(gpus, self.gpus_per_server) > 1
        return (not inside or self.p2p_bandwidth > 0) and (self.servers_used(gpus) == 1 or self.network_bandwidth > 0)

    def allreduce_time(self, nbytes, gpus: int):
        """Seconds to all-reduce ``nbytes`` (a number or an array) over ranks 0 .. gpus-1, hierarchically:
        a ring inside each server (reduce-scatter and all-gather, 2 (p-1)/p x nbytes per GPU at
        all_reduce_bandwidth, p ranks per server), between them a ring over the servers of each GPU's 1/p
        shard, the p shards sharing the server's network link (2 (S-1)/S x nbytes per server at
        network_bandwidth). On one server, the ring all-reduce. Each call also pays
        ``collective_latency_s`` (the executor makes one per pack)."""
        p, s = min(gpus, self.gpus_per_server), self.servers_used(gpus)
        t = 2 * (p - 1) / p * nbytes / self.all_reduce_bandwidth if p > 1 else 0 * nbytes
        if s > 1:
            t = t + 2 * (s - 1) / s * nbytes / self.network_bandwidth
        return t + self.collective_latency_s if p > 1 or s > 1 else t

    def gpu_step_time(self, weight_bytes, state_bytes, tensors):
        """Seconds of one optimizer step on the GPU over a pack of ``weight_bytes`` of weights in ``tensors``
        parameter tensors with ``state_bytes`` of optimizer state (numbers or arrays), before the
        instruction's issue overhead: the bytes it reads and writes, and the executor's fixed work per
        call and per parameter, which outweighs the bytes on small layers (``probe`` measures both)."""
        return ((3 * weight_bytes + 2 * state_bytes) / self.gpu_optimizer_bandwidth + self.gpu_optimizer_call_s
                + tensors * self.gpu_optimizer_tensor_s)

    def with_memory(self, cap_bytes: int) -> "Hardware":
        return dataclasses.replace(self, gpu_memory_bytes=int(cap_bytes))

    def with_gpus(self, n: int) -> "Hardware":
        """The first ``n`` GPUs: on several servers, whole servers (or part of the first)."""
        if n > self.gpus:
            raise HardwareError(f"hardware {self.name!r} has {self.gpus} GPU(s); {n} were asked for")
        per = self.gpus_per_server
        if self.servers > 1 and n > per and n % per:
            raise HardwareError(f"hardware {self.name!r} has {per} GPUs per server; ask for whole servers "
                                f"(a multiple of {per}) or at most {per}")
        return dataclasses.replace(self, gpus=int(n), servers=max(1, int(n) // per) if self.servers > 1 else 1)

    @property
    def all_reduce_bandwidth(self) -> float:
        """Bytes/s of the vDP gradient all-reduce: ``collective_bandwidth``, else the GPU link's."""
        return self.p2p_bandwidth if self.collective_bandwidth is None else self.collective_bandwidth

    @property
    def neutral_terms(self) -> bool:
        """Every execution term at its default: the simulator and the planner time plans as without them."""
        return all(getattr(self, k) == v for k, v in EXECUTION_TERMS.items())

    def without_execution_terms(self) -> "Hardware":
        """This hardware with every execution term at its neutral default: what Harmony's cost model,
        which has none of them, sees."""
        return self if self.neutral_terms else dataclasses.replace(self, **EXECUTION_TERMS)

    def to_dict(self) -> dict:
        """The fields, less the execution terms at their neutral default and, on one server without a
        network, ``servers`` and ``network_bandwidth``: files and the plans that record them read as
        before those fields existed."""
        d = {k: v for k, v in dataclasses.asdict(self).items()
             if not (k in EXECUTION_TERMS and v == EXECUTION_TERMS[k])}
        if self.servers == 1 and not self.network_bandwidth:
            del d["servers"], d["network_bandwidth"]
        return d

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        d = {k: v for k, v in self.to_dict().items() if v is not None}
        if path.suffix == ".json":
            return atomic_write_json(path, d)
        lines = ["# harmony-opt hardware description (bytes, bytes/s)"]
        for k, v in d.items():
            lines.append(f"{k} = {json.dumps(v)}")
        return atomic_write_text(path, "\n".join(lines) + "\n")

    @classmethod
    def from_dict(cls, d: dict, source: str = "<dict>") -> "Hardware":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise HardwareError(f"{source}: unknown field(s) {', '.join(unknown)}; valid fields: "
                                f"{', '.join(fields)}")
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.name != "name"]
        missing = [f for f in required if f not in d]
        if missing:
            raise HardwareError(f"{source}: missing field(s) {', '.join(missing)}")
        kw = dict(d)
        kw.setdefault("name", Path(source).stem)
        for k in ("gpu_memory_bytes", "host_memory_bytes", "pinned_memory_bytes"):
            try:
                kw[k] = parse_bytes(kw[k], k)
            except Exception as e:
                raise HardwareError(f"{source}: {e}") from None
        for k in ("h2d_bandwidth", "d2h_bandwidth", "link_bandwidth", "p2p_bandwidth", "host_copy_bandwidth",
                  "cpu_optimizer_scale", "gpu_optimizer_bandwidth", "h2d_latency_s", "d2h_latency_s",
                  "p2p_latency_s", "compute_scale", "cpu_optimizer_call_s", "gpu_optimizer_call_s",
                  "gpu_optimizer_tensor_s", "issue_overhead_s", "collective_bandwidth",
                  "collective_latency_s", "instruction_gap_s", "host_instruction_s", "network_bandwidth"):
            if kw.get(k) is not None and (isinstance(kw[k], bool) or not isinstance(kw[k], (int, float))):
                unit = "seconds" if k.endswith("_s") else "a factor" if k.endswith("scale") else "bytes/s"
                raise HardwareError(f"{source}: field {k} must be a number ({unit}), got {kw[k]!r}")
        if "copy_overlap" in kw and not isinstance(kw["copy_overlap"], bool):
            raise HardwareError(f"{source}: field copy_overlap must be true or false, got {kw['copy_overlap']!r}")
        for k in ("gpus", "servers"):
            if k in kw and (isinstance(kw[k], bool) or not isinstance(kw[k], int)):
                raise HardwareError(f"{source}: field {k} must be a whole number, got {kw[k]!r}")
        try:
            return cls(**kw)
        except HardwareError as e:
            raise HardwareError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> "Hardware":
        path = Path(path)
        text = read_text(path, "hardware file", HardwareError,
                         f"give a preset ({', '.join(PRESETS)}) or a .toml/.json file")
        try:
            d = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except json.JSONDecodeError as e:
            raise HardwareError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None
        except tomllib.TOMLDecodeError as e:
            raise HardwareError(f"{path}: not valid TOML ({e})") from None
        if not isinstance(d, dict):
            raise HardwareError(f"{path}: must hold a table of fields")
        return cls.from_dict(d, str(path))


#: The execution terms and their neutral defaults (Hardware's fields of the same names)
EXECUTION_TERMS: dict = {f.name: f.default for f in dataclasses.fields(Hardware)
                         if f.name in ("copy_overlap", "h2d_latency_s", "d2h_latency_s", "p2p_latency_s",
                                       "compute_scale", "cpu_optimizer_call_s", "gpu_optimizer_call_s",
                                       "gpu_optimizer_tensor_s", "issue_overhead_s",
                                       "collective_bandwidth", "collective_latency_s", "instruction_gap_s",
                                       "host_instruction_s")}


PRESETS: dict[str, Hardware] = {
    # The Harmony paper's server: 4 x GTX 1080 Ti (11 GB) behind one PCIe 3.0 switch.
    # Bandwidths are the original scheduler's constants (swap 11.5 GiB/s shared by all GPUs
    # of the switch, P2P 8.2 GiB/s, host messages 16 GiB/s); usable memory is its default
    # cap (10 GiB). Host memory is not stated in the paper; 256 GiB is assumed.
    "1080ti-x4": Hardware(
        name="1080ti-x4", gpus=4, gpu_memory_bytes=10 * GiB,
        host_memory_bytes=256 * GiB, pinned_memory_bytes=192 * GiB,
        h2d_bandwidth=11.5 * GiB, d2h_bandwidth=11.5 * GiB, shared_host_link=True,
        link_bandwidth=11.5 * GiB, p2p_bandwidth=8.2 * GiB, host_copy_bandwidth=16 * GiB,
        gpu_optimizer_bandwidth=300 * GB,
        description="Harmony paper server: 4x GTX 1080 Ti 11 GB, one PCIe 3.0 switch"),
    # One H100 80 GB SXM on PCIe Gen5 x16: ~50 GB/s pinned per direction is typical of
    # measurements (64 GB/s nominal). Replace with `harmony-opt probe` output for real runs.
    "h100-x1": Hardware(
        name="h100-x1", gpus=1, gpu_memory_bytes=76 * GiB,
        host_memory_bytes=128 * GiB, pinned_memory_bytes=96 * GiB,
        h2d_bandwidth=50 * GB, d2h_bandwidth=50 * GB, shared_host_link=True,
        link_bandwidth=50 * GB, p2p_bandwidth=0.0, host_copy_bandwidth=20 * GB,
        gpu_optimizer_bandwidth=2000 * GB,
        description="one NVIDIA H100 80 GB, PCIe Gen5 x16 (nominal figures)"),
}


def get_hardware(spec: str | Path | Hardware, memory_cap: int | str | None = None,
                 gpus: int | None = None) -> Hardware:
    """A preset name or a file path, with optional overrides of the cap and GPU count."""
    if isinstance(spec, Hardware):
        hw = spec
    elif str(spec).lower() in PRESETS:
        hw = PRESETS[str(spec).lower()]
    elif Path(spec).suffix in (".toml", ".json") or Path(spec).exists():
        hw = Hardware.load(spec)
    else:
        raise HardwareError(f"unknown hardware {str(spec)!r}; use a preset ({', '.join(PRESETS)}) "
                            f"or a .toml/.json file")
    if memory_cap is not None:
        hw = hw.with_memory(parse_bytes(memory_cap, "--memory-cap"))
    if gpus is not None:
        hw = hw.with_gpus(gpus)
    return hw


# -- variants of the paper's server, named by the experiments, the benchmarks and docs/scaling.md -----------
#: Host memory (and its pinnable part) of the server the GPT-2 scaling series plans on: more than the
#: preset's 256 GiB, which GPT-2 20B and larger outgrow
SCALING_HOST_MEMORY, SCALING_PINNED_MEMORY = 2 * 2**40, 3 * 2**39
#: 25 Gb/s Ethernet between two servers, bytes/s
INTER_SERVER_25GBE = 25e9 / 8


def scaling_hardware(base: str = "1080ti-x4") -> Hardware:
    """The paper's server with the host memory GPT-2 100B needs: 1.6 TiB (0.9 TiB pinned) for its
    weights, gradients, Adam state and stashed inputs (harmony_opt.sim.host_memory)."""
    return dataclasses.replace(get_hardware(base), name=f"{base}-2tib-host",
                               host_memory_bytes=SCALING_HOST_MEMORY, pinned_memory_bytes=SCALING_PINNED_MEMORY)


#: 100 Gb/s (InfiniBand EDR or 100 GbE) between two servers, bytes/s
INTER_SERVER_100G = 100e9 / 8


def multi_server_hardware(base: str = "1080ti-x4", servers: int = 2,
                          network_bandwidth: float = INTER_SERVER_25GBE) -> Hardware:
    """``servers`` copies of the preset (or file) ``base``, ``network_bandwidth`` bytes/s per direction
    between any two: each brings its own host link, host memory and pinned memory."""
    one = get_hardware(base)
    if servers == 1:
        return one
    return dataclasses.replace(
        one, name=f"{servers}x{one.name}-{network_bandwidth * 8 / 1e9:g}gbps", gpus=one.gpus * servers,
        servers=servers, network_bandwidth=float(network_bandwidth),
        description=f"{servers} x ({one.description or one.name}), {network_bandwidth * 8 / 1e9:g} Gb/s between them")


def two_server_hardware(base: str = "1080ti-x4") -> dict[str, Hardware]:
    """One paper server, and two of them at 25 GbE and at 100 Gb/s, by label."""
    return {f"1 server, {get_hardware(base).gpus} GPUs": get_hardware(base),
            "2 servers, 25 GbE": multi_server_hardware(base, 2, INTER_SERVER_25GBE),
            "2 servers, 100 Gb/s": multi_server_hardware(base, 2, INTER_SERVER_100G)}


# Two paper servers on 25 Gb/s Ethernet: each its own PCIe switch, host memory and pinned memory.
PRESETS["2x1080ti-x4"] = dataclasses.replace(multi_server_hardware("1080ti-x4", 2, INTER_SERVER_25GBE),
                                             name="2x1080ti-x4")
