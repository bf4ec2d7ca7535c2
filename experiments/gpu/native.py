"""The two baselines that are not plans: PyTorch's own offload, and DeepSpeed's.

* ``torch-offload``: FSDP2 (``fully_shard``, one process) with ``CPUOffloadPolicy``: every
  layer's parameters live pinned on the host, are copied in for its forward and again for
  its backward, and its gradients go back to the host, where the optimizer steps; every
  activation autograd saves goes to pinned host memory too (``save_on_cpu``), so the GPU
  holds about one layer at a time. Microbatches accumulate gradients. This is what a
  PyTorch user gets without a planner.
* ``deepspeed``: ZeRO stage 3 with parameters and optimizer state offloaded to the CPU
  (ZeRO-Offload/Infinity), the same ``save_on_cpu`` for activations, fp32, a
  ``torch.optim`` client optimizer (no compiled DeepSpeed op is needed).

Both step the same optimizer as the executor's runs (``runtime.optim.make_factory``).

Both return per-step times and bytes moved. Activation bytes are counted by the hooks;
parameter and gradient bytes follow FSDP's and ZeRO-3's rule (each layer's parameters in
for the forward and again for the backward, gradients out once, per microbatch).
"""
from __future__ import annotations

import os
import socket
import time

import torch
from torch import nn

from harmony_opt.measure.decompose import run_layers
from harmony_opt.runtime.optim import make_factory


class Chain(nn.Module):
    """A LayeredModel's layers as one module, so that a wrapper sees one forward."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x, y):
        return run_layers(list(self.layers), x, y)


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """``torch.autograd.graph.save_on_cpu(pin_memory=True)`` that also counts the bytes it moves."""

    def __init__(self, device: torch.device):
        self.h2d = self.d2h = 0
        cuda = device.type == "cuda"

        def pack(t: torch.Tensor):
            if not cuda or not t.is_cuda:
                return (t.device, t)
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
            host.copy_(t)
            self.d2h += t.numel() * t.element_size()
            return (t.device, host)

        def unpack(packed):
            dev, t = packed
            if t.device == dev:
                return t
            self.h2d += t.numel() * t.element_size()
            return t.to(dev, non_blocking=True)

        super().__init__(pack, unpack)


def _init_single_process_group(backend: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group(backend, rank=0, world_size=1)


def _param_bytes(layers) -> int:
    return sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())


def _traffic(hooks: OffloadActivations, weights: int, microbatches: int, steps: int) -> dict:
    """Bytes over the host link in ``steps`` steps: the activations the hooks moved, and per
    microbatch each layer's parameters in twice (forward, backward) and its gradients out once."""
    return {"bytes_h2d": hooks.h2d + 2 * weights * microbatches * steps,
            "bytes_d2h": hooks.d2h + weights * microbatches * steps}


def _loop(step_fn, batches, micro: int, device, hooks: OffloadActivations, warmup: int, budget_s: float):
    """Run the minibatches as microbatches of ``micro``; return per-step seconds. Stops early once
    at least 3 steps after ``warmup`` took ``budget_s`` seconds."""
    times = []
    for x, y in batches:
        if len(times) >= warmup + 3 and sum(times[warmup:]) > budget_s:
            break
        torch.cuda.synchronize() if device.type == "cuda" else None
        t0 = time.perf_counter()
        step_fn(x, y, micro, hooks)
        torch.cuda.synchronize() if device.type == "cuda" else None
        times.append(time.perf_counter() - t0)
    return times


def _microbatches(x, y, micro):
    D = x.shape[0]
    for lo in range(0, D, micro):
        yield x[lo:lo + micro], y[lo:lo + micro], min(micro, D - lo) / D


def train_torch_offload(model, batches, micro: int, device: torch.device, optimizer: str, lr: float, *,
                        warmup: int = 0, budget_s: float = float("inf")) -> dict:
    """FSDP2 + CPUOffloadPolicy + save_on_cpu on one GPU (on the CPU: plain accumulation, for tests)."""
    W = _param_bytes(model.layers)
    chain = Chain(model.layers)
    if device.type == "cuda":
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        _init_single_process_group("nccl")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (1,))
        policy = CPUOffloadPolicy(pin_memory=True)
        for layer in chain.layers:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh, offload_policy=policy)
        fully_shard(chain, mesh=mesh, offload_policy=policy)
    opt = make_factory(optimizer, lr)([p for p in chain.parameters() if p.requires_grad])
    losses = []

    def step(x, y, m, hooks):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xm, ym, share in _microbatches(x, y, m):
            with hooks:
                loss = chain(xm.to(device, non_blocking=True), ym.to(device, non_blocking=True)) * share
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)

    hooks = OffloadActivations(device)
    times = _loop(step, batches, micro, device, hooks, warmup, budget_s)
    moved = (_traffic(hooks, W, -(-batches[0][0].shape[0] // micro), len(times)) if device.type == "cuda"
             else {"bytes_h2d": 0, "bytes_d2h": 0})     # on the CPU nothing crosses a host link
    return {"times": times, "losses": losses, **moved}


def train_deepspeed(model, batches, micro: int, device: torch.device, optimizer: str, lr: float, *,
                    warmup: int = 0, budget_s: float = float("inf")) -> dict:
    """DeepSpeed ZeRO-3 with parameter and optimizer offload to the CPU, fp32, activations on the CPU."""
    if device.type != "cuda":
        raise RuntimeError("DeepSpeed's ZeRO offload needs CUDA")
    import deepspeed

    _init_single_process_group("nccl")
    W = _param_bytes(model.layers)
    chain = Chain(model.layers)
    D = batches[0][0].shape[0]
    config = {
        "train_batch_size": D, "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": D // micro,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
    }
    opt = make_factory(optimizer, lr)([p for p in chain.parameters() if p.requires_grad])
    engine, _, _, _ = deepspeed.initialize(model=chain, optimizer=opt, config=config)
    losses = []

    def step(x, y, m, hooks):
        total = 0.0
        for xm, ym, _share in _microbatches(x, y, m):
            with hooks:
                loss = engine(xm.to(device), ym.to(device))
            engine.backward(loss)
            engine.step()
            total += float(loss.detach()) * xm.shape[0] / x.shape[0]
        losses.append(total)

    hooks = OffloadActivations(device)
    times = _loop(step, batches, micro, device, hooks, warmup, budget_s)
    return {"times": times, "losses": losses, **_traffic(hooks, W, D // micro, len(times))}
