"""Offloading Adam and AdamW for a PyTorch training loop (ZeRO-Offload's optimizer side).

``strata.torch.optim.AdamW(model.parameters(), lr=..., offload="nvme", nvme_dir=...)`` replaces
``torch.optim.AdamW``: the fp32 master weights and both moments live in strata tensors homed on
the host tier or NVMe, never on the device; ``step()`` streams each parameter's states through
the prefetch pipeline (the next parameters' states come up from NVMe while this one updates,
written states go back after), runs strata's CPU Adam on them and copies the updated weights
into the parameter (rounded when the model is bf16 or fp16). ``state_dict()`` and
``load_state_dict()`` use torch.optim.AdamW's format, so checkpoints move both ways.

Not yet here (see the README): updates overlapped with backward, parameters whose states
exceed the host budget (sub-groups), gradient clipping and activation offload.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import optim as _kernel
from .._core import Access, Tier
from .._errors import InvalidArgumentError, NotFoundError, OutOfMemoryError
from .._pipeline import PrefetchPipeline
from .._runtime import Runtime, Tensor

_OFFLOAD = {"host": Tier.HOST, "nvme": Tier.NVME}
# NVMe extents start on a stripe: small states (biases, norms) waste less with a small one.
_STRIPE = 256 << 10


def _on_stripes(nbytes: int) -> int:
    return (nbytes + _STRIPE - 1) // _STRIPE * _STRIPE


@dataclass
class _States:
    """One parameter's optimizer states in the runtime."""

    name: str
    master: Tensor  # fp32 copy of the parameter
    exp_avg: Tensor
    exp_avg_sq: Tensor
    step: int = 0

    @property
    def nbytes(self) -> int:
        return self.master.nbytes + self.exp_avg.nbytes + self.exp_avg_sq.nbytes


def _runtime(
    offload: str, host_budget: Any, nvme_dir: Any, nvme_capacity: Any, param_bytes: int
) -> Runtime:
    config: dict[str, Any] = {
        "backend": "host",
        "device_budget": "4MiB",  # the states never go to the device tier
        "host_budget": host_budget,
        "host_copy_on_the_way": False,
        "quiet": True,
    }
    scratch = None
    if offload == "nvme":
        if nvme_dir is None:
            raise InvalidArgumentError('offload="nvme" needs nvme_dir (a directory on the drive)')
        if not os.path.isdir(nvme_dir):
            raise NotFoundError(f"nvme_dir {os.fspath(nvme_dir)!r}: no such directory")
        if nvme_capacity is None:  # the states: each of them starts on a stripe
            nvme_capacity = param_bytes + (16 << 20)
        config["nvme"] = {
            "paths": [os.fspath(nvme_dir)],
            "capacity": nvme_capacity,
            "stripe": _STRIPE,
        }
    else:
        scratch = tempfile.mkdtemp(prefix="strata-swap-")  # the io engine wants an NVMe tier
        config["nvme"] = {"paths": [scratch], "capacity": "4MiB"}
    rt = Runtime(config)
    if scratch:
        weakref.finalize(rt, shutil.rmtree, scratch, True)
    return rt


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
                need = 3 * 4 * p.numel()
                if need > host:
                    raise OutOfMemoryError(
                        f"parameter {pi} of group {gi} {tuple(p.shape)} needs {need} bytes of "
                        f"fp32 master weights and moments on the host tier at once, the host "
                        f"budget holds {host}: raise host_budget"
                    )

    def _states_of(self, p: torch.nn.Parameter, name: str) -> _States:
        s = self._states.get(p)
        if s is None:
            master = p.detach().to("cpu", torch.float32).contiguous()
            rt = self.runtime
            shape = tuple(p.shape)
            s = _States(
                name,
                rt.create_tensor(f"{name}.master", shape, "float32", self._home, master),
                rt.create_tensor(f"{name}.exp_avg", shape, "float32", self._home),
                rt.create_tensor(f"{name}.exp_avg_sq", shape, "float32", self._home),
            )
            self._states[p] = s
        return s

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam(W) step over every parameter with a gradient, as torch.optim does."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
                    grad = p.grad.detach().to("cpu").contiguous()
                    uses = [
                        (s.master, Tier.HOST, rw),
                        (s.exp_avg, Tier.HOST, rw),
                        (s.exp_avg_sq, Tier.HOST, rw),
                    ]
                    with self.pipeline.step(s.name, uses) as (lm, lm1, lm2):
                        master = torch.from_dlpack(lm)
                        copy = None
                        if p.dtype in (torch.bfloat16, torch.float16):
                            copy = torch.empty(p.shape, dtype=p.dtype)
                        _kernel.adam_step(
                            master,
                            grad,
                            torch.from_dlpack(lm1),
                            torch.from_dlpack(lm2),
                            step=s.step,
                            lr=group["lr"],
                            betas=(beta1, beta2),
                            eps=group["eps"],
                            weight_decay=group["weight_decay"],
                            adamw=self._decoupled,
                            param_copy=copy,
                        )
                        p.copy_(master if copy is None else copy)
                        del master, copy  # arrays keep their leases: let them go with the step
        return loss

    # ---- torch.optim.AdamW's checkpoint format -----------------------------------------------

    def _read(self, t: Tensor, shape: torch.Size) -> torch.Tensor:
        with self.runtime.acquire(t, Tier.HOST, Access.READ) as lease:
            value = torch.from_dlpack(lease).clone()
        return value.view(shape)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's format: per parameter index "step", "exp_avg", "exp_avg_sq"
        (fp32, the parameter's shape), plus "master" (the fp32 master weights, which torch
        ignores and keeps), and param_groups with their hyperparameters."""
        index = 0
        state: dict[int, dict[str, torch.Tensor]] = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            ids = []
            for p in group["params"]:
                s = self._states.get(p)
                if s is not None:
                    state[index] = {
                        "step": torch.tensor(float(s.step)),
                        "exp_avg": self._read(s.exp_avg, p.shape),
                        "exp_avg_sq": self._read(s.exp_avg_sq, p.shape),
                        "master": self._read(s.master, p.shape),
                    }
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
            master = st.get("master", p.detach())
            for t, value in (
                (s.master, master),
                (s.exp_avg, st["exp_avg"]),
                (s.exp_avg_sq, st["exp_avg_sq"]),
            ):
                value = value.detach().to("cpu", torch.float32).contiguous()
                if value.numel() != p.numel():
                    raise InvalidArgumentError(
                        f"load_state_dict: parameter {pi} of group {gi} has {p.numel()} "
                        f"elements, its state {value.numel()}"
                    )
                self.runtime.write(t, value)

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
