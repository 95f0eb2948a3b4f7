"""The dtypes strata's tensors and torch's share, by name both ways: one table for the modules of
strata.torch (a strata Tensor's dtype is a name, "bfloat16"; a lease becomes a torch tensor)."""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}

STRATA_DTYPES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a strata Tensor's dtype name."""
    return TORCH_DTYPES[name]
