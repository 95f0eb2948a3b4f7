"""Training a model larger than device memory: parameters, gradients, optimizer states and
activations under one pair of budgets (ZeRO-Infinity on one device, Note [Training blocks]).

    model, opt = strata.torch.train.offload(model, lr=1e-4, device_budget="2GiB",
                                            host_budget="8GiB", nvme_dir="/mnt/nvme")
    loss = model(**batch).loss; loss.backward(); opt.step(); opt.zero_grad()
    strata.torch.train.save_checkpoint("ckpt", model, opt)   # load_checkpoint to resume

Every parameter's working copy (the model's dtype) and, for a trainable one, its fp32 master,
moments and gradient accumulator are runtime tensors homed on the host tier or on NVMe; the
module keeps placeholders. Each block's forward leases its working copies on the device tier
through the prefetch pipeline; its backward leases them again (the pipeline replays the
recorded iteration, so backward's leases are prefetched in reverse order); its gradients go to
the host tier as the block's backward ends, and strata's CPU Adam updates that parameter on a
worker thread while backward goes on.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import optim as _kernel
from .._core import Access, Tier
from .._errors import (
    Error,
    InvalidArgumentError,
    IoError,
    NotFoundError,
    OutOfMemoryError,
    UnsupportedError,
)
from .._pipeline import PrefetchPipeline
from .._runtime import Lease, Runtime, Tensor
from . import _threads
from ._activations import ActivationOffload
from ._activations import _bytes as _min_bytes
from ._offload import _placeholder, find_blocks
from ._runtimes import STATE_STRIPE, Budget, consumer_done, in_pages, make_runtime, on_stripes

__all__ = ["TrainOptimizer", "load_checkpoint", "offload", "parameters", "save_checkpoint"]

# Note [Training blocks]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A block (Note [Blocks] of _offload.py: each layer of the layer list, the embedding, the final
# norm, the head) runs in training as one autograd Function, _BlockFunction. Its forward leases
# the block's working copies on the device tier (pipeline step "<block>"), runs the module's
# forward on them and gives the leases back; its backward leases them again (step
# "<block>.backward"), differentiates the block and gives them back. The block's own graph is
# built in forward (activations kept) with the parameters' bytes saved as references, not as
# tensors (saved_tensors_hooks): backward's unpack resolves each reference in the lease of the
# moment, so no saved tensor pins a device lease between forward and backward. With
# checkpoint_activations=True the forward keeps only the block's inputs and backward recomputes
# the block (the RNG state of the forward restored) under the one lease it takes for both.
#
# The parameters the forward computes with are fresh leaves over the lease; their gradients
# come from torch.autograd.grad inside the block's backward, never from .grad, and leave the
# device as soon as the block's backward ends: to the worker thread, which adds each into the
# parameter's fp32 accumulator on the host tier (its pieces', _Piece) or, when this is the
# micro-batch that completes the step's gradient and no clipping waits for the global norm,
# straight into the update (one lease of each piece: the fewest bytes a step moves). A
# parameter used by several blocks (a tied embedding and head) counts its uses in the forward;
# its micro-batch is complete when every use has delivered.
#
# Note [A failed step is finished]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A failure in the worker (an NVMe read or write of a piece, say EIO or ENOSPC) is raised by
# the next step(), and every task from it on is kept, in order, with the pieces it has done;
# step() again runs them from where they stopped and then updates. An update that failed
# half-way keeps its step count and the pieces it updated, and does only the rest. So a step
# that raised and is called again is the step that never failed, bit for bit. A failure in a
# block's lease (its forward's or backward's reads) is tried again, _LEASE_TRIES times in all
# (reads are idempotent; a lease that failed holds nothing): a transient error costs a retry,
# a lasting one raises from forward() or backward() naming the block, and that micro-batch is
# lost (parameters already updated in its backward stay so): resume from the last checkpoint.
#
# Note [When a parameter is updated]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Without max_grad_norm, a parameter whose accumulation_steps-th micro-batch is complete is
# updated at once by the worker (Adam on each piece, the rounded result written into its
# working copy on its home), while backward goes on; step() waits for the worker and updates
# whatever remains (a step() called before accumulation_steps micro-batches). With
# max_grad_norm the update needs the global norm: the worker accumulates and, at each
# parameter's last micro-batch, adds its norm; step() then clips every accumulator by
# min(1, max_grad_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_ does, and updates.
# The clip is exact (no speculative update to roll back); the update then runs after backward.

# Note [Offloaded activations]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With offload_activations, what backward keeps of a block's forward goes to the host tier
# through offload_activations' machinery (Note [Saved activations] of _activations.py), so it
# counts in host_budget and, on CUDA, leaves the device: without checkpoint_activations the
# tensors the block's graph saves (its parameters are references into the lease, _Ref, and
# never move), with it the block's inputs, which _BlockFunction saves when apply returns (under
# hooks around apply). Backward brings each back, the one saved before it prefetched; the bytes
# round-trip exactly, so the gradients are the same bits.

# Note [Write-behind]
# ~~~~~~~~~~~~~~~~~~~
# When the NVMe-homed states do not fit the host tier, every piece an update touches is
# evicted again before the step is over, and making room is synchronous: the worker's next
# lease would wait for the write-back of a piece it finished, then for its own read. So each
# piece the worker has written is demoted at once by a thread of its own (write-behind), the
# disk writing one piece while the worker reads the next and computes; the room is free (a
# clean drop) by the time a lease asks for it. A write-back that fails leaves the piece's
# copy dirty on the host (Note [Making room] of room.cpp): nothing is lost, and the eviction
# that needs the room later tries again and raises where the step sees it.

_AGAIN = "step() again finishes it"
_LEASE_TRIES = 3  # a block's lease is tried again after an I/O error, this many times in all
_PIECE_ROWS = 4  # fp32 elements a trainable element keeps: master, moments, gradient


class _Piece(NamedTuple):
    """Elements [lo, hi) of a parameter's states (Note [Sub-groups] of optim.py): its fp32
    master and moments (3, n), and its gradient accumulator (n,), used only when a gradient
    waits (several micro-batches, or clipping): an update straight from backward reads and
    writes the 12 bytes an element a step must move, not 16."""

    states: Tensor
    acc: Tensor
    lo: int
    hi: int


@dataclass
class _Param:
    """One parameter (tied uses share it): where its working copy sits in a store and, when
    trainable, its pieces of states."""

    name: str  # the first name the module gives it
    names: list[str]
    shape: torch.Size
    dtype: torch.dtype
    trainable: bool
    placeholder: nn.Parameter
    store: Tensor | None = None  # the runtime tensor (bytes) holding its working copy
    offset: int = 0  # its bytes' start in the store
    pieces: list[_Piece] = field(default_factory=list)
    step: int = 0
    # The calls (forward uses) whose gradient has not come back: a graph dropped without its
    # backward (an evaluation with grad on, a failed forward) leaves the set with its calls.
    open_calls: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    micro_batches: int = 0  # complete micro-batches accumulated since the last update
    norm_sq: float = 0.0  # of the accumulated gradient, at its last micro-batch (clipping)
    has_grad: bool = False  # its accumulator holds a gradient not yet applied
    partial: set[int] | None = None  # pieces updated by an update that failed half-way
    # The gradient of this micro-batch's uses delivered so far, when more are to come (a tied
    # weight's head, before its embedding): a gradient in flight, in memory.
    pending: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def view(self, store_bytes: torch.Tensor) -> torch.Tensor:
        """Its working copy in a leased store's bytes (a uint8 tensor over the lease)."""
        return (
            store_bytes[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)
        )


