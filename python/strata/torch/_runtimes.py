"""The Runtimes strata.torch makes: for a device ("cpu": the host backend, "cuda": the CUDA
backend) and budgets, with an NVMe tier in the directory given or, without one, a few MiB of
swap in a private temporary directory removed with the runtime (mapped weights and host-homed
states never use it, but the NVMe tier owns the io engine that reads files)."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Any, Union

import torch

from .._errors import UnsupportedError
from .._runtime import Runtime

Budget = Union[str, int]

PAGE_BYTES = 4096
"""A tier places a tensor in whole pages: what it takes of a budget is its bytes rounded up."""


def in_pages(nbytes: int) -> int:
    """`nbytes` rounded up to whole pages, as a tier's budget counts them."""
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


# The NVMe stripe of the optimizers' and training's runtimes. on_stripes bounds what a tensor
# takes of the swap: an extent of a stripe or more starts on one; a smaller one shares a stripe
# (Note [Small extents] in io/src/swap_space.cpp), so the bound is loose for biases and norms.
STATE_STRIPE = 256 << 10


def on_stripes(nbytes: int) -> int:
    """`nbytes` rounded up to whole STATE_STRIPEs: at most what an extent takes of the swap."""
    return -(-nbytes // STATE_STRIPE) * STATE_STRIPE


# Note [Consumers' kernels]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# A lease's bytes may be given to another tensor as soon as the lease is released, and the
# runtime's CUDA streams are non-blocking: nothing orders its next copy into that room after the
# kernels torch queued on its own stream that still read (or write) the leased bytes. So on CUDA
# a device lease whose bytes kernels use is released only once those kernels have run: after
# consumer_done() (the stream's synchronize), or an event recorded after them. On the host
# backend every op on a lease's bytes has run when it returns.
def consumer_done(device: torch.device) -> None:
    """Returns once the kernels queued on `device`'s current stream have run (Note [Consumers'
    kernels]); at once for a CPU device."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


_SCRATCH: weakref.WeakSet[Runtime] = weakref.WeakSet()  # runtimes whose NVMe tier is scratch


def has_nvme_tier(runtime: Runtime) -> bool:
    """True when `runtime`'s NVMe tier is real swap space (an nvme_dir was given), not the few
    MiB of scratch runtime_with_nvme() makes without one."""
    return runtime not in _SCRATCH and runtime.stats()["tiers"]["Nvme"]["capacity_bytes"] > 0


def runtime_with_nvme(
    config: dict[str, Any],
    nvme_dir: str | os.PathLike[str] | None,
    nvme_capacity: Budget,
    stripe: Budget | None = None,
) -> Runtime:
    """A Runtime of `config` plus its NVMe tier: `nvme_capacity` in `nvme_dir`, or 4 MiB in a
    private temporary directory when `nvme_dir` is None."""
    scratch = None
    if nvme_dir is None:
        scratch = tempfile.mkdtemp(prefix="strata-swap-")
        nvme_dir, nvme_capacity = scratch, "4MiB"
    nvme: dict[str, Any] = {"paths": [os.fspath(nvme_dir)], "capacity": nvme_capacity}
    if stripe is not None:
        nvme["stripe"] = stripe
    config = {**config, "nvme": nvme, "quiet": True}
    try:
        runtime = Runtime(config)
    except BaseException:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    if scratch:
        weakref.finalize(runtime, shutil.rmtree, scratch, True)
        _SCRATCH.add(runtime)
    return runtime


def make_runtime(
    device: str | torch.device,
    device_budget: Budget,
    host_budget: Budget,
    nvme_dir: str | os.PathLike[str] | None = None,
    nvme_capacity: Budget = "16GiB",
    stripe: Budget | None = None,
) -> Runtime:
    """A Runtime for `device`: the host backend for "cpu" (the device tier is a CPU arena of
    `device_budget`), the CUDA backend for "cuda"/"cuda:N". `nvme_dir`, when given, holds
    `nvme_capacity` of swap space for tensors that are written (mapped weights never are),
    striped in `stripe` units (the runtime's default when None); without it a 4 MiB swap
    lives in a private temporary directory."""
    dev = torch.device(device)
    config: dict[str, Any] = {
        "device_budget": device_budget,
        "host_budget": host_budget,
    }
    if dev.type == "cpu":
        config["backend"] = "host"
    elif dev.type == "cuda":
        config["backend"] = "cuda"
        config["device_ordinal"] = dev.index or 0
    else:
        raise UnsupportedError(f"device {str(dev)!r}: strata runs on 'cpu' or 'cuda'")
    return runtime_with_nvme(config, nvme_dir, nvme_capacity, stripe)
