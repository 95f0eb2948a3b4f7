"""ZeRO across ranks for strata.torch.optim (``partition=True``): each rank of a
torch.distributed process group keeps and updates only its shard of the optimizer states.

Note [Shards]
~~~~~~~~~~~~~
The parameters, in reverse order (the order backward produces their gradients, as DDP's
buckets), are cut into buckets of about ``bucket_size`` elements; a bucket is one flat buffer,
padded to a multiple of the world size N, and rank r owns elements [r S, (r + 1) S) of it
(S = padded size / N). So each rank's states are 1/N of the whole, plus at most N - 1 elements
of padding a bucket. A rank's shard of a bucket is cut at the parameters' boundaries into
segments (each with its parameter's group: lr, weight decay), and each segment into pieces of
at most ``sub_group_size`` elements: one strata tensor each (rows exp_avg, exp_avg_sq and the
fp32 master weights), homed on the host tier or NVMe of the rank's own runtime (its own
``nvme_dir``).

A step: as backward finishes a bucket's last gradient (post-accumulate-grad hooks, on the last
micro-batch of an accumulation), the bucket's gradients are flattened and reduce-scattered
with the average (``reduce_scatter_tensor``, asynchronous: it overlaps the rest of backward);
``step()`` launches what the hooks did not, waits, clips by the global norm when asked (the
squared norms of the shards summed with all_reduce), runs strata's CPU Adam on each piece of
the rank's shard, and all-gathers the updated fp32 shards into the parameters. Every rank
launches the same collectives in the same order (the buckets' order is the model's).

Note [A rank that fails]
~~~~~~~~~~~~~~~~~~~~~~~~
Before the parameters are gathered, the ranks agree on a failure (all_reduce of the lowest
failing rank): a rank whose update failed (an I/O error, no room) sends its message, and every
rank raises strata.DistributedError naming that rank and its error, instead of one rank raising
while the others wait in the next collective. A rank that dies or hangs is caught by the
process group's own timeout (``init_process_group(timeout=...)``), which every collective here
runs under: a collective that times out or loses a peer raises DistributedError on the ranks
that see it, naming the collective, the bucket and this rank, and the step's buckets are
dropped (the next step starts over) rather than left half-launched.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .._core import Access, Tier
from .._errors import Error, InvalidArgumentError
from ._runtimes import in_pages


class DistributedError(Error):
    """A rank of the process group failed its part of the optimizer step (named in the
    message); raised on every rank."""


@dataclass
class _Piece:
    states: Any  # strata Tensor (3, n): exp_avg, exp_avg_sq, master
    lo: int  # within the segment
    hi: int


@dataclass
class _Segment:
    param: torch.nn.Parameter
    group: dict
    index: int  # the parameter's index over all groups (torch's state_dict key)
    param_lo: int  # elements [param_lo, param_hi) of the flat parameter
    param_hi: int
    shard_off: int  # where they sit in this rank's shard of the bucket
    pieces: list[_Piece] = field(default_factory=list)


@dataclass
class _Bucket:
    params: list[tuple[int, torch.nn.Parameter]]  # (index, parameter), in bucket order
    offsets: list[int]  # each parameter's start in the flat bucket
    size: int  # padded to a multiple of the world size
    shard: int  # elements per rank
    segments: list[_Segment] = field(default_factory=list)
    ready: int = 0
    work: Any = None
    grad_shard: torch.Tensor | None = None


class Zero:
    """The partitioned side of a strata.torch.optim optimizer (Note [Shards])."""

    def __init__(self, opt: Any, group: Any, bucket_size: int) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidArgumentError(
                "partition=True needs torch.distributed: call "
                'torch.distributed.init_process_group("gloo" or "nccl") first (torchrun)'
            )
        self.opt = opt
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        indexed = []
        for g in opt.param_groups:
            for p in g["params"]:
                indexed.append((len(indexed), p, g))
        self.group_of = {id(p): g for _, p, g in indexed}
        self.index_of = {id(p): i for i, p, _ in indexed}
        self.steps: dict[int, int] = {}  # per parameter index, as torch counts
        self.buckets: list[_Bucket] = []
        current: list[tuple[int, torch.nn.Parameter]] = []
        count = 0
        for i, p, _ in reversed(indexed):
            if not p.requires_grad:
                continue
            current.append((i, p))
            count += p.numel()
            if count >= bucket_size:
                self._add_bucket(current)
                current, count = [], 0
        if current:
            self._add_bucket(current)
        self.bucket_of = {id(p): b for b in self.buckets for _, p in b.params}
        self.offloaded_elements = sum(b.shard for b in self.buckets)
        self._backwards: dict[int, int] = {}
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad)
            for b in self.buckets
            for _, p in b.params
        ]

    # ---- layout --------------------------------------------------------------------------

    def _add_bucket(self, params: list[tuple[int, torch.nn.Parameter]]) -> None:
        offsets, n = [], 0
        for _, p in params:
            offsets.append(n)
            n += p.numel()
        size = -(-n // self.world) * self.world
        b = _Bucket(params, offsets, size, size // self.world)
        lo, hi = self.rank * b.shard, (self.rank + 1) * b.shard
        k = len(self.buckets)
        for (index, p), off in zip(params, offsets):
            a, z = max(lo, off), min(hi, off + p.numel())
            if a >= z:
                continue
            seg = _Segment(p, self.group_of[id(p)], index, a - off, z - off, a - lo)
            flat = p.detach().reshape(-1)
            size_limit = self.opt.sub_group_size
            for j, s in enumerate(range(0, z - a, size_limit)):
                e = min(z - a, s + size_limit)
                init = torch.zeros((3, e - s), dtype=torch.float32)
                init[2] = flat[seg.param_lo + s : seg.param_lo + e].to("cpu", torch.float32)
                name = f"b{k}.p{index}.{j}"
                t = self.opt.runtime.create_tensor(
                    name, tuple(init.shape), "float32", self.opt._home, init
                )
                seg.pieces.append(_Piece(t, s, e))
            b.segments.append(seg)
        self.buckets.append(b)

    # ---- gradients -------------------------------------------------------------------------

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        n = self._backwards.get(id(p), 0) + 1
        self._backwards[id(p)] = n
        if n % self.opt.accumulation_steps:
            return
        b = self.bucket_of[id(p)]
        b.ready += 1
        if b.ready == len(b.params):
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        device = b.params[0][1].device
        flat = torch.zeros(b.size, dtype=torch.float32, device=device)
        for (_, p), off in zip(b.params, b.offsets):
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise InvalidArgumentError(
                        f"parameter {self.index_of[id(p)]}: a sparse gradient (Adam needs dense "
                        "ones)"
                    )
                flat[off : off + p.numel()].copy_(p.grad.detach().reshape(-1))
        b.grad_shard = torch.empty(b.shard, dtype=torch.float32, device=device)
        with self._collective(f"reduce-scatter of bucket {self.buckets.index(b)}"):
            b.work = dist.reduce_scatter_tensor(
                b.grad_shard, flat, op=dist.ReduceOp.AVG, group=self.group, async_op=True
            )

    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """A collective that fails here (a time-out of the process group, a peer that went
        away) raises DistributedError naming it (Note [A rank that fails])."""
        try:
            yield
        except RuntimeError as e:  # torch.distributed.DistError and its subclasses among them
            self._reset()
            raise DistributedError(
                f"rank {self.rank} of {self.world}: the {what} failed ({type(e).__name__}: "
                f"{e}); a rank that stopped or hung is the usual cause, and the process group's "
                "timeout (init_process_group(timeout=...)) bounds the wait"
            ) from e

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> None:
        for b in self.buckets:  # what the hooks did not launch, in the same order everywhere
            if b.work is None:
                self._launch(b)
        for k, b in enumerate(self.buckets):
            with self._collective(f"reduce-scatter of bucket {k}"):
                b.work.wait()
        grads = [b.grad_shard.to("cpu") for b in self.buckets]
        if self.opt.max_grad_norm is not None:
            sq = torch.tensor([sum(float(g.double().square().sum()) for g in grads)])
            sq = sq.to(self.buckets[0].grad_shard.device) if self.buckets else sq
            with self._collective("all-reduce of the gradient norm"):
                dist.all_reduce(sq, group=self.group)
            norm = math.sqrt(float(sq))
            self.opt.last_grad_norm = norm
            coef = self.opt.max_grad_norm / (norm + 1e-6)
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        failure: BaseException | None = None
        updated: list[torch.Tensor] = []
        try:
            touched = set()
            for b, g in zip(self.buckets, grads):
                updated.append(self._update(b, g, touched))
            for index in touched:
                self.steps[index] = self.steps.get(index, 0) + 1
        except BaseException as e:  # noqa: BLE001 (every rank raises, Note [A rank that fails])
            failure = e
        self._agree(failure)
        for k, (b, u) in enumerate(zip(self.buckets, updated)):
            full = torch.empty(b.size, dtype=torch.float32, device=u.device)
            with self._collective(f"all-gather of bucket {k}'s parameters"):
                dist.all_gather_into_tensor(full, u, group=self.group)
            for (_, p), off in zip(b.params, b.offsets):
                p.data.copy_(full[off : off + p.numel()].view(p.shape))
        self._reset()

    def _reset(self) -> None:
        """No bucket launched: the next step's hooks start over."""
        for b in self.buckets:
            b.ready, b.work, b.grad_shard = 0, None, None

    def _update(self, b: _Bucket, grad: torch.Tensor, touched: set) -> torch.Tensor:
        """Adam on this rank's shard of bucket b; returns the updated fp32 shard (device)."""
        out = torch.zeros(b.shard, dtype=torch.float32)
        for seg in b.segments:
            p, group = seg.param, seg.group
            if p.grad is None:  # no gradient anywhere: the parameter stays
                out[seg.shard_off : seg.shard_off + seg.param_hi - seg.param_lo] = (
                    p.detach().reshape(-1)[seg.param_lo : seg.param_hi].to("cpu", torch.float32)
                )
                continue
            touched.add(seg.index)
            step = self.steps.get(seg.index, 0) + 1
            for piece in seg.pieces:
                lo, hi = seg.shard_off + piece.lo, seg.shard_off + piece.hi
                with self.opt.pipeline.step(
                    piece.states.name, [(piece.states, Tier.HOST, Access.READ_WRITE)]
                ) as (lease,):
                    rows = torch.from_dlpack(lease)
                    self.opt._adam(rows, rows[2], grad[lo:hi], step, group)
                    out[lo:hi] = rows[2]
                    del rows
        return out.to(b.params[0][1].device)

    def _agree(self, failure: BaseException | None) -> None:
        """Note [A rank that fails]: every rank learns the lowest failing rank and raises."""
        device = self.buckets[0].params[0][1].device if self.buckets else torch.device("cpu")
        flag = torch.tensor([self.world if failure is None else self.rank], device=device)
        with self._collective("agreement on the step's failures (all-reduce)"):
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        failed = int(flag)
        if failed == self.world:
            return
        messages: list[Any] = [None] * self.world
        mine = None if failure is None else f"{type(failure).__name__}: {failure}"
        with self._collective("all-gather of the failures' messages"):
            dist.all_gather_object(messages, mine, group=self.group)
        self._reset()
        raise DistributedError(
            f"rank {failed} of {self.world} failed its optimizer step: {messages[failed]}; "
            "no rank gathered the updated parameters"
        ) from failure

    # ---- torch.optim.AdamW's checkpoint format -----------------------------------------------

    def _shard_rows(self, b: _Bucket) -> torch.Tensor:
        """This rank's (3, shard) states of bucket b: exp_avg, exp_avg_sq, master."""
        rows = torch.zeros((3, b.shard), dtype=torch.float32)
        for seg in b.segments:
            for piece in seg.pieces:
                with self.opt.runtime.acquire(piece.states, Tier.HOST, Access.READ) as lease:
                    lo, hi = seg.shard_off + piece.lo, seg.shard_off + piece.hi
                    rows[:, lo:hi] = torch.from_dlpack(lease)
        return rows

    def _all_steps(self) -> dict[int, int]:
        """Every parameter's step, from the ranks that own its elements (a collective). A rank
        counts the steps of the parameters it holds a segment of only (Note [Shards]), so one
        rank's own count lacks the parameters that lie wholly in the other ranks' shards."""
        device = self.buckets[0].params[0][1].device if self.buckets else torch.device("cpu")
        counts = torch.zeros(len(self.index_of), dtype=torch.int64)
        for index, n in self.steps.items():
            counts[index] = n + 1  # 0: no rank has a state for the parameter
        counts = counts.to(device)
        with self._collective("all-reduce of the steps for state_dict()"):
            dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.group)
        return {i: int(n) - 1 for i, n in enumerate(counts.tolist()) if n > 0}

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's format, gathered whole on every rank (a collective: call it on
        all of them; save it from rank 0)."""
        state: dict[int, dict[str, torch.Tensor]] = {}
        steps = self._all_steps()
        for b in self.buckets:
            device = b.params[0][1].device
            mine = self._shard_rows(b).to(device)
            full = torch.empty((self.world * 3, b.shard), dtype=torch.float32, device=device)
            with self._collective("all-gather of the states for state_dict()"):
                dist.all_gather_into_tensor(full, mine, group=self.group)  # ranks' rows, stacked
            whole = full.view(self.world, 3, b.shard).permute(1, 0, 2).reshape(3, b.size)
            whole = whole.to("cpu")
            for (index, p), off in zip(b.params, b.offsets):
                if index not in steps:
                    continue
                part = whole[:, off : off + p.numel()]
                state[index] = {
                    "step": torch.tensor(float(steps[index])),
                    "exp_avg": part[0].clone().view(p.shape),
                    "exp_avg_sq": part[1].clone().view(p.shape),
                }
                if p.dtype != torch.float32:
                    state[index]["master"] = part[2].clone().view(p.shape)
        state = {index: state[index] for index in sorted(state)}  # torch's order
        groups, index = [], 0
        for g in self.opt.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes this rank's shards from a whole torch.optim.AdamW state (saved with any number
        of ranks, or by torch itself); the master weights from "master", else the parameter.
        The caller (the optimizer's load_state_dict) has checked the groups and taken their
        hyperparameters."""
        self.steps.clear()
        for b in self.buckets:
            for seg in b.segments:
                st = state_dict["state"].get(seg.index)
                if st is None:
                    continue
                self.steps[seg.index] = int(float(st["step"]))
                p = seg.param
                values = [st["exp_avg"], st["exp_avg_sq"], st.get("master", p.detach())]
                rows = torch.stack(
                    [v.detach().to("cpu", torch.float32).reshape(-1) for v in values]
                )
                for piece in seg.pieces:
                    a, z = seg.param_lo + piece.lo, seg.param_lo + piece.hi
                    self.opt.runtime.write(piece.states, rows[:, a:z].contiguous())

    def state_bytes(self) -> int:
        """This rank's states in the host tier's pages (three fp32 rows a piece)."""
        return sum(
            in_pages(12 * (piece.hi - piece.lo))
            for b in self.buckets
            for seg in b.segments
            for piece in seg.pieces
        )

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
