"""Per-layer profiles: loading, validation, and O(1) pack-cost queries.

A Profile is two tables (DESIGN.md):

* ``layers``: one row per layer: ``layer, param_bytes, buffer_bytes,
  optimizer_state_bytes, cpu_update_s``, and optionally ``param_tensors``,
  ``buffer_tensors`` and ``optimizer_state_tensors`` (how many tensors those bytes are in,
  which the CUDA caching allocator rounds one by one; see :attr:`Profile.alloc_granularity`),
  and in a bf16 profile ``cast_bytes``: the bf16 copies of the layer's weights that autocast
  makes for its forward, which a recompute's graph keeps once per microbatch (whatever its
  size) and which ``saved_bytes`` (and ``saved_tensors``) include.
* ``microbatch``: one row per (phase, microbatch size, layer): ``phase`` (FWD or
  BWD; BWD includes the recompute of the forward), ``microbatch``, ``layer``,
  ``gpu_time_s``, ``peak_memory_bytes``, ``input_bytes``, and optionally
  ``saved_bytes`` (activations autograd keeps for the layer's backward, used by
  the stash-instead-of-recompute option), ``saved_storage_bytes`` (the same, each
  storage once, as a recompute's graph holds them), ``saved_input_bytes`` and
  ``saved_output_bytes`` (how many of those are the layer's own input, which a
  recompute shares with the input the runtime holds anyway, and its output, which
  the next layer of a pack may save again), ``saved_tensors`` (how many tensors those are),
  ``stash_time_s`` (the phase's time on the stash-instead-of-recompute path: FWD the forward
  that records its graph for the backward, BWD the backward from that graph without a
  recompute; :meth:`Profile.stash_forward_extra`, :meth:`Profile.stashed_backward`).

plus ``meta.json`` (``precision``: "fp32", or "bf16" for a profile measured under bf16 autocast,
:mod:`harmony_opt.core.precision`; absent means fp32). Every quantity of a contiguous pack ``[a, b]`` (inclusive) at a
microbatch size ``u`` is answered in O(1) from prefix sums computed once per
``(phase, u)`` with numpy (:class:`PhaseCosts`).

Interpolation follows Harmony's scheduler exactly (HARMONY_REFERENCE.md 1.2):
times and peak memory are interpolated linearly per layer between profiled sizes
(memory truncated to int); input bytes are proportional to ``u``, scaled from the
first profiled size.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd

from .errors import ProfileError, UsageError, first_line
from .precision import PRECISIONS
from .io import atomic_write_bytes, atomic_write_text, read_json
from .units import alloc_granularity

PHASES = ("FWD", "BWD")

LAYER_COLUMNS = {
    "layer": "int",
    "param_bytes": "int",
    "buffer_bytes": "int",
    "optimizer_state_bytes": "int",
    "cpu_update_s": "float",
}
MICROBATCH_COLUMNS = {
    "phase": "str",
    "microbatch": "int",
    "layer": "int",
    "gpu_time_s": "float",
    "peak_memory_bytes": "int",
    "input_bytes": "int",
}
#: How many tensors a layer's weights, buffers and optimizer state are in (all three or none).
TENSOR_COUNT_COLUMNS = {"param_tensors": "int", "buffer_tensors": "int", "optimizer_state_tensors": "int"}
OPTIONAL_LAYER_COLUMNS = {**TENSOR_COUNT_COLUMNS, "cast_bytes": "int"}
OPTIONAL_MICROBATCH_COLUMNS = {"saved_bytes": "int", "saved_storage_bytes": "int", "saved_input_bytes": "int",
                               "saved_output_bytes": "int", "saved_tensors": "int", "stash_time_s": "float"}
_RECOMPUTE_COLUMNS = ("saved_storage_bytes", "saved_input_bytes", "saved_output_bytes")

#: Anything above this is not a per-layer quantity of a real model (1 PB); it flags unit mistakes.
_MAX_BYTES = 10**15
#: A single layer taking more than a day per microbatch is a unit mistake (ms or us given as s).
_MAX_SECONDS = 86_400.0


@dataclasses.dataclass(frozen=True)
class PhaseCosts:
    """Per-layer costs of one phase at one microbatch size, with prefix sums.

    ``time[l]`` seconds, ``memory[l]`` peak bytes of layer ``l`` alone, ``input[l]``
    bytes of layer ``l``'s input activation (``input[R] = 0``: the loss has no output).
    For BWD, ``time`` includes the recompute (Harmony's convention).
    """

    phase: str
    u: int
    time: np.ndarray
    memory: np.ndarray
    input: np.ndarray
    saved: np.ndarray
    _pt: np.ndarray = dataclasses.field(repr=False)
    _pm: np.ndarray = dataclasses.field(repr=False)
    _px: np.ndarray = dataclasses.field(repr=False)
    _ps: np.ndarray = dataclasses.field(repr=False)
    stash: np.ndarray | None = None     # per layer, the phase's time on the stash path, where measured

    @classmethod
    def build(cls, phase: str, u: int, time, memory, inputs, saved, stash=None) -> "PhaseCosts":
        z = np.zeros(1)
        return cls(
            phase, u, time, memory, inputs, saved,
            np.concatenate([z, np.cumsum(time)]),
            np.concatenate([[0], np.cumsum(memory)]).astype(np.int64),
            np.concatenate([[0], np.cumsum(inputs)]).astype(np.int64),
            np.concatenate([[0], np.cumsum(saved)]).astype(np.int64),
            stash,
        )

    @property
    def num_layers(self) -> int:
        return len(self.time)

    # Each query accepts ints or numpy arrays of the same shape (vectorized over packs).
    def pack_time(self, a, b):
        """Sum of layer times over [a, b]."""
        return self._pt[np.add(b, 1)] - self._pt[a]

    def pack_memory(self, a, b):
        """Harmony's compute memory of a pack: sum of peaks minus the inner layers' inputs
        (each is also the previous layer's output, counted twice otherwise)."""
        return (self._pm[np.add(b, 1)] - self._pm[a]) - (self._px[np.add(b, 1)] - self._px[np.add(a, 1)])

    def pack_saved(self, a, b):
        """Activation bytes autograd keeps for the backward of [a, b] (stash option)."""
        return self._ps[np.add(b, 1)] - self._ps[a]

    def input_bytes(self, layer):
        """Bytes of the input of ``layer`` (``layer = R`` gives 0)."""
        return self.input[layer]

    def inputs_sum(self, a, b):
        """Sum of the input bytes of layers a..b."""
        return self._px[np.add(b, 1)] - self._px[a]


@dataclasses.dataclass(frozen=True, eq=False)
class Profile:
    """Measured per-layer costs of one model on one device (see module docstring)."""

    name: str
    layers: pd.DataFrame
    microbatch: pd.DataFrame
    meta: dict
    source: str = "<memory>"

    # -- construction -----------------------------------------------------------------
    def __post_init__(self):
        _validate(self.layers, self.microbatch, self.source)
        precision = self.meta.get("precision", "fp32")
        if precision not in PRECISIONS:
            raise ProfileError(f"{self.source}/meta.json: precision {precision!r} is not one of "
                               f"{', '.join(PRECISIONS)}")
        R = len(self.layers)
        lay = self.layers.sort_values("layer")
        # parameter tensors: as counted, or (a profile without the counts, such as Harmony's) one per
        # layer with parameters
        tensors = lay["param_tensors"].to_numpy(np.int64) if "param_tensors" in lay \
            else (lay["param_bytes"].to_numpy() > 0).astype(np.int64)
        object.__setattr__(self, "_static", {
            **{c: np.concatenate([[0], np.cumsum(lay[c].to_numpy())])
               for c in ("param_bytes", "buffer_bytes", "optimizer_state_bytes", "cpu_update_s")},
            "param_tensors": np.concatenate([[0], np.cumsum(tensors)]),
        })
        tables = {}
        for phase in PHASES:
            rows = self.microbatch[self.microbatch["phase"] == phase]
            sizes = np.array(sorted(rows["microbatch"].unique()), dtype=np.int64)
            piv = rows.pivot(index="microbatch", columns="layer")
            get = lambda col, dtype: piv[col].reindex(index=sizes, columns=range(R)).to_numpy(dtype)  # noqa: E731
            saved = get("saved_bytes", np.float64) if "saved_bytes" in rows else None
            tables[phase] = (sizes, get("gpu_time_s", np.float64),
                             get("peak_memory_bytes", np.float64), get("input_bytes", np.int64), saved)
        object.__setattr__(self, "_tables", tables)
        stash = {}
        for phase in PHASES:
            rows = self.microbatch[self.microbatch["phase"] == phase]
            stash[phase] = None if "stash_time_s" not in rows else rows.pivot(
                index="microbatch", columns="layer", values="stash_time_s").reindex(
                index=tables[phase][0], columns=range(R)).to_numpy(np.float64)
        object.__setattr__(self, "_stash", stash)
        bwd = self.microbatch[self.microbatch["phase"] == "BWD"]
        recompute = None
        if set(_RECOMPUTE_COLUMNS) <= set(bwd):
            piv = bwd.pivot(index="microbatch", columns="layer")
            recompute = tuple(piv[c].reindex(index=tables["BWD"][0], columns=range(R)).to_numpy(np.float64)
                              for c in _RECOMPUTE_COLUMNS)
        object.__setattr__(self, "_recompute_saved", recompute)
        object.__setattr__(self, "_cache", {})

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def sizes(self, phase: str) -> np.ndarray:
        """Profiled microbatch sizes of a phase, ascending."""
        return self._tables[_phase(phase)][0]

    def size_range(self, phase: str) -> tuple[int, int]:
        s = self.sizes(phase)
        return int(s[0]), int(s[-1])

    @property
    def precision(self) -> str:
        """"fp32", or "bf16" for a profile measured under bf16 autocast (core.precision)."""
        return self.meta.get("precision", "fp32")

    def cast_bytes(self) -> np.ndarray:
        """Per layer: the bf16 weight copies autocast keeps in a recompute's graph, once per
        microbatch (zeros for an fp32 profile)."""
        lay = self.layers.sort_values("layer")
        if "cast_bytes" not in lay:
            return np.zeros(self.num_layers, dtype=np.int64)
        return lay["cast_bytes"].to_numpy(np.int64)

    @property
    def has_saved_bytes(self) -> bool:
        return self._tables["BWD"][4] is not None

    @functools.cached_property
    def identity(self) -> str:
        """Short content hash: plans record it so a plan is never applied to another profile. Hashed
        from the values themselves (numbers as float64, text as UTF-8), not with pandas' hashing,
        which changes between pandas versions: a plan made on one machine must load on another."""
        h = hashlib.sha256()
        for frame in (self.layers, self.microbatch):
            for name in frame.columns:
                col = frame[name]
                h.update(f"{name}\0".encode())
                if pd.api.types.is_numeric_dtype(col):
                    h.update(np.ascontiguousarray(col.to_numpy(np.float64)).tobytes())
                else:
                    h.update(("\x1f".join(map(str, col)) + "\0").encode())
        return h.hexdigest()[:16]

    def with_compute_scale(self, scale: float) -> "Profile":
        """This profile with every forward and backward time multiplied by ``scale``
        (``Hardware.compute_scale``), for the models that time kernels from it; itself at 1. Only
        what ``costs`` returns is scaled (the frames and the identity are this profile's)."""
        if scale == 1:
            return self
        key = ("compute_scale", float(scale))
        scaled = self._cache.get(key)
        if scaled is None:
            scaled = copy.copy(self)
            object.__setattr__(scaled, "_tables", {ph: (sizes, t * scale, *rest)
                                                   for ph, (sizes, t, *rest) in self._tables.items()})
            object.__setattr__(scaled, "_stash", {ph: None if t is None else t * scale
                                                  for ph, t in self._stash.items()})
            object.__setattr__(scaled, "_cache", {})
            self._cache[key] = scaled
        return scaled

    # -- per-(phase, u) costs -----------------------------------------------------------
    def costs(self, phase: str, u: int) -> PhaseCosts:
        """Per-layer costs and prefix sums at microbatch ``u`` (cached)."""
        key = (_phase(phase), int(u))
        c = self._cache.get(key)
        if c is None:
            c = self._cache[key] = self._costs(*key)
        return c

    def _costs(self, phase: str, u: int) -> PhaseCosts:
        sizes, t, m, x, s = self._tables[phase]
        lo, hi = int(sizes[0]), int(sizes[-1])
        if not lo <= u <= hi:
            raise ProfileError(
                f"{self.name}: microbatch {u} is outside the profiled {phase} range {lo}..{hi}; "
                f"choose a size in that range or profile more sizes")
        st = self._stash[phase]
        k = int(np.searchsorted(sizes, u))
        if sizes[k] == u:
            time, mem = t[k].copy(), m[k]
            saved = s[k] if s is not None else None
            stash = st[k].copy() if st is not None else None
        else:
            # Same arithmetic as numpy.interp, vectorized over layers (bit-identical results).
            x0, x1 = sizes[k - 1], sizes[k]
            lerp = lambda a: (a[k] - a[k - 1]) / (x1 - x0) * (u - x0) + a[k - 1]  # noqa: E731
            time, mem = lerp(t), lerp(m)
            saved = lerp(s) if s is not None else None
            stash = lerp(st) if st is not None else None
        memory = np.trunc(mem).astype(np.int64)
        inputs = np.append(self.input_bytes_at(u), 0).astype(np.int64)
        if saved is None:
            saved_b = _estimate_saved(self, phase, u, memory, inputs)
        else:
            saved_b = np.trunc(saved).astype(np.int64)
        return PhaseCosts.build(phase, u, time, memory + self._peak_pad(phase), inputs, saved_b, stash)

    # -- the stash path ------------------------------------------------------------------------
    @property
    def has_stash_times(self) -> bool:
        """Whether the profile measured each phase on the stash path (``stash_time_s``)."""
        return all(t is not None for t in self._stash.values())

    def stash_forward_extra(self, u: int) -> np.ndarray:
        """Per layer, at forward microbatch ``u``: what the forward of a stashed layer costs beyond the
        plain forward (its graph, the saved-tensor hooks), at least 0; zeros where not measured."""
        key = ("stash_forward_extra", int(u))
        if key not in self._cache:
            c = self.costs("FWD", u)
            self._cache[key] = np.zeros(self.num_layers) if not self.has_stash_times \
                else np.maximum(c.stash - c.time, 0.0)
        return self._cache[key]

    def stashed_backward(self, u: int) -> np.ndarray:
        """Per layer, at backward microbatch ``u``: the backward of a stashed layer, without a recompute.
        As measured where the profile has stash times; else the backward less the forward (at the
        nearest profiled forward size), negative where a layer's backward measured less than its
        forward: a stashed pack costs the sum over its layers, at least 0 (``stashed_backward_time``)."""
        key = ("stashed_backward", int(u))
        if key not in self._cache:
            if self.has_stash_times:
                self._cache[key] = self.costs("BWD", u).stash
            else:
                self._cache[key] = self.costs("BWD", u).time - self._recomputed(u).time
        return self._cache[key]

    def stashed_backward_time(self, u: int, a, b):
        """The backward of a stashed pack [a, b] at microbatch ``u`` (ints or arrays): the sum of
        ``stashed_backward`` over its layers, at least 0."""
        if self.has_stash_times:
            key = ("stashed_backward_prefix", int(u))
            if key not in self._cache:
                self._cache[key] = np.concatenate([[0.0], np.cumsum(self.stashed_backward(u))])
            prefix = self._cache[key]
            return np.maximum(prefix[np.add(b, 1)] - prefix[a], 0.0)
        return np.maximum(self.costs("BWD", u).pack_time(a, b) - self._recomputed(u).pack_time(a, b), 0.0)

    def recompute_split(self, u: int, a, b):
        """(recompute, rest) of a recomputing backward microbatch of ``u`` samples over pack [a, b]
        (ints or arrays): the rest is its backward without the recompute (``stashed_backward_time``, at
        most the whole), the recompute what is left of the whole. The simulator plays them as two
        events where the microbatch's output gradient comes from another rank."""
        whole = self.costs("BWD", u).pack_time(a, b)
        rest = np.minimum(self.stashed_backward_time(u, a, b), whole)
        return whole - rest, rest

    def _recomputed(self, u: int) -> PhaseCosts:
        """The forward costs a backward microbatch of ``u`` samples recomputes: at the nearest profiled
        forward size."""
        lo, hi = self.size_range("FWD")
        return self.costs("FWD", int(np.clip(u, lo, hi)))

    # -- the allocator's rounding ------------------------------------------------------------
    @property
    def has_tensor_counts(self) -> bool:
        """Whether the layers table says how many tensors each layer's bytes are in."""
        return set(TENSOR_COUNT_COLUMNS) <= set(self.layers)

    @property
    def alloc_granularity(self) -> int:
        """Bytes the target device's allocator rounds each tensor up to, for the plans of this profile:
        ``meta["alloc_granularity"]`` where set (512 plans a CPU-made profile for a GPU:
        :meth:`with_alloc_granularity`), else that of the device it was measured on (512 for CUDA,
        1 for the CPU), and 1 (the bytes as they are) for a profile without tensor counts, such as
        Harmony's."""
        g = self.meta.get("alloc_granularity")
        if g is not None:
            if isinstance(g, bool) or not isinstance(g, int) or g < 1:
                raise ProfileError(f"{self.source}: meta alloc_granularity must be a whole number of bytes >= 1, "
                                   f"got {g!r}")
            return g
        if not self.has_tensor_counts:
            return 1
        try:
            return alloc_granularity(self.meta.get("device_type", "cpu"))
        except UsageError:
            raise ProfileError(f"{self.source}: meta device_type {self.meta.get('device_type')!r} is not cpu or "
                               f"cuda; set alloc_granularity in meta.json") from None

    def with_alloc_granularity(self, granularity: int) -> "Profile":
        """This profile, planned for a device whose allocator rounds each tensor up to ``granularity``."""
        return dataclasses.replace(self, meta={**self.meta, "alloc_granularity": int(granularity)})

    def tensor_counts(self) -> dict[str, np.ndarray]:
        """Per layer, how many tensors its weights, buffers, optimizer state and (the most over the
        profiled backward sizes) saved activations are in; empty without the counts."""
        return self._tensor_counts

    @functools.cached_property
    def _tensor_counts(self) -> dict[str, np.ndarray]:
        if not self.has_tensor_counts:
            return {}
        lay = self.layers.sort_values("layer")
        out = {c: lay[c].to_numpy(np.int64) for c in TENSOR_COUNT_COLUMNS}
        bwd = self.microbatch[self.microbatch["phase"] == "BWD"]
        if "saved_tensors" in bwd:
            out["saved_tensors"] = (bwd.groupby("layer")["saved_tensors"].max()
                                    .reindex(range(self.num_layers), fill_value=0).to_numpy(np.int64))
        return out

    def alloc_pads(self, granularity: int | None = None) -> dict:
        """The rounding fields of :class:`~harmony_opt.compile.program.LayerBytes` at ``granularity``
        (default: :attr:`alloc_granularity`): ``granularity - 1`` bytes per tensor, an upper bound."""
        g = self.alloc_granularity if granularity is None else int(granularity)
        counts = self.tensor_counts()
        if g <= 1 or not counts:
            return {"granularity": max(g, 1)}
        pads = {f: tuple(int(n) * (g - 1) for n in counts[c]) for f, c in
                (("weights_pad", "param_tensors"), ("buffers_pad", "buffer_tensors"),
                 ("optimizer_pad", "optimizer_state_tensors"))}
        saved = tuple(int(n) for n in counts["saved_tensors"]) if "saved_tensors" in counts else ()
        return {"granularity": g, **pads, "saved_tensors": saved}

    def pad_bytes(self, what: str, a: int, b: int) -> int:
        """What rounding adds to the ``what`` tensors ("optimizer" state, "saved" activations of one
        microbatch) of layers [a, b]: ``(alloc_granularity - 1)`` per tensor; 0 without counts."""
        g = self.alloc_granularity
        col = {"optimizer": "optimizer_state_tensors", "saved": "saved_tensors"}[what]
        counts = self.tensor_counts().get(col) if g > 1 else None
        return 0 if counts is None else int(counts[a:b + 1].sum()) * (g - 1)

    def _peak_pad(self, phase: str) -> np.ndarray | int:
        """Rounding added to each layer's peak where the peak is not the CUDA allocator's own
        (``torch.cuda.max_memory_allocated`` counts rounded blocks already) but a CPU profile's exact
        estimate planned for a rounding device: ``granularity - 1`` for each of its tensors (weights,
        buffers, input, output; in the forward of a bf16 profile also autocast's weight copies, at most
        one per weight, an upper bound; in the backward also dW, the saved activations, which hold
        those copies, and dX)."""
        g = self.alloc_granularity
        if g <= 1 or self.meta.get("device_type") == "cuda" or not self.has_tensor_counts:
            return 0
        c = self.tensor_counts()
        n = c["param_tensors"] + c["buffer_tensors"] + 2
        if phase == "FWD" and self.cast_bytes().any():
            n = n + c["param_tensors"]
        if phase == "BWD":
            n = n + c["param_tensors"] + c.get("saved_tensors", 0) + 1
        return n * (g - 1)

    def recompute_saved_at(self, u: int) -> tuple[np.ndarray, ...] | None:
        """Per layer at microbatch ``u``: the saved activations' storages and how many of those bytes
        are the layer's own input and output (``saved_storage_bytes``, ``saved_input_bytes``,
        ``saved_output_bytes``, interpolated like the other columns); None where the profile does
        not have them."""
        if self._recompute_saved is None:
            return None
        sizes = self._tables["BWD"][0]
        return tuple(np.array([np.interp(u, sizes, col[:, l]) for l in range(self.num_layers)])
                     for col in self._recompute_saved)

    def input_bytes_at(self, u: int) -> np.ndarray:
        """Input activation bytes of every layer at microbatch ``u`` (shape [R])."""
        sizes, _, _, x, _ = self._tables["FWD"]
        k = int(np.searchsorted(sizes, u))
        if k < len(sizes) and sizes[k] == u:
            return x[k]
        return x[0] * int(u) // int(sizes[0])

    # -- static (u-independent) pack quantities -------------------------------------------
    def _static_sum(self, col, a, b):
        p = self._static[col]
        return p[np.add(b, 1)] - p[a]

    def param_bytes(self, a, b):
        """Parameter bytes W of [a, b]; the gradient dW has the same size."""
        return self._static_sum("param_bytes", a, b)

    grad_bytes = param_bytes

    def buffer_bytes(self, a, b):
        return self._static_sum("buffer_bytes", a, b)

    def optimizer_bytes(self, a, b):
        return self._static_sum("optimizer_state_bytes", a, b)

    def cpu_update_time(self, a, b):
        return self._static_sum("cpu_update_s", a, b)

    def param_tensor_count(self, a, b):
        """Parameter tensors of [a, b] (what an optimizer step loops over): as counted, or one per
        layer with parameters where the profile does not count them."""
        return self._static_sum("param_tensors", a, b)

    # Convenience wrappers used in docs and tests.
    def fwd_time(self, a: int, b: int, u: int) -> float:
        return float(self.costs("FWD", u).pack_time(a, b))

    def bwd_time(self, a: int, b: int, u: int) -> float:
        """Recompute plus backward time of [a, b] at ``u``."""
        return float(self.costs("BWD", u).pack_time(a, b))

    def peak_memory(self, phase: str, a: int, b: int, u: int) -> int:
        return int(self.costs(phase, u).pack_memory(a, b))

    def totals(self) -> dict:
        R = self.num_layers - 1
        return {
            "layers": self.num_layers,
            "param_bytes": int(self.param_bytes(0, R)),
            "buffer_bytes": int(self.buffer_bytes(0, R)),
            "optimizer_state_bytes": int(self.optimizer_bytes(0, R)),
            "cpu_update_s": float(self.cpu_update_time(0, R)),
        }

    # -- persistence ------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """Load a profile folder (CSV or Parquet tables, optional meta.json)."""
        path = Path(path)
        if not path.is_dir():
            raise ProfileError(f"profile folder {path} does not exist; give a bundled name "
                               f"(see `harmony-opt profiles`) or a folder with layers.csv and microbatch.csv")
        layers = _read_table(path, "layers", LAYER_COLUMNS, OPTIONAL_LAYER_COLUMNS)
        micro = _read_table(path, "microbatch", MICROBATCH_COLUMNS, OPTIONAL_MICROBATCH_COLUMNS)
        meta_path = path / "meta.json"
        meta = {}
        if meta_path.exists():
            meta = read_json(meta_path, "profile metadata", ProfileError, "fix or delete meta.json")
            if not isinstance(meta, dict):
                raise ProfileError(f"{meta_path}: must hold a JSON object")
        name = str(meta.get("model", path.name))
        return cls(name, layers, micro, meta, source=str(path))

    def save(self, path: str | Path, fmt: str = "csv") -> Path:
        """Write the profile folder atomically (each file through a temporary and a rename)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if fmt == "csv":
            atomic_write_text(path / "layers.csv", self.layers.to_csv(index=False))
            atomic_write_text(path / "microbatch.csv", self.microbatch.to_csv(index=False))
        elif fmt == "parquet":
            import io
            for nm, df in (("layers", self.layers), ("microbatch", self.microbatch)):
                buf = io.BytesIO()
                df.to_parquet(buf, index=False)
                atomic_write_bytes(path / f"{nm}.parquet", buf.getvalue())
        else:
            raise ProfileError(f"unknown profile format {fmt!r}; use csv or parquet")
        atomic_write_text(path / "meta.json", json.dumps({**self.meta, "model": self.name}, indent=2) + "\n")
        return path


def _phase(phase: str) -> str:
    p = str(phase).upper()
    if p not in PHASES:
        raise ProfileError(f"unknown phase {phase!r}; use FWD or BWD")
    return p


def _estimate_saved(profile: Profile, phase: str, u: int, memory: np.ndarray, inputs: np.ndarray) -> np.ndarray:
    """Activation bytes autograd saves per layer, when the profile did not measure them.

    Estimated as the BWD peak minus the FWD peak at the same size, less the weight gradients
    (the backward's extra memory is dW and what the forward saved), never less than the
    layer's input. At a size only one phase profiled (Harmony's profiles go to larger forward
    sizes), the estimate at the nearest size both profiled, scaled by size: activations grow
    with the microbatch, and the layer's input alone would undercount a large forward
    microbatch's stash some twentyfold.
    Profiles made by ``harmony-opt profile`` measure it instead (``saved_bytes``).
    """
    fwd_lo, fwd_hi = profile.size_range("FWD")
    bwd_lo, bwd_hi = profile.size_range("BWD")
    lo, hi = max(fwd_lo, bwd_lo), min(fwd_hi, bwd_hi)
    if lo > hi:
        return inputs[:-1].copy()
    if not lo <= u <= hi:
        near = int(np.clip(u, lo, hi))
        scaled = np.trunc(profile.costs(phase, near).saved * (u / near)).astype(np.int64)
        return np.maximum(scaled, inputs[:-1])
    other = "BWD" if phase == "FWD" else "FWD"
    om = profile._tables[other]
    sizes, _, m, _, _ = om
    k = int(np.searchsorted(sizes, u))
    if sizes[k] == u:
        other_mem = m[k]
    else:
        x0, x1 = sizes[k - 1], sizes[k]
        other_mem = (m[k] - m[k - 1]) / (x1 - x0) * (u - x0) + m[k - 1]
    bwd_mem, fwd_mem = (memory, other_mem) if phase == "BWD" else (other_mem, memory)
    grads = np.diff(profile._static["param_bytes"])        # the backward's peak holds dW as well
    est = np.maximum(np.asarray(bwd_mem, dtype=np.float64) - np.asarray(fwd_mem, dtype=np.float64) - grads, 0)
    return np.maximum(np.trunc(est).astype(np.int64), inputs[:-1])


def _read_table(folder: Path, stem: str, columns: dict, optional: dict | None = None) -> pd.DataFrame:
    csv, pq = folder / f"{stem}.csv", folder / f"{stem}.parquet"
    if csv.exists():
        f = csv
        try:
            df = pd.read_csv(csv, dtype=str, keep_default_na=False)
        except pd.errors.EmptyDataError:
            raise ProfileError(f"{csv}: the file is empty; it needs a header row with columns "
                               f"{', '.join(columns)}") from None
        except (pd.errors.ParserError, UnicodeDecodeError) as e:
            raise ProfileError(f"{csv}: cannot parse as CSV ({str(e).strip().splitlines()[-1]})") from None
        except OSError as e:
            raise ProfileError(f"{csv}: cannot read ({e.strerror or e})") from None
    elif pq.exists():
        f = pq
        try:
            df = pd.read_parquet(pq).astype(str)
        except Exception as e:  # pyarrow raises many types for corrupt files
            raise ProfileError(f"{pq}: cannot read as Parquet ({first_line(e)})") from None
    else:
        raise ProfileError(f"{folder}: no {stem}.csv or {stem}.parquet; a profile folder needs both "
                           f"layers and microbatch tables")
    df.columns = [str(c).strip() for c in df.columns]
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ProfileError(f"{f}: missing column(s) {', '.join(missing)}; expected {', '.join(columns)}")
    if df.empty:
        raise ProfileError(f"{f}: the table has a header but no rows")
    out = {}
    all_cols = dict(columns)
    all_cols.update({c: t for c, t in (optional or {}).items() if c in df.columns})
    for col, kind in all_cols.items():
        s = df[col].str.strip()
        if kind == "str":
            out[col] = s.str.upper()
            continue
        num = _numbers(s)
        bad = num.isna() | ~np.isfinite(num.fillna(0).to_numpy(dtype=float))
        if bad.any():
            i = int(np.flatnonzero(bad.to_numpy())[0])
            raise ProfileError(f"{f}: row {i + 2}, column {col}: {df[col].iloc[i]!r} is not a finite number")
        if (num < 0).any():
            i = int(np.flatnonzero((num < 0).to_numpy())[0])
            raise ProfileError(f"{f}: row {i + 2}, column {col}: negative value {num.iloc[i]}; "
                               f"times and sizes must be >= 0")
        if kind == "int":
            frac = num != np.floor(num)
            if frac.any():
                i = int(np.flatnonzero(frac.to_numpy())[0])
                raise ProfileError(f"{f}: row {i + 2}, column {col}: {df[col].iloc[i]!r} must be a whole "
                                   f"number ({'bytes' if col.endswith('bytes') else 'an index or size'})")
            out[col] = num.astype(np.int64)
        else:
            out[col] = num.astype(np.float64)
    table = pd.DataFrame(out)
    table.attrs["source"] = str(f)
    return table


def _numbers(s: pd.Series) -> pd.Series:
    """Text to float64 with Python's correctly rounded ``float`` (NaN where it is not a number):
    pandas' parsers may differ from it by a unit in the last place, from one pandas version to the
    next, and a profile must read as the same numbers on every machine (Profile.identity)."""
    def number(x: str) -> float:
        try:
            return float(x)
        except ValueError:
            return np.nan
    values = s.to_list()
    try:                    # every entry a number: one pass without a call per entry
        parsed = [float(x) for x in values]
    except ValueError:
        parsed = [number(x) for x in values]
    # float() also reads "1_000"; pandas never did, and a profile should not either
    return pd.Series(parsed, index=s.index, dtype=np.float64).mask(s.str.contains("_", regex=False))


def _validate(layers: pd.DataFrame, micro: pd.DataFrame, source: str) -> None:
    """Check the cross-row rules the per-column parsing cannot see."""
    lf = layers.attrs.get("source", f"{source}/layers")
    mf = micro.attrs.get("source", f"{source}/microbatch")
    for col in LAYER_COLUMNS:
        if col not in layers:
            raise ProfileError(f"{lf}: missing column {col}")
    for col in MICROBATCH_COLUMNS:
        if col not in micro:
            raise ProfileError(f"{mf}: missing column {col}")
    if len(layers) == 0:
        raise ProfileError(f"{lf}: no layers")
    idx = layers["layer"].to_numpy()
    dup = pd.Series(idx).duplicated()
    if dup.any():
        i = int(np.flatnonzero(dup.to_numpy())[0])
        raise ProfileError(f"{lf}: row {i + 2}, column layer: layer {idx[i]} appears twice; each layer once")
    R = len(idx)
    expected = np.arange(R)
    srt = np.sort(idx)
    if not np.array_equal(srt, expected):
        gap = int(expected[np.flatnonzero(srt != expected)[0]])
        raise ProfileError(f"{lf}: column layer: layer indices must be 0..{R - 1} with no gaps; "
                           f"layer {gap} is missing")
    for col, limit, unit in (("param_bytes", _MAX_BYTES, "bytes"), ("buffer_bytes", _MAX_BYTES, "bytes"),
                             ("optimizer_state_bytes", _MAX_BYTES, "bytes"), ("cpu_update_s", _MAX_SECONDS, "s")):
        over = layers[col].to_numpy() > limit
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise ProfileError(f"{lf}: row {i + 2}, column {col}: {layers[col].iloc[i]:g} {unit} is implausibly "
                               f"large for one layer; check the units (bytes and seconds)")
    phases = set(micro["phase"].unique())
    unknown = phases - set(PHASES)
    if unknown:
        i = int(np.flatnonzero(micro["phase"].isin(unknown).to_numpy())[0])
        raise ProfileError(f"{mf}: row {i + 2}, column phase: {micro['phase'].iloc[i]!r} is not FWD or BWD")
    for phase in PHASES:
        if phase not in phases:
            raise ProfileError(f"{mf}: no rows for phase {phase}; profile at least one microbatch size per phase")
    for col, limit, unit in (("peak_memory_bytes", _MAX_BYTES, "bytes"), ("input_bytes", _MAX_BYTES, "bytes"),
                             ("gpu_time_s", _MAX_SECONDS, "s"), ("stash_time_s", _MAX_SECONDS, "s")):
        if col not in micro:
            continue
        if col == "stash_time_s" and micro[col].isna().any():
            i = int(np.flatnonzero(micro[col].isna().to_numpy())[0])
            raise ProfileError(f"{mf}: row {i + 2}, column {col}: missing; a profile with stash times needs one "
                               f"in every row (or drop the column)")
        over = micro[col].to_numpy() > limit
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise ProfileError(f"{mf}: row {i + 2}, column {col}: {micro[col].iloc[i]:g} {unit} is implausibly "
                               f"large for one layer; check the units (bytes and seconds)")
    if (micro["microbatch"] < 1).any():
        i = int(np.flatnonzero((micro["microbatch"] < 1).to_numpy())[0])
        raise ProfileError(f"{mf}: row {i + 2}, column microbatch: sizes start at 1")
    out_of_range = ~micro["layer"].isin(expected)
    if out_of_range.any():
        i = int(np.flatnonzero(out_of_range.to_numpy())[0])
        raise ProfileError(f"{mf}: row {i + 2}, column layer: layer {micro['layer'].iloc[i]} is not in "
                           f"layers (0..{R - 1})")
    key = micro[["phase", "microbatch", "layer"]]
    dup = key.duplicated()
    if dup.any():
        i = int(np.flatnonzero(dup.to_numpy())[0])
        r = micro.iloc[i]
        raise ProfileError(f"{mf}: row {i + 2}: ({r['phase']}, microbatch {r['microbatch']}, layer {r['layer']}) "
                           f"appears twice")
    counts = micro.groupby(["phase", "microbatch"])["layer"].nunique()
    short = counts[counts != R]
    if len(short):
        (phase, u), n = short.index[0], short.iloc[0]
        have = set(micro[(micro.phase == phase) & (micro.microbatch == u)]["layer"])
        miss = sorted(set(range(R)) - have)[:5]
        raise ProfileError(f"{mf}: phase {phase}, microbatch {u} has {n} of {R} layers (missing layer(s) "
                           f"{', '.join(map(str, miss))}); every profiled size needs every layer")
    # A layer's peak includes its own weights and buffers; a smaller peak is a unit mistake (MB for bytes).
    resident = (layers.set_index("layer")["param_bytes"] + layers.set_index("layer")["buffer_bytes"])
    below = micro["peak_memory_bytes"].to_numpy() < resident.reindex(micro["layer"]).to_numpy()
    if below.any():
        i = int(np.flatnonzero(below)[0])
        r = micro.iloc[i]
        raise ProfileError(f"{mf}: row {i + 2}, column peak_memory_bytes: {r['peak_memory_bytes']} bytes is less than "
                           f"layer {r['layer']}'s own parameters and buffers ({resident[r['layer']]} bytes); "
                           f"check the units (bytes)")
    fwd = micro[micro.phase == "FWD"].pivot(index="microbatch", columns="layer", values="input_bytes")
    shrink = np.diff(fwd.to_numpy(), axis=0) < 0
    if shrink.any():
        u, l = np.argwhere(shrink)[0]
        raise ProfileError(f"{mf}: column input_bytes: layer {fwd.columns[l]}'s input shrinks from microbatch "
                           f"{fwd.index[u]} to {fwd.index[u + 1]}; activation sizes must grow with the size")
