"""Group-wise int8/int4 quantization (strata::quant, Note [Compressed copies] in
runtime/include/strata/quant/group_quant.h): the compressed copies strata keeps of weights on the
host and NVMe tiers, here on any C-contiguous CPU array (numpy, or torch through DLPack).

A tensor of shape [..., K] is rows of K elements, cut into groups of `group` along K (the last
group of a row shorter when `group` does not divide K); each group keeps an fp16 min m and step s
and a code per element (int8: one a byte; int4: two), so that every element comes back within
half its group's step, plus the roundings of ``float(q) * s + m`` in fp32 and of the output dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _core

__all__ = ["compressed_bytes", "dequantize", "layout", "native_isa", "quantize", "supports"]


def layout(shape: tuple[int, ...], bits: str = "int8", group: int = 64) -> dict[str, int]:
    """Rows, columns, groups a row, bytes of codes a row, the row stride and the total bytes of
    a compressed copy of `shape`."""
    return _core.quant.layout(list(shape), bits, group)


def compressed_bytes(shape: tuple[int, ...], bits: str = "int8", group: int = 64) -> int:
    return layout(shape, bits, group)["bytes"]


def quantize(x: Any, bits: str = "int8", group: int = 64, name: str = "tensor") -> np.ndarray:
    """The compressed copy of `x` (float32, bfloat16 or float16) as a uint8 array. Raises
    strata.InvalidArgumentError naming `name`, the row and the group for a value that is not
    finite or beyond an fp16 min and step. Releases the GIL while it runs."""
    shape = tuple(x.shape)
    out = np.empty(compressed_bytes(shape, bits, group), dtype=np.uint8)
    _core.quant.quantize(x, out, bits, group, name)
    return out


def dequantize(
    packed: Any,
    shape: tuple[int, ...],
    bits: str = "int8",
    group: int = 64,
    out: Any = None,
    isa: str = "native",
) -> Any:
    """The values of a compressed copy, into `out` (float32, bfloat16 or float16, `shape`'s
    elements; a new float32 numpy array when None). `isa` forces a variant of the vectorised
    kernel ("avx512f", "avx2", "baseline"); every variant gives the same bits."""
    if out is None:
        out = np.empty(shape, dtype=np.float32)
    _core.quant.dequantize(packed, list(shape), bits, group, out, isa)
    return out


def native_isa() -> str:
    """The variant dequantize uses on this CPU."""
    return _core.quant.native_isa()


def supports(isa: str) -> bool:
    return _core.quant.supports(isa)