@dataclass
class _Slot:
    owner: nn.Module
    attr: str
    use: int  # index into the block's params


@dataclass
class _Block:
    """A block (Note [Training blocks]): its parameters, once each, where they sit in the
    module, and the stores that hold them (Note [One store a block])."""

    name: str
    module: nn.Module
    params: list[_Param]
    slots: list[_Slot]
    stores: list[Tensor] = field(default_factory=list)
    store_of: list[int] = field(default_factory=list)  # per param, its index in stores
    forward: Any = None  # the module's own forward

    @property
    def nbytes(self) -> int:
        return sum(in_pages(t.nbytes) for t in self.stores)


class _Ref:
    """A saved tensor that is (a view of) a block's parameter: which store, and where in it,
    resolved in backward's lease."""

    __slots__ = ("dtype", "offset", "size", "store", "stride")

    def __init__(self, store: int, t: torch.Tensor) -> None:
        self.store, self.dtype, self.size, self.stride, self.offset = (
            store,
            t.dtype,
            t.size(),
            t.stride(),
            t.storage_offset(),
        )


class _Call:
    """One call of a block in training: what its Function's forward and backward share."""

    def __init__(self, trainer: _Trainer, block: _Block, flat: list, spec: Any, diff: list[int]):
        self.trainer, self.block, self.flat, self.spec, self.diff = trainer, block, flat, spec, diff
        self.out_spec: Any = None
        self.out_flat: list = []
        self.inner_out: list[torch.Tensor] = []  # the block's graph (activations kept)
        self.inner_in: list[torch.Tensor] = []
        self.leaves: list[torch.Tensor | None] = []
        self.graph_leaves: list[torch.Tensor | None] = []  # the forward's, kept by its graph
        self.stores: list[torch.Tensor] | None = None  # the leases of the moment, as bytes
        self.views: list[torch.Tensor] = []  # per param, its working copy in them
        self.rng: Any = None

    def run(self, inputs: Sequence[torch.Tensor], grad: bool) -> Any:
        """The module's forward on `inputs` (the differentiable ones) with the leased views."""
        flat = list(self.flat)
        for i, t in zip(self.diff, inputs):
            flat[i] = t
        args, kwargs = tree_unflatten(flat, self.spec)
        self.leaves = []
        for p, v in zip(self.block.params, self.views):  # the leaves are the parameters
            self.leaves.append(nn.Parameter(v.detach(), grad and p.trainable))
        for slot in self.block.slots:
            slot.owner._parameters[slot.attr] = self.leaves[slot.use]
        try:
            return self.block.forward(*args, **kwargs)
        finally:
            for slot in self.block.slots:
                slot.owner._parameters[slot.attr] = self.block.params[slot.use].placeholder

    def pack(self, t: torch.Tensor) -> Any:
        if self.stores is not None and t.device == self.stores[0].device:
            ptr = t.untyped_storage().data_ptr()
            for k, store in enumerate(self.stores):
                if store.untyped_storage().data_ptr() == ptr:
                    return _Ref(k, t)
        acts = self.trainer.activations
        return t if acts is None else acts.pack(t)

    def unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _Ref):
            if self.stores is None:
                raise RuntimeError(
                    f"strata.torch.train: block {self.block.name!r}'s parameters were used "
                    "outside its backward (backward twice through one forward?)"
                )
            typed = self.stores[saved.store].view(saved.dtype)
            return typed.as_strided(saved.size, saved.stride, saved.offset)
        acts = self.trainer.activations
        return saved if acts is None else acts.unpack(saved)


class _BlockFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, _anchor: torch.Tensor, *inputs: torch.Tensor) -> Any:
        tr = call.trainer
        ctx.call = call
        with tr.leased(call, call.block.name):
            if tr.checkpoint_activations:
                call.rng = _rng_state(inputs)
                with torch.no_grad():
                    out = call.run(inputs, grad=False)
                ctx.save_for_backward(*inputs)
            else:
                with (
                    torch.enable_grad(),
                    torch.autograd.graph.saved_tensors_hooks(call.pack, call.unpack),
                ):
                    call.inner_in = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
                    out = call.run(call.inner_in, grad=True)
            flat, call.out_spec = tree_flatten(out)
            call.out_flat = flat
            outs = [t for t in flat if isinstance(t, torch.Tensor)]
            if tr.checkpoint_activations:
                differentiable = [t.is_floating_point() for t in outs]
            else:
                call.inner_out = outs
                call.graph_leaves = call.leaves
                differentiable = [t.requires_grad for t in outs]
            for leaf in call.leaves:  # the leaves stay in the graph without the lease's bytes
                if leaf is not None:
                    leaf.data = torch.empty(0, dtype=leaf.dtype, device=leaf.device)
            call.leaves = []
        for p in call.block.params:
            if p.trainable:
                p.open_calls.add(call)
        result = tuple(t.detach() for t in outs)
        ctx.mark_non_differentiable(*[r for r, d in zip(result, differentiable) if not d])
        return result

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        call: _Call = ctx.call
        if call is None:
            raise RuntimeError(
                "strata.torch.train: backward through a block twice (retain_graph=True is not "
                "supported: its parameters' bytes were not kept)"
            )
        ctx.call = None  # the graph node keeps nothing of the trainer once it has run
        tr = call.trainer
        block = call.block
        saved = ctx.saved_tensors if tr.checkpoint_activations else ()
        with tr.leased(call, block.name + ".backward"):
            # In a function of its own: every tensor over the lease is gone when it returns.
            n_in, wrt_in, wrt_p, got = _differentiate(call, saved, grads)
        input_grads: list[torch.Tensor | None] = [None] * n_in
        for k, i in enumerate(wrt_in):
            input_grads[i] = got[k]
        tr.gradients(call, [(block.params[i], got[len(wrt_in) + k]) for k, i in enumerate(wrt_p)])
        return (None, None, *input_grads)


