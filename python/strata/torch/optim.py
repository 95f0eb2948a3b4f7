"""Offloading Adam and AdamW for a PyTorch training loop (ZeRO-Offload's optimizer side).

``strata.torch.optim.AdamW(model.parameters(), lr=..., offload="nvme", nvme_dir=...)`` replaces
``torch.optim.AdamW``: the fp32 master weights and both moments live in strata tensors homed on
the host tier or NVMe, never on the device; ``step()`` streams each parameter's states through
the prefetch pipeline (the next parameters' states come up from NVMe while this one updates,
written states go back after), runs strata's CPU Adam on them and copies the updated weights
into the parameter (rounded when the model is bf16 or fp16). ``state_dict()`` and
``load_state_dict()`` use torch.optim.AdamW's format, so checkpoints move both ways.

``overlap=True`` updates each parameter during backward as soon as its gradient is there (Note
[Updates during backward]); ``sub_group_size`` splits large parameters' states into pieces
(Note [Sub-groups]); ``max_grad_norm=`` clips by the global gradient norm first (torch's
clip_grad_norm_, so a clipped step equals torch's); gradient accumulation is several backwards
before one step() (``accumulation_steps=`` with overlap).
"""

from __future__ import annotations

import functools
import os
import queue
import threading
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
from . import _threads
from ._runtimes import STATE_STRIPE, in_pages, on_stripes, runtime_with_nvme

_OFFLOAD = {"host": Tier.HOST, "nvme": Tier.NVME}


# Note [Where the master weights live]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A parameter in CPU memory that is fp32 and contiguous is its own master copy: the CPU Adam
# updates it in place, and only the moments are strata tensors (a separate master would cost
# 4 bytes a parameter and a copy every step, for nothing). Every other parameter (bf16/fp16,
# on a CUDA device, or not contiguous) gets an fp32 master row beside its moments;
# a CPU bf16/fp16 parameter receives the rounded result straight from the kernel (its
# param_copy), a CUDA one by a copy from the host tier after the update.
# Note [Sub-groups]
# ~~~~~~~~~~~~~~~~~
# A parameter's states go in pieces of at most `sub_group_size` elements (DeepSpeed's name):
# each piece one strata tensor, leased, updated and given back as its own pipeline step, so
# the host tier never needs more than one piece (and the next, prefetched). Adam is element by
# element: the pieces' results are the whole parameter's, bit for bit. By default a piece's
# states take at most a quarter of the host tier, so a 50,000 x 4,096 embedding (2.4 GB of
# fp32 moments) trains in a few hundred MiB of host budget, its states streamed NVMe -> host
# -> NVMe piece by piece.
@dataclass
class _Piece:
    """Elements [lo, hi) of a parameter's states: one fp32 tensor of rows exp_avg, exp_avg_sq
    and, when the parameter is not its own master, the master weights (one block per piece: a
    step leases one copy, which compaction can always make room for)."""

    name: str
    states: Tensor  # (2 or 3, hi - lo)
    lo: int
    hi: int


@dataclass
class _States:
    """One parameter's optimizer states in the runtime (Note [Sub-groups])."""

    pieces: list[_Piece]
    has_master: bool
    step: int = 0


def _piece_sizes(n: int, size: int) -> list[int]:
    return [min(size, n - lo) for lo in range(0, max(n, 1), size)]


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
    if nvme_capacity is None:  # the states, each at most on_stripes of its bytes
        nvme_capacity = param_bytes + (16 << 20)
    return runtime_with_nvme(config, nvme_dir, nvme_capacity, STATE_STRIPE)


def _grad_ready(ref: weakref.ReferenceType, p: torch.nn.Parameter) -> None:
    """The backward hook: a weak reference, so parameters do not keep the optimizer alive."""
    opt = ref()
    if opt is not None:
        opt._on_grad(p)


