"""offload_activations: the tensors autograd saves for backward, moved into strata tensors
(host tier or NVMe) during forward and brought back, prefetched in reverse order, during
backward (Note [Saved activations]).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .. import _core
from .._core import Access, Tier
from .._errors import InvalidArgumentError, OutOfMemoryError
from .._runtime import Runtime, Tensor
from ._dtypes import STRATA_DTYPES
from ._runtimes import consumer_done

# Note [Saved activations]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# Inside the context, autograd's pack hook gives every saved tensor of at least `min_bytes`
# that is contiguous, is not a leaf that requires grad (a parameter: it lives on the device
# anyway) and fits the host tier (its way back), to a new strata tensor homed on `tier`, and
# keeps only a handle. The unpack hook leases it (on the device tier for a CUDA tensor, the
# host tier for a CPU one) and hands autograd a copy of it on the saved tensor's device, first
# asking the runtime to prefetch (if there is room) the tensor saved before it: backward
# unpacks in about the reverse order of forward. A handle that autograd drops (after its
# unpack, or with the graph) destroys its strata tensor. The bytes round-trip exactly, so
# gradients are the same bits as without offload.


class _Saved:
    """A saved activation in the runtime; destroyed with the last reference."""

    def __init__(
        self,
        runtime: Runtime,
        tensor: Tensor,
        shape: torch.Size,
        dtype: torch.dtype,
        device: torch.device,
        before: _Saved | None,
    ) -> None:
        self.runtime = runtime
        self.tensor = tensor
        self.shape = shape
        self.dtype = dtype
        self.device = device
        # The one saved just before it, prefetched when this is unpacked; weak, so that a
        # handle kept across iterations (a long-lived ActivationOffload) holds no other.
        self.before = None if before is None else weakref.ref(before)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown the runtime may be gone
            self.runtime.destroy(self.tensor)


class ActivationOffload:
    """What offload_activations() counts: tensors and bytes moved (offloaded,
    offloaded_bytes), and those kept (kept; too_large of them larger than the host tier)."""

    def __init__(self, runtime: Runtime, tier: Tier, min_bytes: int) -> None:
        self.runtime = runtime
        self.tier = tier
        self.min_bytes = min_bytes
        self.offloaded = 0
        self.offloaded_bytes = 0
        self.kept = 0
        self.too_large = 0  # kept because they are larger than the host tier
        self._host_capacity = runtime.stats()["tiers"]["Host"]["capacity_bytes"]
        self._names = itertools.count()
        # The last one saved (weak: the graph owns the handles, and one outliving its graph
        # would keep its strata tensor).
        self._last: weakref.ReferenceType[_Saved] | None = None
        self._lock = threading.Lock()

    def pack(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if nbytes > self._host_capacity:  # it could not come back through the host tier
            self.too_large += 1
            self.kept += 1
            return t
        if (
            nbytes < self.min_bytes
            or not t.is_contiguous()
            or (t.is_leaf and t.requires_grad)
            or t.is_sparse
            or t.dtype not in STRATA_DTYPES
        ):
            self.kept += 1
            return t
        src = t.detach()
        if src.device.type != "cpu":
            src = src.to("cpu")  # a CUDA activation goes down through a host copy
        with self._lock:
            name = f"activation.{next(self._names)}"
        tensor = self.runtime.create_tensor(
            name, tuple(t.shape), STRATA_DTYPES[t.dtype], self.tier, src.contiguous()
        )
        last = None if self._last is None else self._last()
        saved = _Saved(self.runtime, tensor, t.shape, t.dtype, t.device, last)
        self._last = weakref.ref(saved)
        self.offloaded += 1
        self.offloaded_bytes += nbytes
        return saved

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed
        # A CUDA activation comes back through the device tier; a CPU one through the host
        # tier (on the host backend the device tier is another CPU arena: no use going there).
        tier = Tier.DEVICE if packed.device.type == "cuda" else Tier.HOST
        before = None if packed.before is None else packed.before()
        if before is not None:
            with contextlib.suppress(OutOfMemoryError):  # a hint: no room now is no error
                self.runtime.prefetch(before.tensor, tier)
        packed.before = None
        with self.runtime.acquire(packed.tensor, tier, Access.READ) as lease:
            # A copy: the lease ends here, so the handle can always destroy its tensor (a view
            # of the lease would hold it for as long as autograd keeps the value).
            value = torch.from_dlpack(lease).view(packed.shape).to(packed.device, copy=True)
            consumer_done(value.device)  # Note [Consumers' kernels] (in _runtimes.py)
        return value


@contextmanager
def offload_activations(
    runtime: Runtime, min_bytes: int | str = "1MiB", tier: Tier = Tier.HOST
) -> Iterator[ActivationOffload]:
    """Saved tensors of at least `min_bytes` leave the device for strata tensors homed on `tier`
    (Tier.HOST or Tier.NVME) while the block runs, and come back for backward (Note [Saved
    activations])::

        with st.offload_activations(runtime=opt.runtime, min_bytes="1MiB") as stats:
            loss = model(batch).loss
        loss.backward()
        print(stats.offloaded, stats.offloaded_bytes)
    """
    if tier not in (Tier.HOST, Tier.NVME):
        raise InvalidArgumentError(f"offload_activations: tier {tier} is not HOST or NVME")
    state = ActivationOffload(runtime, tier, _bytes(min_bytes))
    try:
        with torch.autograd.graph.saved_tensors_hooks(state.pack, state.unpack):
            yield state
    finally:
        state._last = None


def _bytes(value: int | str) -> int:
    return value if isinstance(value, int) else _core.parse_bytes(value, "min_bytes")
