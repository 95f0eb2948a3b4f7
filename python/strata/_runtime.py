"""The Runtime, its tensors and leases: the Pythonic layer over the binding (strata._core).

Configs come as a dict, a JSON string or a path; dtypes in numpy, torch or safetensors
spelling; arrays as anything that exports DLPack or the buffer protocol. Every call that may
block releases the GIL in the binding.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from . import _core
from ._core import Access, Tier
from ._errors import InvalidArgumentError

# numpy/torch spellings the core does not know by that name.
_DTYPE_ALIASES = {
    "float": "float32",
    "half": "float16",
    "double": "float64",
    "long": "int64",
    "int": "int32",
    "short": "int16",
    "bool_": "bool",
}
# The core's names, as numpy spells them for read(); numpy has no bfloat16: its bit patterns.
_NUMPY_DTYPES = {
    "f32": np.float32,
    "f16": np.float16,
    "bf16": np.uint16,
    "f64": np.float64,
    "i64": np.int64,
    "i32": np.int32,
    "i16": np.int16,
    "i8": np.int8,
    "u8": np.uint8,
    "bool": np.bool_,
}
# The core's names as torch and numpy users write them (Tensor.dtype).
_PUBLIC_NAMES = {
    "f32": "float32",
    "f16": "float16",
    "bf16": "bfloat16",
    "f64": "float64",
    "i64": "int64",
    "i32": "int32",
    "i16": "int16",
    "i8": "int8",
    "u8": "uint8",
    "bool": "bool",
}

Config = Union[Mapping[str, Any], str, "os.PathLike[str]", None]
TensorLike = Union["Tensor", int]


def _dtype_name(dtype: Any) -> str:
    """A dtype as the core names it: a string ("float32", "bf16", "F32"), a numpy dtype or type,
    or a torch.dtype. The core checks the name and refuses unknown ones."""
    if isinstance(dtype, str):
        name = dtype
    elif type(dtype).__module__ == "torch":  # torch.float32 prints as "torch.float32"
        name = str(dtype).removeprefix("torch.")
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError as e:
            raise InvalidArgumentError(f"dtype: {dtype!r} is not a dtype") from e
    name = name.lower()
    return _DTYPE_ALIASES.get(name, name)


def _config_json(config: Config) -> str:
    """A config dict, a JSON document, or the path of a JSON file, as JSON text."""
    if config is None:
        return "{}"
    if isinstance(config, Mapping):
        return json.dumps(dict(config))
    if isinstance(config, str) and config.lstrip().startswith("{"):
        return config
    path = os.fspath(config)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise InvalidArgumentError(f"config: cannot read {path!r}: {e.strerror}") from e


def _contiguous(array: Any) -> Any:
    """`array` as a C-contiguous CPU array the binding can read in place (a copy only when it is
    not contiguous already)."""
    if type(array).__module__ == "torch":
        return array.detach().contiguous()
    if hasattr(array, "__dlpack__") and not isinstance(array, np.ndarray):
        return array
    return np.ascontiguousarray(array)


@dataclass(frozen=True)
class Tensor:
    """A tensor of a Runtime: its id and what it is. Where its bytes are is the Runtime's."""

    id: int
    name: str
    shape: tuple
    dtype: str
    nbytes: int


_KDLCUDA = 2  # DLPack's kDLCUDA


