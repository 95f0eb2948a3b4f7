"""Tensors of a .safetensors file, read in place: ``strata.safetensors.map(rt, path)``."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._runtime import Runtime, Tensor


def map(runtime: Runtime, path: os.PathLike[str] | str) -> dict[str, Tensor]:
    """Registers every tensor of the file with `runtime` as a read-only tensor whose bytes stay
    in the file (nothing is copied until a tier asks for them, nothing is ever written back).
    Name -> Tensor. A malformed file raises CorruptDataError naming the file and the tensor."""
    pairs = runtime._core.map_safetensors(os.fspath(path))
    return {name: runtime.tensor(tensor_id) for name, tensor_id in pairs}