def _work(ref: weakref.ReferenceType, ready: queue.Queue) -> None:
    """The update thread (Note [Updates during backward]): holds the optimizer only while it
    runs an update, so the optimizer can be collected (which queues the None that ends this)."""
    while (p := ready.get()) is not None:
        try:
            opt = ref()
            if opt is not None:
                opt._run_queued(p)
            del opt
        finally:
            ready.task_done()
    ready.task_done()


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
        overlap: bool = False,
        accumulation_steps: int = 1,
        sub_group_size: int | None = None,
        partition: bool = False,
        process_group: Any = None,
        bucket_size: int = 1 << 22,
    ) -> None:
        if offload not in _OFFLOAD:
            raise InvalidArgumentError(f'offload: {offload!r} is not "host" or "nvme"')
        if not 0.0 <= lr:
            raise InvalidArgumentError(f"lr: {lr} is negative")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise InvalidArgumentError(f"betas: {betas} are not in [0, 1)")
        if accumulation_steps < 1:
            raise InvalidArgumentError(f"accumulation_steps: {accumulation_steps} is below 1")
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
        # NVMe room for the states: each piece takes at most its bytes in whole stripes (a
        # smaller one shares a stripe: Note [Small extents]), so this bounds what they need.
        param_bytes = sum(
            3 * (on_stripes(4 * p.numel()) + STATE_STRIPE * (p.numel() // (1 << 18)))
            for g in self.param_groups
            for p in g["params"]
        )
        if partition:  # Note [Shards]: this rank keeps 1/N of the states
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                # The shard's 12 bytes an element, and a stripe for each piece's start: a
                # segment per parameter and bucket at most, plus one per 256 Ki elements.
                world = dist.get_world_size(process_group)
                params = [p for g in self.param_groups for p in g["params"]]
                elements = sum(p.numel() for p in params) // world + len(params)
                pieces = 2 * len(params) + elements // bucket_size + elements // (1 << 18) + 1
                param_bytes = 12 * elements + STATE_STRIPE * pieces
        self.runtime = runtime or _runtime(
            offload, host_budget, nvme_dir, nvme_capacity, param_bytes
        )
        self.pipeline = PrefetchPipeline(self.runtime, prefetch)
        self._states: dict[torch.nn.Parameter, _States] = {}
        host = self.runtime.stats()["tiers"]["Host"]["capacity_bytes"]
        if sub_group_size is None:  # a piece's states (up to 12 bytes an element): host / 4
            sub_group_size = max(1024, host // 4 // 12)
        if sub_group_size < 1 or 12 * sub_group_size > host:
            raise OutOfMemoryError(
                f"sub_group_size {sub_group_size}: a piece's fp32 moments and master weights "
                f"({12 * sub_group_size} bytes) do not fit the host tier ({host} bytes): lower "
                "it or raise host_budget"
            )
        self.sub_group_size = sub_group_size
        # Note [Updates during backward]
        # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        # With overlap (and no clipping, which needs every gradient first), a parameter's
        # update starts as soon as backward has accumulated its gradient for the last
        # micro-batch of the step (register_post_accumulate_grad_hook; every use of the
        # parameter in the graph has then run, so changing it is safe, as in torch's "optimizer
        # in backward" recipe). The hook only queues it; one worker thread runs the updates in
        # that order, the CPU Adam releasing the GIL, while autograd goes on. step() waits for
        # the queue, updates whatever the hooks did not (a gradient set by hand), and reports a
        # worker's failure. Each update is the same call on the same values as without overlap:
        # the results are bit-identical.
        self.accumulation_steps = accumulation_steps
        self.overlap = overlap and max_grad_norm is None and not partition
        self.updates_during_backward = 0  # counted over the optimizer's life
        self._ready: queue.Queue[torch.nn.Parameter | None] = queue.Queue()
        self._done: set[torch.nn.Parameter] = set()
        # Note [A failed step is finished, not repeated]: the pieces updated in a step that
        # failed, so that step() again updates only the rest.
        self._partial: dict[torch.nn.Parameter, set[int]] = {}
        self._unfinished: str | None = None  # why the last step() stopped, until it finishes
        self._backwards: dict[torch.nn.Parameter, int] = {}
        self._failure: BaseException | None = None
        self._in_iteration = False
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._hooks = []
        self._where: dict[torch.nn.Parameter, tuple[dict, int, int]] = {}
        for gi in range(len(self.param_groups)):
            self._track(gi)
        self._zero = None
        if partition:
            from ._zero import Zero

            self._zero = Zero(self, process_group, bucket_size)
        if offload == "host" and runtime is None:  # all in the host tier: no NVMe to spill to
            need = (
                self._zero.state_bytes()
                if self._zero is not None
                else sum(
                    in_pages(4 * (2 if _own_master(p) else 3) * n)
                    for g in self.param_groups
                    for p in g["params"]
                    for n in _piece_sizes(p.numel(), self.sub_group_size)
                )
            )
            if need > host:
                raise OutOfMemoryError(
                    f'offload="host": the optimizer states take {need} bytes and the host tier '
                    f"holds {host} (host_budget less the staging slots): raise host_budget or "
                    'use offload="nvme"'
                )
        if self._hooks:
            self._worker = _threads.start(  # ended at exit (_threads.py)
                _work, (weakref.ref(self), self._ready), self._ready, "strata-adam"
            )
            weakref.finalize(self, self._ready.put, None)

    def _track(self, gi: int) -> None:
        group = self.param_groups[gi]
        for pi, p in enumerate(group["params"]):
            self._where[p] = (group, gi, pi)
            if self.overlap and p.requires_grad:
                hook = functools.partial(_grad_ready, weakref.ref(self))
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_where"):  # after __init__ (which tracks its own groups)
            self._track(len(self.param_groups) - 1)

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        n = self._backwards.get(p, 0) + 1
        self._backwards[p] = n
        if n % self.accumulation_steps == 0:
            self._ready.put(p)

    def _run_queued(self, p: torch.nn.Parameter) -> None:
        try:
            if self._failure is None:
                with torch.no_grad():
                    self._update(p)
                self.updates_during_backward += 1
        except BaseException as e:  # noqa: BLE001 (raised by step())
            self._failure = e

    def close(self) -> None:
        """Takes the backward hooks off the parameters and stops the update thread (overlap);
        the optimizer then updates only in step(). Also done when it is garbage-collected."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._zero is not None:
            self._zero.close()
        self._ready.join()
        if self._worker is not None:
            self._ready.put(None)
            self._worker.join()
            self._worker = None

    def _begin(self) -> None:
        with self._lock:
            if not self._in_iteration:
                self.pipeline._core.begin_iteration()
                self._in_iteration = True

    def _update(self, p: torch.nn.Parameter) -> None:
        """One parameter's Adam step (any thread; one at a time), piece by piece; the pieces
        already updated in a step that failed are skipped (Note [A failed step is finished, not
        repeated])."""
        if p in self._done or p.grad is None:
            return
        group, gi, pi = self._where[p]
        if p.grad.is_sparse:
            raise InvalidArgumentError(
                f"parameter {pi} of group {gi}: a sparse gradient (Adam needs dense "
                "ones; use torch.optim.SparseAdam for sparse embeddings)"
            )
        self._begin()
        s = self._states_of(p, f"g{gi}.p{pi}")
        progress = self._partial.get(p)
        if progress is None:  # this step's first try for p
            s.step += 1
            progress = self._partial[p] = set()
        grad = p.grad.detach()
        if grad.device.type != "cpu" or not grad.is_contiguous():
            grad = grad.to("cpu").contiguous()
        grad = grad.view(-1)
        flat = p.data.view(-1) if p.is_contiguous() else None
        copy = flat if _kernel_copy(p) else None
        for k, piece in enumerate(s.pieces):
            if k in progress:
                continue
            lo, hi = piece.lo, piece.hi
            uses = [(piece.states, Tier.HOST, Access.READ_WRITE)]
            with self.pipeline.step(piece.name, uses) as (lease,):
                rows = torch.from_dlpack(lease)
                master = rows[2] if s.has_master else flat[lo:hi]
                self._adam(
                    rows,
                    master,
                    grad[lo:hi],
                    s.step,
                    group,
                    param_copy=None if copy is None else copy[lo:hi],
                )
                if s.has_master and copy is None and flat is not None:
                    flat[lo:hi].copy_(master)  # up to the device, rounded if 16-bit
                del rows, master  # arrays keep their leases: let them go now
                progress.add(k)  # updated: a failure from here on is the write's, not Adam's
        if s.has_master and flat is None:  # not contiguous: the whole parameter at once
            p.data.copy_(self._rows(s)[2].view(p.shape))
        del self._partial[p]
        self._done.add(p)

    def _adam(
        self,
        rows: torch.Tensor,
        master: torch.Tensor,
        grad: torch.Tensor,
        step: int,
        group: dict,
        param_copy: torch.Tensor | None = None,
    ) -> None:
        """strata's CPU Adam(W) on one piece: moments rows[0] and rows[1], with `group`'s
        hyperparameters (this class's update and the partitioned one's, Note [Shards])."""
        _kernel.adam_step(
            master,
            grad,
            rows[0],
            rows[1],
            step=step,
            lr=group["lr"],
            betas=tuple(group["betas"]),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adamw=self._decoupled,
            param_copy=param_copy,
        )

    def _states_of(self, p: torch.nn.Parameter, name: str) -> _States:
        s = self._states.get(p)
        if s is None:
            has_master = not _own_master(p)
            flat = p.detach().reshape(-1)
            pieces = []
            n, size = p.numel(), self.sub_group_size
            for k, lo in enumerate(range(0, max(n, 1), size)):
                hi = min(n, lo + size)
                init = torch.zeros((3 if has_master else 2, hi - lo), dtype=torch.float32)
                if has_master:
                    init[2] = flat[lo:hi].to("cpu", torch.float32)
                piece = name if n <= size else f"{name}.{k}"
                t = self.runtime.create_tensor(
                    piece, tuple(init.shape), "float32", self._home, init
                )
                pieces.append(_Piece(piece, t, lo, hi))
            s = _States(pieces, has_master)
            self._states[p] = s
        return s

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam(W) step over every parameter with a gradient, as torch.optim does."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._zero is not None:  # Note [Shards]: clipping happens on the shards there
            self._begin()
            try:
                self._zero.step()
            finally:
                with self._lock:
                    self._in_iteration = False
                    self.pipeline._core.end_iteration()
            return loss
        if self.max_grad_norm is not None:
            # torch.nn.utils.clip_grad_norm_ itself, so the clipped step is torch's exactly: the
            # global norm needs every gradient before any update.
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            self.last_grad_norm = float(norm)
        self._ready.join()  # the updates queued during backward
        # Note [A failed step is finished, not repeated]
        # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        # A step that fails (an I/O error reading or writing a state, no room) has updated some
        # parameters (or some pieces of one) and not the others; nothing is lost, since a
        # state whose write failed stays in the host tier, the newest copy, and is written
        # again when it leaves. step() raises the error with a note saying how far the step
        # got, and keeps that: the gradients must stay, and step() again finishes the step,
        # updating only what was not updated (each piece exactly once: the parameters then
        # equal a step that never failed, bit for bit). zero_grad() refuses to drop the
        # gradients of an unfinished step; load_state_dict() abandons it.
        failure: BaseException | None = None
        try:
            if self._failure is not None:
                failure, self._failure = self._failure, None
            else:
                for group in self.param_groups:
                    for p in group["params"]:
                        self._update(p)
        except BaseException as e:  # noqa: BLE001 (raised below, with the note)
            failure = e
        try:
            with self._lock:
                if self._in_iteration:
                    self._in_iteration = False
                    self.pipeline._core.end_iteration()  # rethrows a failed write-back
        except BaseException as e:  # noqa: BLE001
            failure = failure or e
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if failure is None or (not self._partial and all(p in self._done for p in params)):
            self._done.clear()
            self._unfinished = None
            if failure is None:
                return loss
            _add_note(
                failure,
                f"strata.torch.optim: this step updated all {len(params)} parameters; the "
                "error is a state's write to NVMe: that state stays in host memory, the "
                "newest copy, and is written again when it next leaves. Nothing to redo.",
            )
            raise failure
        if isinstance(failure, InvalidArgumentError):  # bad input: a retry fails the same way
            note = self._progress(params, retryable=False)
            self._done.clear()
            self._partial.clear()
            _add_note(failure, note)
            raise failure
        self._unfinished = self._progress(params)
        _add_note(failure, self._unfinished)
        raise failure

    def _progress(self, params: list[torch.nn.Parameter], retryable: bool = True) -> str:
        done = sum(p in self._done for p in params)
        partial = len(self._partial)
        head = f"strata.torch.optim: this step updated {done} of {len(params)} parameters" + (
            f" ({partial} more in part)" if partial else ""
        )
        if not retryable:
            return (
                head + "; the input is wrong, so a retry would fail the same way: the step "
                "stays as it is, and the next step() is a new one."
            )
        return (
            head + "; the states are safe (a state that could not be written stays in host "
            "memory). Call step() again, with the same gradients, to finish the step (what was "
            "updated is not updated twice), or load_state_dict() a checkpoint to abandon it."
        )

    # ---- torch.optim.AdamW's checkpoint format -----------------------------------------------

    def _rows(self, s: _States) -> torch.Tensor:
        """The parameter's state rows, its pieces joined."""
        parts = []
        for piece in s.pieces:
            with self.runtime.acquire(piece.states, Tier.HOST, Access.READ) as lease:
                parts.append(torch.from_dlpack(lease).clone())
        return torch.cat(parts, dim=1)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's format: per parameter index "step", "exp_avg", "exp_avg_sq"
        (fp32, the parameter's shape), plus "master" (the fp32 master weights, which torch
        ignores and keeps) for parameters that are not their own master (Note [Where the
        master weights live]), and param_groups with their hyperparameters."""
        if self._zero is not None:
            return self._zero.state_dict()
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
        self._done.clear()  # an unfinished step is abandoned
        self._partial.clear()
        self._unfinished = None
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
        if self._zero is not None:  # each rank takes its shards (Note [Shards])
            self._zero.load_state_dict(state_dict)
            return
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
            joined = torch.stack(rows)
            for piece in s.pieces:
                self.runtime.write(piece.states, joined[:, piece.lo : piece.hi].contiguous())

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._ready.join()  # no update may be reading a gradient it clears
        if self._unfinished is not None:
            raise InvalidArgumentError(
                "zero_grad(): the last step() failed and needs these gradients to finish "
                f"(Note [A failed step is finished, not repeated]). {self._unfinished}"
            )
        super().zero_grad(set_to_none)


def _add_note(e: BaseException, note: str) -> None:
    if hasattr(e, "add_note"):  # Python 3.11+
        e.add_note(note)
    elif e.args and isinstance(e.args[0], str):
        e.args = (f"{e.args[0]}\n{note}",) + e.args[1:]


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