def _differentiate(call: _Call, saved: Sequence[torch.Tensor], grads: Sequence[Any]) -> Any:
    """A block's backward under its lease: the gradients of its differentiable inputs and of
    its trainable parameters (recomputing the block first with checkpoint_activations)."""
    tr, block = call.trainer, call.block
    if tr.checkpoint_activations:
        with torch.enable_grad(), torch.random.fork_rng(devices=_rng_devices(saved)):
            _set_rng_state(call.rng)
            inner_in = [t.detach().requires_grad_(t.requires_grad) for t in saved]
            out = call.run(inner_in, grad=True)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        del out
        leaves = call.leaves
    else:  # the graph of the forward, its parameters unpacked from this lease
        inner_in, outs, leaves = call.inner_in, call.inner_out, call.graph_leaves
    call.inner_out, call.inner_in, call.leaves, call.graph_leaves = [], [], [], []
    pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
    wrt_in = [i for i, t in enumerate(inner_in) if t.requires_grad]
    wrt_p = [i for i, p in enumerate(block.params) if p.trainable]
    wrt = [inner_in[i] for i in wrt_in] + [leaves[i] for i in wrt_p]
    got: Sequence[torch.Tensor | None] = [None] * len(wrt)
    if pairs and wrt:
        got = torch.autograd.grad(
            [o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True
        )
    return len(inner_in), wrt_in, wrt_p, list(got)


def _rng_devices(tensors: Sequence[torch.Tensor]) -> list[int]:
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


def _rng_state(tensors: Sequence[torch.Tensor]) -> Any:
    cuda = {d: torch.cuda.get_rng_state(d) for d in _rng_devices(tensors)}
    return torch.get_rng_state(), cuda


def _set_rng_state(state: Any) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for d, s in cuda.items():
        torch.cuda.set_rng_state(s, d)


class _Trainer:
    """What offload() installed on a module: its runtime, pipelines, blocks and parameters."""

    def __init__(
        self,
        module: nn.Module,
        runtime: Runtime,
        blocks: list[_Block],
        params: list[_Param],
        device: torch.device,
        prefetch: str,
        checkpoint_activations: bool,
        activations: ActivationOffload | None,
    ) -> None:
        self.module, self.runtime, self.blocks, self.params = module, runtime, blocks, params
        self.device = device
        self.checkpoint_activations = checkpoint_activations
        self.activations = activations  # Note [Offloaded activations]
        self.pipeline = PrefetchPipeline(runtime, prefetch)
        self._in_iteration = False
        self._open: str | None = None
        self._anchor = torch.empty(0, requires_grad=True)
        self.optimizer: weakref.ReferenceType[TrainOptimizer] | None = None
        self._hooks = [module.register_forward_pre_hook(self._begin_iteration)]
        for block in blocks:
            block.forward = block.module.forward
            block.module.forward = _BlockForward(self, block)

    def _begin_iteration(self, *_: Any) -> None:
        """A forward of the whole model starts an iteration (its forward, then its backward);
        the previous one ends here, or at step()."""
        if self._open is not None:
            return  # the root called from inside a block: not a new iteration
        self.end_iteration()
        self.pipeline._core.begin_iteration()
        self._in_iteration = True

    def end_iteration(self) -> None:
        if self._in_iteration:
            self._in_iteration = False
            self.pipeline._core.end_iteration()

    def leased(self, call: _Call, step: str) -> _Leased:
        return _Leased(self, call, step)

    def gradients(self, call: _Call, grads: list[tuple[_Param, torch.Tensor | None]]) -> None:
        """A block's backward delivers its parameters' gradients for one use (None: unused),
        to the worker as one batch (one lease of the block's store for their updates)."""
        for p, grad in grads:
            if grad is not None and grad.is_sparse:
                raise InvalidArgumentError(
                    f"parameter {p.name!r}: a sparse gradient (Adam needs dense ones; build the "
                    "embedding with sparse=False)"
                )
        tasks = []
        for p, grad in grads:
            p.open_calls.discard(call)
            tasks.append((p, grad, len(p.open_calls) == 0))
        opt = self.optimizer() if self.optimizer is not None else None
        if opt is not None:
            opt._deliver(tasks)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        for block in self.blocks:
            if block.forward is not None:
                block.module.forward = block.forward


class _BlockForward:
    """A block's forward in place of its own: one _BlockFunction in training, a plain leased
    call when no gradient is wanted (evaluation, generation)."""

    def __init__(self, trainer: _Trainer, block: _Block) -> None:
        self.trainer, self.block = trainer, block

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tr, block = self.trainer, self.block
        if tr._open is not None:
            raise InvalidArgumentError(
                f"strata.torch.train: block {block.name!r} was called inside block "
                f"{tr._open!r}; blocks must run one after another"
            )
        flat, spec = tree_flatten((args, kwargs))
        diff = [
            i
            for i, v in enumerate(flat)
            if isinstance(v, torch.Tensor) and v.requires_grad and v.is_floating_point()
        ]
        call = _Call(tr, block, flat, spec, diff)
        trainable = any(p.trainable for p in block.params)
        if not torch.is_grad_enabled() or (not diff and not trainable):
            with tr.leased(call, block.name), torch.no_grad():
                return call.run([], grad=False)
        anchor = tr._anchor
        if tr.activations is not None and tr.checkpoint_activations:
            # The inputs the Function saves (all a checkpointed block keeps) are packed when
            # apply returns, under the hooks of its caller: these.
            hooks = torch.autograd.graph.saved_tensors_hooks(
                tr.activations.pack, tr.activations.unpack
            )
            with hooks:
                outs = _BlockFunction.apply(call, anchor, *[flat[i] for i in diff])
        else:
            outs = _BlockFunction.apply(call, anchor, *[flat[i] for i in diff])
        it = iter(outs)
        out_flat = [next(it) if isinstance(v, torch.Tensor) else v for v in call.out_flat]
        call.out_flat = []
        return tree_unflatten(out_flat, call.out_spec)


class _Leased:
    """A block's pipeline step: its working copies leased on the device tier as call.views."""

    def __init__(self, trainer: _Trainer, call: _Call, step: str) -> None:
        self.trainer, self.call, self.step = trainer, call, step

    def __enter__(self) -> None:
        tr, block = self.trainer, self.call.block
        if not tr._in_iteration:  # a block run on its own
            tr.pipeline._core.begin_iteration()
            tr._in_iteration = True
        uses = [(t.id, Tier.DEVICE, Access.READ) for t in block.stores]
        for attempt in range(1, _LEASE_TRIES + 1):  # Note [A failed step is finished]
            try:
                cores = tr.pipeline._core.begin_step(self.step, uses)
                break
            except IoError as e:
                if attempt == _LEASE_TRIES:
                    raise IoError(
                        f"block {block.name!r} ({self.step}): its parameters could not be "
                        f"leased on the device in {_LEASE_TRIES} tries: {e}"
                    ) from e
        self.leases = [Lease(c, t) for c, t in zip(cores, block.stores)]
        stores = [torch.from_dlpack(lease) for lease in self.leases]
        self.call.stores = stores
        self.call.views = [p.view(stores[k]) for p, k in zip(block.params, block.store_of)]
        tr._open = block.name

    def __exit__(self, *exc: object) -> None:
        tr = self.trainer
        tr._open = None
        call = self.call
        call.stores, call.views = None, []
        consumer_done(tr.device)  # Note [Consumers' kernels]
        for lease in self.leases:
            lease.release()
        tr.pipeline._core.end_step()


def _write_behind(ref: weakref.ReferenceType, writes: queue.Queue) -> None:
    """Note [Write-behind]: demotes each tensor queued to NVMe (a failure leaves its newest
    copy where it was, dirty: the next eviction writes it, or raises where a step sees it)."""
    while (t := writes.get()) is not None:
        opt = ref()
        if opt is not None:
            try:
                opt._rt.evict(t, Tier.HOST)
            except Error:
                opt.write_behind_failures += 1
        del opt


def _work(ref: weakref.ReferenceType, tasks: queue.Queue) -> None:
    """The update thread: holds the optimizer only while it runs a task, so the optimizer can
    be collected (which queues the None that ends this)."""
    while (task := tasks.get()) is not None:
        try:
            opt = ref()
            if opt is not None:
                opt._run(task)
            del opt
        finally:
            tasks.task_done()
    tasks.task_done()


@dataclass
class _Task:
    param: _Param
    grad: torch.Tensor | None
    complete: bool  # the micro-batch's last use of the parameter
    done: set[int] = field(default_factory=set)  # pieces whose accumulator has it
    counted: bool = False  # the micro-batch counted (complete)
    first: bool = False  # the accumulator's first gradient since the last update
    fused: bool | None = None  # straight into the update (decided at its first try)


class TrainOptimizer(torch.optim.Optimizer):
    """The optimizer offload() returns: torch.optim.AdamW's (or Adam's) formula and API over
    the states in the runtime (Note [When a parameter is updated]).

    ``param_groups`` holds one group (lr, betas, eps, weight_decay: schedulers change them);
    ``state_dict()`` / ``load_state_dict()`` use torch.optim.AdamW's format (the parameters
    numbered in the model's order, their working copies' names in ``"param_names"``), plus the
    fp32 masters under ``"strata_master"``; ``stats()`` the budgets' peaks and NVMe traffic.
    """

    def __init__(
        self,
        trainer: _Trainer,
        adamw: bool,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        max_grad_norm: float | None,
        accumulation_steps: int,
        write_behind: bool = False,
    ) -> None:
        self._trainer = trainer
        self._train = [p for p in trainer.params if p.trainable]
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
        super().__init__([p.placeholder for p in self._train], defaults)
        self._adamw = adamw
        self.max_grad_norm = max_grad_norm
        self.accumulation_steps = accumulation_steps
        self.last_grad_norm: float | None = None
        self.steps = 0
        self.updates_during_backward = 0
        self._tasks: queue.Queue[list[_Task] | None] = queue.Queue()
        self._failure: BaseException | None = None
        # Note [A failed step is finished]: the tasks a failure stopped (and those queued after
        # it, kept in order), finished by the next step().
        self._unfinished: list[_Task] = []
        self._scale: float | None = None  # this step's clip, once computed
        self._rt = trainer.runtime  # the worker leases on the host tier directly
        # Both threads end at exit (_threads.py).
        self._worker = _threads.start(
            _work, (weakref.ref(self), self._tasks), self._tasks, "strata-adam"
        )
        weakref.finalize(self, self._tasks.put, None)
        self._writes: queue.Queue[Tensor | None] | None = None
        self.write_behind_failures = 0  # demotions that failed (the pieces kept, dirty)
        if write_behind:  # Note [Write-behind]
            self._writes = queue.Queue()
            self._writer = _threads.start(
                _write_behind,
                (weakref.ref(self), self._writes),
                self._writes,
                "strata-write-behind",
            )
            weakref.finalize(self, self._writes.put, None)
        trainer.optimizer = weakref.ref(self)

    # -- the worker --

    def _deliver(self, grads: list[tuple[_Param, torch.Tensor | None, bool]]) -> None:
        tasks = []
        for p, grad, complete in grads:
            if grad is not None:
                grad = grad.detach()
                if grad.device.type != "cpu":
                    grad = grad.to("cpu", non_blocking=False)
                grad = grad.to(torch.float32).contiguous().view(-1)
            tasks.append(_Task(p, grad, complete))
        self._tasks.put(tasks)

    def _run(self, tasks: list[_Task]) -> None:
        for i, task in enumerate(tasks):
            if self._failure is not None or self._unfinished:
                self._unfinished.append(task)
                continue
            if i == 0:
                self._hint(task.param)
            if i + 1 < len(tasks):  # its reads under way while this one computes
                self._hint(tasks[i + 1].param)
            try:
                self._accumulate(task)
            except Error as e:  # raised by step()
                self._failure = type(e)(f"{e} (the step is kept where it stopped: {_AGAIN})")
                self._unfinished.append(task)
            except BaseException as e:  # noqa: BLE001 (raised by step())
                self._failure = e
                self._unfinished.append(task)

    def _accumulate(self, task: _Task) -> None:
        try:
            self._accumulate_pieces(task)
        except Error as e:  # the error names the parameter
            raise type(e)(f"parameter {task.param.name!r}: {e}") from e

    def _accumulate_pieces(self, task: _Task) -> None:
        p, g = task.param, task.grad
        if not task.complete:  # another use of p in this micro-batch follows (a tied weight)
            if g is not None:  # kept in memory till then: no trip through the accumulator
                p.pending = g if p.pending is None else p.pending.add_(g)
            return
        if p.pending is not None:  # the earlier uses', then this one's (torch's order)
            g = p.pending if g is None else p.pending.add_(g)
            task.grad, p.pending = g, None  # a retry goes on with the sum
        if task.fused is None:  # decided once, so that a retry goes on the same way
            task.fused = (
                g is not None
                and task.complete
                and self.max_grad_norm is None
                and (p.micro_batches + 1) % self.accumulation_steps == 0
            )
        if task.fused:  # this micro-batch completes the gradient: straight into the update
            if not task.counted:
                p.micro_batches += 1
                task.counted = True
            self._update_pieces(p, 1.0, g)
            self.updates_during_backward += 1
            return
        if g is not None:
            if not task.done:
                task.first = not p.has_grad
            for k, piece in enumerate(p.pieces):
                if k in task.done:
                    continue
                self._ahead(p, k, acc=True)
                with self._rt.acquire(piece.acc, Tier.HOST, Access.READ_WRITE) as lease:
                    acc = torch.from_dlpack(lease)
                    if task.first:
                        acc.copy_(g[piece.lo : piece.hi])
                    else:
                        acc.add_(g[piece.lo : piece.hi])
                    del acc
                task.done.add(k)
                if self._writes is not None:
                    self._writes.put(piece.acc)
            p.has_grad = True
        if not task.complete:
            return
        if not task.counted:
            p.micro_batches += 1
            task.counted = True
        if not p.has_grad:
            return
        if self.max_grad_norm is not None:
            if p.micro_batches % self.accumulation_steps == 0:
                p.norm_sq = self._norm_sq_pieces(p)
            return
        if p.micro_batches % self.accumulation_steps == 0:
            self._update_pieces(p, 1.0)
            self.updates_during_backward += 1

    def _hint(self, p: _Param) -> None:
        """Starts bringing `p`'s store and first piece of states (NVMe-homed) to the host."""
        if not p.pieces or self._rt.resident(p.pieces[0].states, Tier.HOST):
            return
        # A hint: no room now, or a failed write-back making it (the lease that follows
        # meets that again and raises where the step sees it), is no error here.
        with contextlib.suppress(Error):
            self._rt.prefetch(p.store, Tier.HOST)
            self._rt.prefetch(p.pieces[0].states, Tier.HOST)

    def _ahead(self, p: _Param, k: int, acc: bool = False, states: bool = True) -> None:
        """Brings piece k + 1 of `p` (NVMe-homed) to the host while piece k works."""
        if k + 1 < len(p.pieces):
            nxt = p.pieces[k + 1]
            if states:
                self._rt.prefetch(nxt.states, Tier.HOST)
            if acc:
                self._rt.prefetch(nxt.acc, Tier.HOST)

    def _norm_sq(self, p: _Param) -> float:
        try:
            return self._norm_sq_pieces(p)
        except Error as e:  # the error names the parameter
            raise type(e)(f"parameter {p.name!r}: {e}") from e

    def _norm_sq_pieces(self, p: _Param) -> float:
        total = torch.zeros((), dtype=torch.float32)
        for k, piece in enumerate(p.pieces):
            self._ahead(p, k, acc=True, states=False)
            with self._rt.acquire(piece.acc, Tier.HOST, Access.READ) as lease:
                total += torch.linalg.vector_norm(torch.from_dlpack(lease)) ** 2
        return float(total)

    def _update(self, p: _Param, scale: float) -> None:
        try:
            return self._update_pieces(p, scale)
        except Error as e:  # the error names the parameter
            raise type(e)(f"parameter {p.name!r}: {e}") from e

    def _update_pieces(self, p: _Param, scale: float, grad: torch.Tensor | None = None) -> None:
        """Adam on each of `p`'s pieces, the rounded result written into its working copy. The
        gradient: the accumulator (times `scale`) with `grad` added when given, or `grad`
        alone when nothing waits in the accumulator."""
        group = self.param_groups[0]
        if p.partial is None:  # this update's first try
            p.step += 1
            p.partial = set()
        with self._rt.acquire(p.store, Tier.HOST, Access.READ_WRITE) as w:
            self._update_in(p, p.view(torch.from_dlpack(w)).view(-1), group, scale, grad)
        p.partial = None
        p.has_grad = False
        p.micro_batches = 0
        p.norm_sq = 0.0

    def _update_in(
        self,
        p: _Param,
        work: torch.Tensor,
        group: dict,
        scale: float,
        grad: torch.Tensor | None,
    ) -> None:
        """_update_pieces' pieces, `work` the working copy in its leased store."""
        copy = work if work.dtype in (torch.bfloat16, torch.float16) else None
        use_acc = grad is None or p.has_grad
        for k, piece in enumerate(p.pieces):
            if k in p.partial:
                continue
            lo, hi = piece.lo, piece.hi
            self._ahead(p, k, acc=use_acc)
            with self._rt.acquire(piece.states, Tier.HOST, Access.READ_WRITE) as lease:
                rows = torch.from_dlpack(lease)
                if use_acc:
                    with self._rt.acquire(piece.acc, Tier.HOST, Access.READ) as a:
                        g = torch.from_dlpack(a).clone()  # read only: no write-back owed
                    if grad is not None:
                        g.add_(grad[lo:hi])  # the accumulated micro-batches, then this one
                    if scale != 1.0:
                        g.mul_(scale)
                else:
                    g = grad[lo:hi]
                _kernel.adam_step(
                    rows[0],
                    g,
                    rows[1],
                    rows[2],
                    step=p.step,
                    lr=group["lr"],
                    betas=tuple(group["betas"]),
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    adamw=self._adamw,
                    param_copy=None if copy is None else copy[lo:hi],
                )
                if copy is None:
                    work[lo:hi].copy_(rows[0])
                del rows, g
            p.partial.add(k)  # updated: a failure from here on is the write's
            if self._writes is not None:
                self._writes.put(piece.states)
                if use_acc:
                    self._writes.put(piece.acc)

    def _wait(self) -> None:
        self._tasks.join()
        if self._failure is not None:
            e, self._failure = self._failure, None
            raise e

    # -- torch.optim.Optimizer --

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._wait()
        self._trainer.end_iteration()  # a prefetch's failure is raised here, before any update
        try:
            self._finish_step()
        except Error as e:
            raise type(e)(f"{e} (the step is kept where it stopped: {_AGAIN})") from e
        self.steps += 1
        return loss

    def _finish_step(self) -> None:
        """The rest of a step after backward: the tasks a failure stopped, then every
        parameter's update that did not run during backward."""
        while self._unfinished:  # Note [A failed step is finished]
            self._accumulate(self._unfinished[0])
            self._unfinished.pop(0)
        pending = [p for p in self._train if p.has_grad]
        if self._scale is None:  # once a step: a step() again keeps the first one's clip
            self._scale = 1.0
            if self.max_grad_norm is not None:
                for p in pending:
                    if p.micro_batches % self.accumulation_steps != 0:
                        p.norm_sq = self._norm_sq(p)  # a step() before the last micro-batch
                norm = math.sqrt(sum(p.norm_sq for p in pending))
                self.last_grad_norm = norm
                self._scale = min(1.0, self.max_grad_norm / (norm + 1e-6))
        for p in pending:
            self._update(p, self._scale)
        self._scale = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradients live in the accumulators, emptied by each update: nothing to do once a
        step() has run; before one, the accumulated micro-batches are dropped. After a step()
        that raised, call step() again to finish it (Note [A failed step is finished])."""
        self._wait()
        if self._unfinished or any(p.partial is not None for p in self._train):
            raise InvalidArgumentError(
                "zero_grad: the last step() failed half-way (some parameters are updated, some "
                "not); call step() again to finish it"
            )
        for p in self._train:
            p.has_grad = False
            p.micro_batches = 0
            p.norm_sq = 0.0

    def stats(self) -> dict[str, Any]:
        """peak_device_bytes, peak_host_bytes, nvme_bytes_read, nvme_bytes_written (since the
        runtime was made), steps, updates_during_backward, and the runtime's and pipeline's."""
        rt = self._trainer.runtime.stats()
        moved = rt["transfers"]
        acts = self._trainer.activations
        return {
            "peak_device_bytes": rt["tiers"]["Device"]["peak_bytes"],
            "peak_host_bytes": rt["tiers"]["Host"]["peak_bytes"],
            "device_budget": rt["tiers"]["Device"]["capacity_bytes"],
            "host_budget": rt["tiers"]["Host"]["capacity_bytes"],
            "nvme_bytes_read": moved["bytes_nvme_to_host"] + moved["bytes_nvme_to_device"],
            "nvme_bytes_written": moved["bytes_host_to_nvme"] + moved["bytes_device_to_nvme"],
            "steps": self.steps,
            "updates_during_backward": self.updates_during_backward,
            "write_behind": self._writes is not None,
            "write_behind_failures": self.write_behind_failures,
            "pipeline": self._trainer.pipeline.stats(),
            "activations": None
            if acts is None
            else {
                "offloaded": acts.offloaded,
                "offloaded_bytes": acts.offloaded_bytes,
                "kept": acts.kept,
            },
            "runtime": rt,
        }

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's format (whole tensors, in memory: save_checkpoint streams)."""
        self._wait()
        state = {}
        masters = {}
        for i, p in enumerate(self._train):
            if p.step == 0:
                continue
            rows = _read_rows(self._trainer.runtime, p)
            state[i] = {  # fp32 moments whatever the model's dtype (they are kept so)
                "step": torch.tensor(float(p.step)),
                "exp_avg": rows[1].view(p.shape).clone(),
                "exp_avg_sq": rows[2].view(p.shape).clone(),
            }
            masters[i] = rows[0].view(p.shape).clone()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        groups[0]["params"] = list(range(len(self._train)))
        groups[0]["param_names"] = [p.name for p in self._train]
        return {"state": state, "param_groups": groups, "strata_master": masters}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._wait()
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self._train):
            raise InvalidArgumentError(
                f"load_state_dict: {sum(len(g['params']) for g in groups)} parameters in "
                f"{len(groups)} groups; this optimizer has {len(self._train)} in 1"
            )
        names = groups[0].get("param_names")
        if names is not None:
            for want, p in zip(names, self._train):
                if want != p.name:
                    raise InvalidArgumentError(
                        f"load_state_dict: parameter {p.name!r} is {want!r} in the state"
                    )
        for k, v in groups[0].items():
            if k not in ("params", "param_names"):
                self.param_groups[0][k] = v
        masters = state_dict.get("strata_master", {})
        rt = self._trainer.runtime
        for i, p in enumerate(self._train):
            s = state_dict["state"].get(i)
            if s is None:
                continue
            master = masters.get(i)
            if master is None:  # torch's own state: the working copy is the master
                master = _read_work(rt, p).to(torch.float32)
            _write_rows(rt, p, master, s["exp_avg"], s["exp_avg_sq"])
            p.step = int(s["step"])

    def close(self) -> None:
        """Stops the worker thread (after the updates queued); also done when collected."""
        if self._worker.is_alive():
            self._tasks.put(None)
            self._worker.join()
        if self._writes is not None and self._writer.is_alive():
            self._writes.put(None)
            self._writer.join()


