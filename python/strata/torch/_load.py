"""load_model: a transformers causal LM built from its config with no weights in memory, its
parameters mapped in place from the checkpoint's safetensors files and leased block by block."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .._errors import NotFoundError
from .._runtime import Runtime
from ._offload import offload
from ._runtimes import Budget


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no random
    init); buffers are built as usual, so computed ones (rotary frequencies) are right."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            cls = type(module._parameters[name])
            module._parameters[name] = cls(param.to("meta"), param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _checkpoint_dir(checkpoint: str | os.PathLike[str]) -> str:
    path = os.fspath(checkpoint)
    if not os.path.isdir(path):
        raise NotFoundError(f"checkpoint {path!r}: not a directory with a config.json")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise NotFoundError(f"checkpoint {path!r}: no config.json")
    return path


def load_model(
    checkpoint: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    device_budget: Budget = "2GiB",
    host_budget: Budget = "4GiB",
    nvme_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | str | None = None,
    prefetch: str = "auto",
    runtime: Runtime | None = None,
    blocks: Sequence[str] | None = None,
    model_class: Any = None,
    compress: str | None = None,
    compress_group: int = 64,
    compress_rule: Any = None,
    compress_cache: str | os.PathLike[str] | None = None,
    experts: str = "leased",
    expert_compute: str = "auto",
    expert_prefetch: str = "auto",
) -> nn.Module:
    """A transformers model from a local checkpoint directory (config.json and its safetensors
    files, sharded or not), ready to run with its weights in strata's tiers::

        model = strata.torch.load_model("ckpt", device_budget="2GiB", host_budget="4GiB")
        logits = model(input_ids).logits
        ids = model.generate(input_ids, max_new_tokens=32)

    The model is built from the config with its parameters on the meta device, then offload()
    maps every parameter from the files in place and leases each block on the device tier for
    its forward, the prefetch pipeline bringing the next ones meanwhile. `dtype` (default: the
    checkpoint's) converts floating weights as they are leased. `model_class` defaults to
    AutoModelForCausalLM. The Offloaded handle is ``model.strata`` (stats(), remove()).
    Inputs go on `device`; on "cpu" the host backend stands in for the GPU.

    ``compress="int8"`` or ``"int4"`` keeps the linear layers' weights compressed on the host
    and NVMe tiers (a quarter or an eighth of fp32's bytes move), dequantized as each block is
    leased; the first load writes the compressed cache (a progress bar), later ones reuse it
    while the checkpoint is unchanged. `compress_rule(name, shape, dtype) -> bool` picks other
    tensors; `compress_group` is the group size; `compress_cache` the cache's directory
    (default: `nvme_dir`).

    A mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE, any whose experts module follows
    transformers' experts interface) has its routed experts leased one by one, only those the
    router picks (``experts="leased"``; ``"whole"`` leases each layer with all of them), cached on
    the tiers by routing frequency and prefetched by applying the next layer's router ahead;
    ``model.strata.stats()["experts"]`` counts hits, misses, bytes moved and guesses. See
    offload().
    """
    import transformers

    path = _checkpoint_dir(checkpoint)
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    build_dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(build_dtype, str):
        build_dtype = getattr(torch, build_dtype)
    cls = model_class or transformers.AutoModelForCausalLM
    with parameters_on_meta():
        model = cls.from_config(config, dtype=build_dtype)
    model.eval()
    offload(
        model,
        path,
        runtime=runtime,
        device=device,
        device_budget=device_budget,
        host_budget=host_budget,
        nvme_dir=nvme_dir,
        dtype=dtype,
        prefetch=prefetch,
        blocks=blocks,
        compress=compress,
        compress_group=compress_group,
        compress_rule=compress_rule,
        compress_cache=compress_cache,
        experts=experts,
        expert_compute=expert_compute,
        expert_prefetch=expert_prefetch,
    )
    return model
