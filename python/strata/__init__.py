"""strata: a tiered tensor offload runtime (GPU memory, pinned host memory, NVMe).

Tensors live in the fastest tier that has room and move between tiers as they are used. A
lease holds a tensor's bytes on one tier; it exports them zero-copy through DLPack, so
``torch.from_dlpack(lease)`` and ``numpy.from_dlpack(lease)`` see the same bytes::

    import strata, torch
    rt = strata.Runtime({"backend": "host", "device_budget": "64MiB", "host_budget": "128MiB"})
    t = rt.create_tensor("w0", shape=(1024, 1024), dtype="float32")
    with rt.acquire(t, strata.Tier.DEVICE, strata.Access.READ_WRITE) as lease:
        x = torch.from_dlpack(lease)   # x.data_ptr() == lease.data_ptr
        x.fill_(1.0)

See the README's Python section for the whole API.
"""

from . import optim, quant, safetensors
from ._core import Access, Tier
from ._errors import (
    CorruptDataError,
    Error,
    InvalidArgumentError,
    IoError,
    NotFoundError,
    OutOfMemoryError,
    UnsupportedError,
)
from ._pipeline import PrefetchPipeline
from ._runtime import Lease, LeaseFuture, Runtime, Tensor

__all__ = [
    "Access",
    "CorruptDataError",
    "Error",
    "InvalidArgumentError",
    "IoError",
    "Lease",
    "LeaseFuture",
    "NotFoundError",
    "OutOfMemoryError",
    "PrefetchPipeline",
    "Runtime",
    "Tensor",
    "Tier",
    "UnsupportedError",
    "optim",
    "quant",
    "safetensors",
]
__version__ = "0.1.0"