def _read_rows(rt: Runtime, p: _Param) -> torch.Tensor:
    rows = torch.empty((3, p.shape.numel()), dtype=torch.float32)
    for piece in p.pieces:
        with rt.acquire(piece.states, Tier.HOST, Access.READ) as lease:
            rows[:, piece.lo : piece.hi].copy_(torch.from_dlpack(lease))
    return rows


def _write_rows(rt: Runtime, p: _Param, master: Any, m: Any, v: Any) -> None:
    src = [t.detach().to("cpu", torch.float32).reshape(-1) for t in (master, m, v)]
    for piece in p.pieces:
        with rt.acquire(piece.states, Tier.HOST, Access.READ_WRITE) as lease:
            rows = torch.from_dlpack(lease)
            for r in range(3):
                rows[r].copy_(src[r][piece.lo : piece.hi])
            del rows


def _read_work(rt: Runtime, p: _Param) -> torch.Tensor:
    with rt.acquire(p.store, Tier.HOST, Access.READ) as lease:
        return p.view(torch.from_dlpack(lease)).clone()


def _write_work(rt: Runtime, p: _Param, value: torch.Tensor) -> None:
    with rt.acquire(p.store, Tier.HOST, Access.READ_WRITE) as lease:
        t = p.view(torch.from_dlpack(lease))
        t.copy_(value)
        del t