class Lease:
    """The right to use a tensor's bytes on one tier, as a context manager.

    ``torch.from_dlpack(lease)`` and ``numpy.from_dlpack(lease)`` see the bytes in place
    (``data_ptr`` is their address). An array made from a lease keeps the lease alive: leaving
    the ``with`` block, or ``release()``, gives the copy back once the last such array is gone.
    """

    def __init__(self, core: Any, tensor: Tensor) -> None:
        self._core = core
        self._array: Any = None
        self.tensor = tensor

    @property
    def data_ptr(self) -> int:
        """The address of the bytes (device memory on a CUDA device tier)."""
        return self._core.data_ptr

    @property
    def nbytes(self) -> int:
        return self._core.nbytes

    @property
    def tier(self) -> Tier:
        return self._core.tier

    @property
    def access(self) -> Access:
        return self._core.access

    @property
    def active(self) -> bool:
        """False once released (arrays made from it may still hold the copy)."""
        return self._core.active

    def _exported(self) -> Any:
        if self._array is None:
            self._array = self._core.array()
        return self._array

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: Any = None,
        copy: bool | None = None,
    ) -> Any:
        """DLPack export, zero copy, keeping this lease alive while the array lives.

        On a CUDA device tier `stream` is the consumer's stream: it is made to wait for the copy
        that brought the bytes (None: the legacy default stream; -1: the consumer synchronises
        itself), and the host does not block. Every other array is on the CPU (or pinned host
        memory): `stream` must be None or -1, and the copy is waited for on the host first.
        """
        device_type, _ = self._core.dlpack_device()
        if device_type == _KDLCUDA:
            if stream == 0:
                raise BufferError(
                    "DLPack stream 0 is ambiguous: pass 1 (legacy default), 2 (per-thread "
                    "default), a stream handle, or -1"
                )
            self._core.make_ready(1 if stream is None else int(stream))
        else:
            if stream is not None and stream != -1:
                raise BufferError(
                    f"this lease's array is in host memory (DLPack device {device_type}): "
                    f"stream must be None or -1, not {stream!r}"
                )
            self._core.make_ready(None)
        kwargs = {"max_version": max_version, "dl_device": dl_device, "copy": copy}
        return self._exported().__dlpack__(**{k: v for k, v in kwargs.items() if v is not None})

    def __dlpack_device__(self) -> tuple[int, int]:
        """(DLPack device type, device id): kDLCUDA for a CUDA device tier, kDLCUDAHost for the
        host tier of the CUDA backend, kDLCPU otherwise."""
        return tuple(self._core.dlpack_device())

    def release(self) -> None:
        """Ends this lease's hold on the copy (arrays made from it keep theirs)."""
        self._array = None
        self._core.release()

    def __enter__(self) -> Lease:  # noqa: PYI034 (Python 3.9 has no typing.Self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "active" if self.active else "released"
        return f"<strata.Lease {self.tensor.name!r} on {self.tier.name} ({state})>"


class LeaseFuture:
    """A lease on its way (Runtime.acquire_async): ``result()`` waits for it, without the GIL."""

    def __init__(self, core: Any, tensor: Tensor) -> None:
        self._core = core
        self.tensor = tensor

    def done(self) -> bool:
        """True when result() would not block."""
        return self._core.done()

    def result(self) -> Lease:
        """The lease, once its copy is on the tier (once only)."""
        return Lease(self._core.result(), self.tensor)


