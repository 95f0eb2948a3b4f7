"""Offloading Adam and AdamW for a PyTorch training loop (ZeRO-Offload's optimizer side).

``strata.torch.optim.AdamW(model.parameters(), lr=..., offload="nvme", nvme_dir=...)`` replaces
``torch.optim.AdamW``: the fp32 master weights and both moments live in strata tensors homed on
the host tier or NVMe, never on the device; ``step()`` streams each parameter's states through
the prefetch pipeline (the next parameters' states come up from NVMe while this one updates,
written states go back after), runs strata's CPU Adam on them and copies the updated weights
into the parameter (rounded when the model is bf16 or fp16). ``state_dict()`` and
``load_state_dict()`` use torch.optim.AdamW's format, so checkpoints move both ways.

``max_grad_norm=`` clips by the global gradient norm first (torch's clip_grad_norm_, so a
clipped step equals torch's); gradient accumulation is several backwards before one step().

Not yet here (see the README): updates overlapped with backward, parameters whose states
exceed the host budget (sub-groups) and activation offload.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import optim as _kernel
from .._core import Access, Tier
from .._errors import InvalidArgumentError, NotFoundError, OutOfMemoryError
from .._pipeline import PrefetchPipeline
from .._runtime import Runtime, Tensor
from ._runtimes import runtime_with_nvme

_OFFLOAD = {"host": Tier.HOST, "nvme": Tier.NVME}
# NVMe extents start on a stripe: small states (biases, norms) waste less with a small one.
_STRIPE = 256 << 10


def _on_stripes(nbytes: int) -> int:
    return (nbytes + _STRIPE - 1) // _STRIPE * _STRIPE


# Note [Where the master weights live]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A parameter in CPU memory that is fp32 and contiguous is its own master copy: the CPU Adam
# updates it in place, and only the moments are strata tensors (a separate master would cost
# 4 bytes a parameter and a copy every step, for nothing). Every other parameter (bf16/fp16,
# on a CUDA device, or not contiguous) gets an fp32 master row beside its moments;
# a CPU bf16/fp16 parameter receives the rounded result straight from the kernel (its
# param_copy), a CUDA one by a copy from the host tier after the update.
@dataclass
class _States:
    """One parameter's optimizer states in the runtime: one fp32 tensor of rows exp_avg,
    exp_avg_sq and, when the parameter is not its own master, the master weights (one block:
    a step leases one copy, which compaction can always make room for, where three leased
    blocks could fragment the host tier)."""

    name: str
    states: Tensor  # (2 or 3, numel)
    has_master: bool
    step: int = 0


def _own_master(p: torch.Tensor) -> bool:
    return p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous()


def _kernel_copy(p: torch.Tensor) -> bool:
    """The kernel can write the rounded parameter into `p` itself."""
    return (
        p.device.type == "cpu"
        and p.dtype in (torch.bfloat16, torch.float16)
        and (p.is_contiguous())
    )


def _runtime(
    offload: str, host_budget: Any, nvme_dir: Any, nvme_capacity: Any, param_bytes: int
) -> Runtime:
    config: dict[str, Any] = {
        "backend": "host",
        "device_budget": "4MiB",  # the states never go to the device tier
        "host_budget": host_budget,
        "host_copy_on_the_way": False,
    }
    if offload == "host":
        return runtime_with_nvme(config, None, 0)
    if nvme_dir is None:
        raise InvalidArgumentError('offload="nvme" needs nvme_dir (a directory on the drive)')
    if not os.path.isdir(nvme_dir):
        raise NotFoundError(f"nvme_dir {os.fspath(nvme_dir)!r}: no such directory")
    if nvme_capacity is None:  # the states: each of them starts on a stripe
        nvme_capacity = param_bytes + (16 << 20)
    return runtime_with_nvme(config, nvme_dir, nvme_capacity, _STRIPE)


class _StrataAdam(torch.optim.Optimizer):
    _decoupled = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        offload: str = "host",
        nvme_dir: str | os.PathLike[str] | None = None,
        host_budget: str | int = "1GiB",
        nvme_capacity: str | int | None = None,
        runtime: Runtime | None = None,
        prefetch: str = "auto",
        max_grad_norm: float | None = None,
    ) -> None:
        if offload not in _OFFLOAD:
            raise InvalidArgumentError(f'offload: {offload!r} is not "host" or "nvme"')
        if not 0.0 <= lr:
            raise InvalidArgumentError(f"lr: {lr} is negative")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise InvalidArgumentError(f"betas: {betas} are not in [0, 1)")
        # torch.optim.AdamW's group keys, so state_dict() is its format.
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
        }
        super().__init__(params, defaults)
        self.offload = offload
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: float | None = None  # before clipping, when max_grad_norm is set
        self._home = _OFFLOAD[offload]
        param_bytes = sum(
            3 * _on_stripes(4 * p.numel()) for g in self.param_groups for p in g["params"]
        )
        self.runtime = runtime or _runtime(
            offload, host_budget, nvme_dir, nvme_capacity, param_bytes
        )
        self.pipeline = PrefetchPipeline(self.runtime, prefetch)
        self._states: dict[torch.nn.Parameter, _States] = {}
        host = self.runtime.stats()["tiers"]["Host"]["capacity_bytes"]
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                need = (2 if _own_master(p) else 3) * 4 * p.numel()
                if need > host:
                    raise OutOfMemoryError(
                        f"parameter {pi} of group {gi} {tuple(p.shape)} needs {need} bytes of "
                        f"fp32 moments (and master weights) on the host tier at once, the host "
                        f"tier holds {host}: raise host_budget"
                    )

    def _states_of(self, p: torch.nn.Parameter, name: str) -> _States:
        s = self._states.get(p)
        if s is None:
            has_master = not _own_master(p)
            init = torch.zeros((3 if has_master else 2, p.numel()), dtype=torch.float32)
            if has_master:
                init[2] = p.detach().reshape(-1).to("cpu", torch.float32)
            t = self.runtime.create_tensor(name, tuple(init.shape), "float32", self._home, init)
            s = _States(name, t, has_master)
            self._states[p] = s
        return s

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam(W) step over every parameter with a gradient, as torch.optim does."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.max_grad_norm is not None:
            # torch.nn.utils.clip_grad_norm_ itself, so the clipped step is torch's exactly: the
            # global norm needs every gradient before any update.
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            self.last_grad_norm = float(norm)
        rw = Access.READ_WRITE
        with self.pipeline.iteration():
            for gi, group in enumerate(self.param_groups):
                beta1, beta2 = group["betas"]
                for pi, p in enumerate(group["params"]):
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise InvalidArgumentError(
                            f"parameter {pi} of group {gi}: a sparse gradient (Adam needs dense "
                            "ones; use torch.optim.SparseAdam for sparse embeddings)"
                        )
                    s = self._states_of(p, f"g{gi}.p{pi}")
                    s.step += 1
                    grad = p.grad.detach()
                    if grad.device.type != "cpu" or not grad.is_contiguous():
                        grad = grad.to("cpu").contiguous()
                    with self.pipeline.step(s.name, [(s.states, Tier.HOST, rw)]) as (lease,):
                        rows = torch.from_dlpack(lease)
                        master = rows[2] if s.has_master else p.data.view(-1)
                        copy = p.data.view(-1) if _kernel_copy(p) else None
                        _kernel.adam_step(
                            master,
                            grad.view(-1),
                            rows[0],
                            rows[1],
                            step=s.step,
                            lr=group["lr"],
                            betas=(beta1, beta2),
                            eps=group["eps"],
                            weight_decay=group["weight_decay"],
                            adamw=self._decoupled,
                            param_copy=copy,
                        )
                        if s.has_master and copy is None:
                            p.copy_(master.view(p.shape))  # up to the device, rounded if 16-bit
                        del rows, master, copy  # arrays keep their leases: let them go now
        return loss

    # ---- torch.optim.AdamW's checkpoint format -----------------------------------------------

    def _rows(self, s: _States) -> torch.Tensor:
        with self.runtime.acquire(s.states, Tier.HOST, Access.READ) as lease:
            return torch.from_dlpack(lease).clone()

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's format: per parameter index "step", "exp_avg", "exp_avg_sq"
        (fp32, the parameter's shape), plus "master" (the fp32 master weights, which torch
        ignores and keeps) for parameters that are not their own master (Note [Where the
        master weights live]), and param_groups with their hyperparameters."""
        index = 0
        state: dict[int, dict[str, torch.Tensor]] = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            ids = []
            for p in group["params"]:
                s = self._states.get(p)
                if s is not None:
                    rows = self._rows(s)
                    state[index] = {
                        "step": torch.tensor(float(s.step)),
                        "exp_avg": rows[0].view(p.shape),
                        "exp_avg_sq": rows[1].view(p.shape),
                    }
                    if s.has_master:
                        state[index]["master"] = rows[2].view(p.shape)
                ids.append(index)
                index += 1
            packed["params"] = ids
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads torch.optim.AdamW's format (or this class's): the hyperparameters of each
        group, and each parameter's step and moments; the master weights from "master" when
        present, else from the parameter itself."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise InvalidArgumentError(
                f"load_state_dict: {len(groups)} param groups, the optimizer has "
                f"{len(self.param_groups)}"
            )
        params = []
        for mine, theirs in zip(self.param_groups, groups):
            if len(mine["params"]) != len(theirs["params"]):
                raise InvalidArgumentError(
                    f"load_state_dict: a group of {len(theirs['params'])} parameters for one "
                    f"of {len(mine['params'])}"
                )
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = v
            params += list(zip(theirs["params"], mine["params"]))
        gi_of = {}
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                gi_of[p] = (gi, pi)
        for key, p in params:
            st = state_dict["state"].get(key)
            if st is None:
                continue
            gi, pi = gi_of[p]
            s = self._states_of(p, f"g{gi}.p{pi}")
            s.step = int(float(st["step"]))
            values = [st["exp_avg"], st["exp_avg_sq"]]
            if s.has_master:
                values.append(st.get("master", p.detach()))
            elif "master" in st:
                p.data.copy_(st["master"].view(p.shape))
            rows = []
            for value in values:
                value = value.detach().to("cpu", torch.float32).reshape(-1)
                if value.numel() != p.numel():
                    raise InvalidArgumentError(
                        f"load_state_dict: parameter {pi} of group {gi} has {p.numel()} "
                        f"elements, its state {value.numel()}"
                    )
                rows.append(value)
            self.runtime.write(s.states, torch.stack(rows).contiguous())

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)


class Adam(_StrataAdam):
    """torch.optim.Adam's update (L2 weight decay added to the gradient), with its states
    offloaded to strata (see the module's documentation)."""

    _decoupled = False


class AdamW(_StrataAdam):
    """torch.optim.AdamW's update (decoupled weight decay), with its states offloaded to strata
    (see the module's documentation)."""

    _decoupled = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, **kwargs)
