"""strata's CPU Adam (strata::optim, vectorised for the machine it runs on), in place on any
C-contiguous CPU arrays that export DLPack or the buffer protocol (torch tensors, numpy)."""

from __future__ import annotations

from typing import Any

from . import _core


def adam_step(
    params: Any,
    grads: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    *,
    step: int,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = False,
    param_copy: Any = None,
) -> None:
    """One Adam (or AdamW, ``adamw=True``) step of ``torch.optim.Adam``'s formula, in place.

    `params`, `exp_avg` and `exp_avg_sq` are float32 (the master copy and the moments); `grads`
    float32, bfloat16 or float16; `param_copy`, if given, a bfloat16 or float16 array that
    receives the updated parameters rounded (the copy a mixed-precision model computes with).
    `step` counts from 1. Releases the GIL while it runs.
    """
    _core.optim.adam_step(
        params,
        grads,
        exp_avg,
        exp_avg_sq,
        int(step),
        float(lr),
        float(betas[0]),
        float(betas[1]),
        float(eps),
        float(weight_decay),
        bool(adamw),
        param_copy,
    )