class Runtime:
    """The residency manager: tensors in the fastest tier with room, moved as they are used.

    ``config`` is a dict, a JSON string or the path of a JSON file with the keys of the
    README's Configuration section, e.g. ``{"backend": "host", "device_budget": "64MiB",
    "host_budget": "128MiB", "nvme": {"paths": ["/mnt/nvme0"], "capacity": "4GiB"}}``.
    Thread-safe: several Python threads may use one Runtime at once.
    """

    def __init__(self, config: Config = None) -> None:
        self._core = _core.Runtime(_config_json(config))

    # -- tensors --

    def _describe(self, tensor_id: int) -> Tensor:
        name, shape, dtype, nbytes = self._core.describe(tensor_id)
        return Tensor(tensor_id, name, tuple(shape), _PUBLIC_NAMES.get(dtype, dtype), nbytes)

    @staticmethod
    def _id(tensor: TensorLike) -> int:
        return tensor.id if isinstance(tensor, Tensor) else int(tensor)

    def create_tensor(
        self,
        name: str,
        shape: Sequence[int],
        dtype: Any = "float32",
        home: Tier = Tier.HOST,
        init: Any = None,
        compress: str | None = None,
        group: int = 64,
    ) -> Tensor:
        """A new tensor on its home tier, zeroed or filled from `init` (any DLPack or buffer
        array of the same number of bytes). `compress` ("int8" or "int4") stores its host and
        NVMe copies quantized in groups of `group` along the last dimension (strata.quant),
        quantized once here; its device copy is dequantized on arrival, and it is read-only and
        leased on the device only (Note [Compressed copies])."""
        src = None if init is None else _contiguous(init)
        tensor_id = self._core.create_tensor(
            name, [int(s) for s in shape], _dtype_name(dtype), home, src, compress or "none", group
        )
        return self._describe(tensor_id)

    def create_unwritten(
        self, name: str, shape: Sequence[int], dtype: Any = "float32", home: Tier = Tier.HOST
    ) -> Tensor:
        """A new tensor homed on `home` with no bytes yet: it takes no room and writes nothing
        until its first lease, which must be Access.WRITE (or a write()). For bytes made where
        they are used (a KV cache's next page, filled on the device, homed on NVMe)."""
        tensor_id = self._core.create_unwritten(
            name, [int(s) for s in shape], _dtype_name(dtype), home
        )
        return self._describe(tensor_id)

    def map_tensor(
        self,
        name: str,
        shape: Sequence[int],
        dtype: Any,
        path: os.PathLike[str] | str,
        offset: int = 0,
        compress: str | None = None,
        group: int = 64,
    ) -> Tensor:
        """A read-only tensor whose bytes stay in the file at `offset` (read in place). With
        `compress`, the file holds its compressed copy (strata.quant.quantize's bytes) and the
        tensor is `shape` of `dtype` on the device."""
        tensor_id = self._core.map_tensor(
            name,
            [int(s) for s in shape],
            _dtype_name(dtype),
            os.fspath(path),
            int(offset),
            compress or "none",
            group,
        )
        return self._describe(tensor_id)

    def tensor(self, tensor_id: int) -> Tensor:
        """The Tensor with this id."""
        return self._describe(tensor_id)

    def destroy(self, tensor: TensorLike) -> None:
        """Frees every copy of the tensor; it must not be leased."""
        self._core.destroy(self._id(tensor))

    # -- leases and moves --

    def acquire(self, tensor: TensorLike, tier: Tier, access: Access = Access.READ) -> Lease:
        """Blocks (without the GIL) until the tensor's bytes are on `tier`, and leases them."""
        t = tensor if isinstance(tensor, Tensor) else self._describe(int(tensor))
        return Lease(self._core.acquire(t.id, tier, access), t)

    def acquire_async(
        self, tensor: TensorLike, tier: Tier, access: Access = Access.READ
    ) -> LeaseFuture:
        """Starts bringing the tensor to `tier` and returns at once a future of its lease."""
        t = tensor if isinstance(tensor, Tensor) else self._describe(int(tensor))
        return LeaseFuture(self._core.acquire_async(t.id, tier, access), t)

    def prefetch(self, tensor: TensorLike, tier: Tier) -> None:
        """Starts bringing the tensor to `tier` (returns once the move is under way)."""
        self._core.prefetch(self._id(tensor), tier)

    def evict(self, tensor: TensorLike, tier: Tier) -> bool:
        """Drops the tensor's copy on `tier` (written back below first when it is the newest);
        True when that needed a write-back."""
        return self._core.evict(self._id(tensor), tier)

    def resident(self, tensor: TensorLike, tier: Tier) -> bool:
        """True when `tier` holds the tensor's newest bytes (or is loading them)."""
        return self._core.resident(self._id(tensor), tier)

    def synchronize(self) -> None:
        """Waits until no move is in flight."""
        self._core.synchronize()

    # -- bytes in and out --

    def read(self, tensor: TensorLike) -> np.ndarray:
        """A copy of the tensor's newest bytes as a numpy array of its shape (bfloat16, which
        numpy lacks, as uint16 bit patterns)."""
        tensor_id = self._id(tensor)
        _name, shape, dtype, nbytes = self._core.describe(tensor_id)
        out = np.empty(
            tuple(shape) if shape else (nbytes // np.dtype(_NUMPY_DTYPES[dtype]).itemsize,),
            dtype=_NUMPY_DTYPES[dtype],
        )
        self._core.read_into(tensor_id, out)
        return out

    def write(self, tensor: TensorLike, array: Any) -> None:
        """Replaces the tensor's bytes with `array`'s (any DLPack or buffer array of the same
        number of bytes)."""
        self._core.write(self._id(tensor), _contiguous(array))

    # -- what happened --

    def tier_bytes(self, tier: Tier) -> tuple[int, int, int]:
        """(capacity, used, leased) bytes of `tier` now: stats()'s figures for one tier, without
        building the whole report (for a planner that asks per step)."""
        return tuple(self._core.tier_bytes(tier))

    def stats(self) -> dict:
        """Per-tier and per-path counters, the io engine's, as a dict."""
        return json.loads(self._core.stats_json())

    def export_trace(self, path: os.PathLike[str] | str) -> None:
        """Writes the Chrome trace (open it in Perfetto) of copies, I/O and evictions."""
        self._core.export_trace(os.fspath(path))