# -- offload --


def _piece_bounds(n: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(n, lo + size)) for lo in range(0, max(n, 1), size)]


def offload(
    model: nn.Module,
    optimizer: str = "adamw",
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    device: str | torch.device = "cpu",
    device_budget: Budget = "2GiB",
    host_budget: Budget = "8GiB",
    nvme_dir: str | os.PathLike[str] | None = None,
    nvme_capacity: Budget | None = None,
    dtype: torch.dtype | None = None,
    checkpoint_activations: bool = False,
    offload_activations: bool | Budget = False,
    max_grad_norm: float | None = None,
    accumulation_steps: int = 1,
    sub_group_size: int | None = None,
    prefetch: str = "auto",
    blocks: Sequence[str] | None = None,
    runtime: Runtime | None = None,
    home: str | None = None,
) -> tuple[nn.Module, TrainOptimizer]:
    """Moves `model`'s parameters into a strata Runtime and returns the model and its optimizer
    (Note [Training blocks]): `device` computes ("cpu": the host backend, its device tier a CPU
    arena of `device_budget`; "cuda"), each block's working copies leased there; the working
    copies, fp32 masters, moments and gradients live on the host tier (`host_budget`) or, with
    `nvme_dir`, on NVMe. `optimizer` is "adamw" or "adam" (torch's formulas); `dtype` casts the
    working copies (the masters stay fp32). Parameters with requires_grad=False stream read-only
    and get no state. The module's parameters become placeholders; its buffers move to `device`.
    `runtime` uses a Runtime of the caller's instead of making one (its budgets); `home`
    ("host" or "nvme", "nvme" by default when `nvme_dir` is given) says where the tensors live.
    `offload_activations` (True: "1MiB", or the least bytes a tensor must have) moves what
    backward keeps of the activations, every block's inputs with `checkpoint_activations`, to
    the host tier (Note [Offloaded activations]).
    """
    if isinstance(model, (str, os.PathLike)):
        model = _from_checkpoint_dir(model, dtype)
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"offload: {type(model).__name__} is not an nn.Module")
    if optimizer not in ("adamw", "adam"):
        raise InvalidArgumentError(f'optimizer: {optimizer!r} is not "adamw" or "adam"')
    if lr < 0:
        raise InvalidArgumentError(f"lr: {lr} is negative")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise InvalidArgumentError(f"betas: {betas} are not in [0, 1)")
    if accumulation_steps < 1:
        raise InvalidArgumentError(f"accumulation_steps: {accumulation_steps} is below 1")
    if max_grad_norm is not None and max_grad_norm <= 0:
        raise InvalidArgumentError(f"max_grad_norm: {max_grad_norm} is not positive")
    if nvme_dir is not None and not os.path.isdir(nvme_dir):
        raise NotFoundError(f"nvme_dir {os.fspath(nvme_dir)!r}: no such directory")
    dev = torch.device(device)
    found = find_blocks(model, blocks)
    if not found:
        raise InvalidArgumentError("offload: the module has no parameters")
    # The parameters, once each (tied ones are one), in the model's order.
    unique: dict[int, tuple[str, nn.Parameter, list[str]]] = {}
    for name, prm in model.named_parameters(remove_duplicate=False):
        if id(prm) in unique:
            unique[id(prm)][2].append(name)
        else:
            unique[id(prm)] = (name, prm, [name])
    for name, prm, _ in unique.values():
        if prm.device.type == "meta":
            raise InvalidArgumentError(f"parameter {name!r} is on the meta device: no values")
    if home is None:
        home = "nvme" if nvme_dir is not None else "host"
    if home not in ("host", "nvme"):
        raise InvalidArgumentError(f'home: {home!r} is not "host" or "nvme"')
    if home == "nvme" and nvme_dir is None and runtime is None:
        raise InvalidArgumentError('home="nvme" needs nvme_dir (a directory on the drive)')
    home = Tier.NVME if home == "nvme" else Tier.HOST
    work_dtype = {
        id(prm): (dtype if dtype is not None and prm.is_floating_point() else prm.dtype)
        for _, prm, _ in unique.values()
    }
    trainable_elems = sum(prm.numel() for _, prm, _ in unique.values() if prm.requires_grad)
    work_bytes = sum(prm.numel() * work_dtype[id(prm)].itemsize for _, prm, _ in unique.values())
    state_bytes = 4 * _PIECE_ROWS * trainable_elems
    if nvme_capacity is None and nvme_dir is not None:  # each tensor: at most on_stripes
        nvme_capacity = STATE_STRIPE  # and a stripe of slack
        for _, prm, _ in unique.values():
            nvme_capacity += on_stripes(prm.numel() * work_dtype[id(prm)].itemsize)
            if prm.requires_grad:
                for lo, hi in _piece_bounds(prm.numel(), sub_group_size or prm.numel()):
                    nvme_capacity += on_stripes(12 * (hi - lo)) + on_stripes(4 * (hi - lo))
        if sub_group_size is None:  # pieces not known yet: 2 stripes more for each 64 Ki elements
            nvme_capacity += 2 * STATE_STRIPE * (trainable_elems // (1 << 16) + len(unique))
    if runtime is None:
        runtime = make_runtime(
            dev, device_budget, host_budget, nvme_dir, nvme_capacity or "4MiB", stripe=STATE_STRIPE
        )
    host_cap = runtime.stats()["tiers"]["Host"]["capacity_bytes"]
    dev_cap = runtime.stats()["tiers"]["Device"]["capacity_bytes"]
    if sub_group_size is None:  # a piece's four fp32 rows: at most a quarter of the host tier
        sub_group_size = max(1024, host_cap // 4 // (4 * _PIECE_ROWS))
    if 4 * _PIECE_ROWS * sub_group_size > host_cap:
        raise OutOfMemoryError(
            f"sub_group_size {sub_group_size}: a piece's fp32 master, moments and gradient "
            f"({4 * _PIECE_ROWS * sub_group_size} bytes) do not fit the host tier ({host_cap} "
            "bytes): lower it or raise host_budget"
        )
    if home == Tier.HOST and work_bytes + state_bytes > host_cap:
        raise OutOfMemoryError(
            f"the working copies ({work_bytes} bytes) and the trainable parameters' fp32 master, "
            f"moments and gradients ({state_bytes} bytes) do not fit the host tier ({host_cap} "
            "bytes, host_budget less the staging slots): raise host_budget or pass nvme_dir"
        )
    for name, prm, _ in unique.values():
        nbytes = in_pages(prm.numel() * work_dtype[id(prm)].itemsize)
        if home == Tier.HOST and nbytes > host_cap:
            raise OutOfMemoryError(f"parameter {name!r}: {nbytes} bytes, the host tier {host_cap}")
    # The parameters, then the blocks that use them (each parameter once a block).
    params: dict[int, _Param] = {}
    for name, prm, names in unique.values():
        dt = work_dtype[id(prm)]
        params[id(prm)] = _Param(
            name=name,
            names=names,
            shape=prm.shape,
            dtype=dt,
            trainable=prm.requires_grad,
            placeholder=_placeholder(prm.shape, dt, dev),
        )
        params[id(prm)].placeholder.requires_grad_(prm.requires_grad)
    built: list[_Block] = []
    users: dict[int, int] = {}  # id of a _Param -> how many blocks use it
    for bname, module in found:
        uses: list[_Param] = []
        index: dict[int, int] = {}
        slots: list[_Slot] = []
        for owner in module.modules():
            for attr, prm in list(owner._parameters.items()):
                if prm is None:
                    continue
                if id(prm) not in index:
                    index[id(prm)] = len(uses)
                    uses.append(params[id(prm)])
                    users[id(uses[-1])] = users.get(id(uses[-1]), 0) + 1
                slots.append(_Slot(owner, attr, index[id(prm)]))
        built.append(_Block(bname or type(module).__name__, module, uses, slots))
    # Note [One store a block]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~
    # A block's working copies are one runtime tensor of bytes, each parameter at a 64-byte
    # aligned offset: a block's lease is one placement on the device tier, so the tier never
    # has to find room for a dozen tensors of a block among the holes the last block left (it
    # fragments, and a budget near the block's size then refuses a block that fits). A
    # parameter used by several blocks (a tied embedding and head) is a store of its own, which
    # each of those blocks leases beside its store.
    with torch.no_grad():
        by_id = {id(params[id(prm)]): prm for _, prm, _ in unique.values()}
        shared: dict[int, Tensor] = {}
        for block in built:
            own = [p for p in block.params if users[id(p)] == 1]
            offset = 0
            for p in own:
                p.offset = offset
                offset += -(-p.nbytes // 64) * 64
            store = None
            if own:
                init = torch.empty(max(offset, 64), dtype=torch.uint8)
                for p in own:
                    value = by_id[id(p)].detach().to("cpu", p.dtype).contiguous()
                    p.view(init).copy_(value.view(p.shape))
                store = runtime.create_tensor(
                    f"w.{block.name}", (init.numel(),), "uint8", home=home, init=init
                )
                del init
                for p in own:
                    p.store = store
                block.stores.append(store)
            for p in block.params:
                if users[id(p)] == 1:
                    block.store_of.append(0)
                    continue
                if id(p) not in shared:
                    value = by_id[id(p)].detach().to("cpu", p.dtype).contiguous()
                    raw = torch.empty(-(-p.nbytes // 64) * 64, dtype=torch.uint8)
                    p.view(raw).copy_(value.view(p.shape))
                    shared[id(p)] = runtime.create_tensor(
                        f"w.{p.name}", (raw.numel(),), "uint8", home=home, init=raw
                    )
                    p.store = shared[id(p)]
                if shared[id(p)] not in block.stores:
                    block.stores.append(shared[id(p)])
                block.store_of.append(
                    next(k for k, t in enumerate(block.stores) if t.id == shared[id(p)].id)
                )
            if block.nbytes > dev_cap:
                raise OutOfMemoryError(
                    f"block {block.name!r}: its parameters take {block.nbytes} bytes and the "
                    f"device tier holds {dev_cap} (device_budget): raise device_budget or pass "
                    "blocks=[...] naming smaller submodules"
                )
            if block.nbytes + in_pages(4 * _PIECE_ROWS * sub_group_size) > host_cap:
                raise OutOfMemoryError(
                    f"block {block.name!r}: its parameters ({block.nbytes} bytes) and a piece of "
                    f"states ({4 * _PIECE_ROWS * sub_group_size} bytes) do not fit the host tier "
                    f"({host_cap} bytes), where an update writes them: raise host_budget"
                )
        # The trainable parameters' pieces: fp32 master (the values), zero moments and gradient.
        for _, prm, _ in unique.values():
            p = params[id(prm)]
            if not p.trainable:
                continue
            master = prm.detach().to("cpu", torch.float32).reshape(-1)
            for k, (lo, hi) in enumerate(_piece_bounds(prm.numel(), sub_group_size)):
                init = torch.zeros((3, hi - lo), dtype=torch.float32)
                init[0].copy_(master[lo:hi])
                states = runtime.create_tensor(
                    f"s{k}.{p.name}", tuple(init.shape), torch.float32, home=home, init=init
                )
                acc = runtime.create_tensor(f"g{k}.{p.name}", (hi - lo,), torch.float32, home=home)
                p.pieces.append(_Piece(states, acc, lo, hi))
                del init
    # The module keeps placeholders; its buffers go to the device.
    for block in built:
        for slot in block.slots:
            slot.owner._parameters[slot.attr] = block.params[slot.use].placeholder
    for owner in model.modules():
        for bname_, buf in list(owner._buffers.items()):
            if buf is not None:
                owner._buffers[bname_] = buf.to(dev)
    acts = None
    if offload_activations is not False and offload_activations is not None:
        least = "1MiB" if offload_activations is True else offload_activations
        acts = ActivationOffload(runtime, Tier.HOST, _min_bytes(least))
    trainer = _Trainer(
        model,
        runtime,
        built,
        list(params.values()),
        dev,
        prefetch,
        checkpoint_activations,
        acts,
    )
    opt = TrainOptimizer(
        trainer,
        optimizer == "adamw",
        lr,
        tuple(betas),
        eps,
        weight_decay,
        max_grad_norm,
        accumulation_steps,
        # Note [Write-behind]: the states cycle through a host tier that cannot hold them.
        write_behind=home == Tier.NVME and work_bytes + state_bytes > host_cap,
    )
    model._strata_trainer = trainer  # type: ignore[attr-defined]
    return model, opt


def _from_checkpoint_dir(path: str | os.PathLike[str], dtype: torch.dtype | None) -> nn.Module:
    """A Hugging Face causal LM from a checkpoint directory, built tensor by tensor."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ._checkpoint import checkpoint_files

    root = Path(path)
    if not (root / "config.json").is_file():
        raise NotFoundError(f"{os.fspath(root)!r}: no config.json (not a checkpoint directory)")
    from ._load import parameters_on_meta

    config = AutoConfig.from_pretrained(root)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _load_parameters(model, checkpoint_files(root))
    return model


def parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The working copies of `model`'s parameters as CPU tensors, by name (each tied name
    once, the first), read from wherever they live: a copy, for inspection and tests."""
    tr = _trainer_of(model)
    if tr.optimizer is not None and (opt := tr.optimizer()) is not None:
        opt._wait()
    return {p.name: _read_work(tr.runtime, p) for p in tr.params}


def _trainer_of(model: nn.Module) -> _Trainer:
    tr = getattr(model, "_strata_trainer", None)
    if tr is None:
        raise InvalidArgumentError("the model was not made by strata.torch.train.offload")
    return tr


# -- checkpoints --

_SHARD_BYTES = 1 << 30


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    opt: TrainOptimizer,
    shard_bytes: int | None = None,
) -> None:
    """Writes `model`'s parameters as Hugging Face safetensors shards (``model.safetensors`` or
    ``model-0000k-of-0000n.safetensors`` with their index; ``config.json`` when the model has a
    config, so ``from_pretrained`` loads the directory) and the optimizer's fp32 masters and
    moments (``optimizer-*.safetensors``) with its groups and steps (``optimizer.json``), tensor
    by tensor from wherever they live: a shard holds at most `shard_bytes` (a quarter of the
    host budget by default, at most 1 GiB) in memory."""
    from safetensors.torch import save_file

    tr = _trainer_of(model)
    opt._wait()
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    rt = tr.runtime
    if shard_bytes is None:
        shard_bytes = min(_SHARD_BYTES, rt.stats()["tiers"]["Host"]["capacity_bytes"] // 4)
    persistent = dict(model.state_dict(keep_vars=True))

    def shards(items: Iterable[tuple[str, int, Any]], stem: str) -> dict[str, str]:
        """Writes the (key, bytes, read) items in shards of at most shard_bytes; key -> file."""
        groups: list[list[tuple[str, Any]]] = [[]]
        size = 0
        for key, nbytes, read in items:
            if groups[-1] and size + nbytes > shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append((key, read))
            size += nbytes
        where = {}
        n = len(groups)
        for k, group in enumerate(groups):
            name = f"{stem}.safetensors" if n == 1 else f"{stem}-{k + 1:05d}-of-{n:05d}.safetensors"
            tensors = {key: read() for key, read in group}
            tmp = root / (name + ".tmp")
            save_file(tensors, os.fspath(tmp), metadata={"format": "pt"})
            os.replace(tmp, root / name)
            where.update(dict.fromkeys(tensors, name))
            del tensors
        return where

    seen = {p.name for p in tr.params}
    model_items = [(p.name, p.nbytes, lambda p=p: _read_work(rt, p)) for p in tr.params]
    for key, value in persistent.items():  # buffers the state dict keeps
        if key not in seen and not isinstance(value, nn.Parameter) and key not in _tied_names(tr):
            model_items.append(
                (key, value.numel() * value.element_size(), lambda v=value: v.detach().cpu())
            )
    where = shards(model_items, "model")
    if len(set(where.values())) > 1:
        index = {"metadata": {"total_size": sum(n for _, n, _ in model_items)}, "weight_map": where}
        (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(root)
    train = opt._train
    opt_items = []
    for i, p in enumerate(train):
        if p.step == 0:
            continue
        for r, label in enumerate(("master", "exp_avg", "exp_avg_sq")):

            def read(p: _Param = p, r: int = r) -> torch.Tensor:
                out = torch.empty(p.shape.numel(), dtype=torch.float32)
                for piece in p.pieces:
                    with rt.acquire(piece.states, Tier.HOST, Access.READ) as lease:
                        out[piece.lo : piece.hi].copy_(torch.from_dlpack(lease)[r])
                return out.view(p.shape)

            opt_items.append((f"{i}.{label}", 4 * p.shape.numel(), read))
    opt_where = shards(opt_items, "optimizer") if opt_items else {}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    groups[0]["params"] = list(range(len(train)))
    groups[0]["param_names"] = [p.name for p in train]
    meta = {
        "format": "strata.torch.train/1",
        "optimizer": "adamw" if opt._adamw else "adam",
        "param_groups": groups,
        "steps": {str(i): p.step for i, p in enumerate(train) if p.step},
        "optimizer_steps": opt.steps,
        "files": opt_where,
    }
    tmp = root / "optimizer.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, root / "optimizer.json")


def _tied_names(tr: _Trainer) -> set[str]:
    return {n for p in tr.params for n in p.names[1:]}


def load_checkpoint(path: str | os.PathLike[str], model: nn.Module, opt: TrainOptimizer) -> None:
    """Resumes from a directory save_checkpoint wrote: the working copies, masters, moments,
    steps and groups as they were, so the steps after it are those of a run that never stopped.
    A tensor missing or of another shape is an error naming it, before anything is changed."""
    from safetensors import safe_open

    tr = _trainer_of(model)
    opt._wait()
    root = Path(path)
    meta_path = root / "optimizer.json"
    if not meta_path.is_file():
        raise NotFoundError(f"{os.fspath(root)!r}: no optimizer.json (not a strata checkpoint)")
    meta = json.loads(meta_path.read_text())
    model_files = sorted(root.glob("model*.safetensors"))
    if not model_files:
        raise NotFoundError(f"{os.fspath(root)!r}: no model*.safetensors")
    # Check everything first: a checkpoint of another model changes nothing.
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in model_files:
        with safe_open(os.fspath(f), "pt") as sf:
            for key in sf.keys():  # noqa: SIM118 (safe_open has keys(), not iteration)
                found[key] = (f, tuple(sf.get_slice(key).get_shape()))
    for p in tr.params:
        hit = found.get(p.name)
        if hit is None:
            raise NotFoundError(f"checkpoint {os.fspath(root)!r}: no tensor {p.name!r}")
        if hit[1] != tuple(p.shape):
            raise InvalidArgumentError(
                f"checkpoint {os.fspath(root)!r}: tensor {p.name!r} is {list(hit[1])} in "
                f"{hit[0].name}, the model's is {list(p.shape)} (a checkpoint of another model?)"
            )
    names = meta["param_groups"][0]["param_names"]
    train = opt._train
    if names != [p.name for p in train]:
        first = next(
            (f"{a!r} against {b!r}" for a, b in zip(names, [p.name for p in train]) if a != b),
            f"{len(names)} trainable parameters against {len(train)}",
        )
        raise InvalidArgumentError(
            f"checkpoint {os.fspath(root)!r}: its optimizer's parameters differ: {first}"
        )
    rt = tr.runtime
    for p in tr.params:
        f, _ = found[p.name]
        with safe_open(os.fspath(f), "pt") as sf:
            _write_work(rt, p, sf.get_tensor(p.name))
    for i, p in enumerate(train):
        step = meta["steps"].get(str(i), 0)
        p.step = step
        p.has_grad = False
        p.micro_batches = 0
        if step == 0:
            rows = _read_work(rt, p).to(torch.float32)
            zeros = torch.zeros_like(rows)
            _write_rows(rt, p, rows, zeros, zeros)
            continue
        parts = {}
        for label in ("master", "exp_avg", "exp_avg_sq"):
            key = f"{i}.{label}"
            with safe_open(os.fspath(root / meta["files"][key]), "pt") as sf:
                parts[label] = sf.get_tensor(key)
        _write_rows(rt, p, parts["master"], parts["exp_avg"], parts["exp_avg_sq"])
        del parts
    for k, v in meta["param_groups"][0].items():
        if k not in ("params", "param_names"):
            opt.param_groups[0][k] = tuple(v) if k == "betas" else v
    opt.steps = meta["optimizer_steps"]


def _load_parameters(model: nn.Module, files: Any) -> None:
    """Fills a meta-device model's parameters from safetensors files, one tensor at a time."""
    from safetensors import safe_open

    from ._keys import checkpoint_keys

    keys: dict[str, Path] = {}
    for f in files:
        with safe_open(os.fspath(f), "pt") as sf:
            for key in sf.keys():  # noqa: SIM118
                keys[key] = Path(f)
    keymap = checkpoint_keys(model, list(keys))
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # a tied head is the embedding, read once
    for name, prm in list(model.named_parameters(remove_duplicate=True)):
        if keymap.conversion_of(name) is not None:
            raise UnsupportedError(
                f"parameter {name!r} is built from several checkpoint tensors (fused experts): "
                "train.offload takes a model built with from_pretrained for it"
            )
        key = keymap.key_of(name, keys)
        if key is None:
            raise NotFoundError(
                f"checkpoint: no tensor for parameter {name!r} ({keymap.tried(name)})"
            )
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        with safe_open(os.fspath(keys[key]), "pt") as sf:
            value = sf.get_tensor(key)
        owner._parameters[attr] = nn.Parameter(value.to(prm.dtype), prm.requires_grad)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
