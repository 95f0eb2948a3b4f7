"""Mixture-of-experts layers whose routed experts are leased one by one, the router deciding
what moves (Note [Leased experts]): finding a model's experts modules, the strata tensors of each
expert, the expert cache (Note [The expert cache]) and the pre-gating prefetch (Note [Pre-gating]).
offload() (strata.torch._offload) calls in here; nothing here leases a dense block.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._core import Access, Tier
from .._errors import InvalidArgumentError, NotFoundError, UnsupportedError
from .._runtime import Lease, Runtime, Tensor
from ._checkpoint import MappedTensor
from ._dtypes import torch_dtype
from ._keys import Conversion, KeyMap
from ._runtimes import consumer_done

# Note [Leased experts]
# ~~~~~~~~~~~~~~~~~~~~~~
# transformers keeps a layer's routed experts as one module whose parameters are 3-D, the first
# dimension the expert (its class decorated by transformers.integrations.moe's
# use_experts_implementation: gate_up_proj or up_proj, down_proj, their biases with has_bias).
# Leased whole with its layer, every token would read every expert. Here each expert's slice of
# each parameter is its own strata tensor, or a few of them (its parts):
#   - a checkpoint with one tensor per expert (Mixtral's experts.{i}.w1/w3/w2, Qwen's
#     experts.{i}.gate_proj/up_proj/down_proj), which transformers stacks (MergeModulelist) and
#     concatenates (Concatenate): the slice is those tensors of expert i, mapped in place in their
#     file, joined along the concatenated dimension when leased (Note [An expert in one piece]);
#   - a checkpoint holding the fused 3-D tensor: the slice is the byte range of expert i in the
#     file, mapped in place as a tensor of its own, named "<tensor>[i]" (slice_fused: made before
#     compression, so that compress= quantizes each expert's slice into the compressed cache as
#     a tensor of its own, read back from the file's slice alone);
#   - any other conversion: transformers' converter is run for expert i alone once, at load, and
#     the slice is a tensor of the runtime homed on the host tier (written to NVMe when the host
#     budget is full), as Note [Converted parameters] does for a whole parameter.
# The dense part of the layer (attention, norms, router, shared experts) stays its block. The
# experts module's forward is replaced by one that computes what transformers' eager experts
# implementation computes, in the same order with the same kernels (so the logits are the same
# bits), leasing only the experts that some token of the batch was routed to, one at a time, the
# next ones prefetched meanwhile. A module named like an experts module that does not follow
# the interface is refused before anything runs, named.

# Note [An expert in one piece]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# safetensors writes a file's tensors by dtype, then name, so expert i's per-expert
# tensors usually lie back to back (Qwen's experts.{i}.down_proj, gate_proj, up_proj: 3 MiB in
# one run). Those runs are mapped as one strata tensor each (same file, same dtype, full width,
# each tensor starting where the one before ends): one lease and one read instead of three, and
# a slice whose parts lie in order inside one run, joined along its first dimension, is a view
# of the run's bytes, not a torch.cat of its parts: a decode token would otherwise copy 2/3 of
# every expert it uses (29 ms of a 0.28 s cold token in bench/moe-vs-accelerate.py). The bytes,
# and so the results, are the same; parts that are not back to back (Mixtral's w1, w2, w3:
# gate and up have down between them) are joined as before.

# A module of one of these classes' layout is supported: (parameter attribute, required).
_GATED = ("gate_up_proj", "down_proj")
_UNGATED = ("up_proj", "down_proj")


def _is_experts_interface(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("has_gate", "has_bias", "is_transposed", "num_experts"))


def _looks_like_experts(name: str, m: nn.Module) -> bool:
    leaf = name.rpartition(".")[2]
    return leaf == "experts" or type(m).__name__.endswith("Experts")


def find_experts(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules of `root` in module order (Note [Leased experts]); a module that looks
    like one (named `experts`, or of a class named ...Experts) with parameters but without
    transformers' experts interface is an UnsupportedError naming it and its class."""
    out: list[tuple[str, nn.Module]] = []
    for name, m in root.named_modules():
        if any(name.startswith(n + ".") for n, _ in out):
            continue
        if _is_experts_interface(m):
            _check_layout(name, m)
            out.append((name, m))
        elif (
            _looks_like_experts(name, m)
            and isinstance(m, nn.ModuleList)
            and next(m.parameters(), None) is not None
        ):
            raise UnsupportedError(
                f"experts module {name!r} ({type(m).__name__}) is a list of expert modules, not "
                "transformers' experts interface (3-D gate_up_proj/down_proj, "
                "@use_experts_implementation): strata cannot lease its experts one by one; pass "
                "blocks=[...] to lease each layer whole"
            )
        elif (
            _looks_like_experts(name, m)
            and not isinstance(m, nn.ModuleList)
            and any(p.dim() == 3 for p in m.parameters(recurse=False))
        ):
            raise UnsupportedError(
                f"experts module {name!r} ({type(m).__name__}) has 3-D parameters "
                f"{[n for n, p in m.named_parameters(recurse=False)]} but not transformers' experts "
                "interface (@use_experts_implementation): its layout is unknown to strata"
            )
    return out


def _check_layout(name: str, m: nn.Module) -> None:
    wanted = _GATED if m.has_gate else _UNGATED
    if m.has_bias:
        wanted = wanted + tuple(f"{w}_bias" for w in wanted)
    params = dict(m.named_parameters(recurse=False))
    missing = [w for w in wanted if w not in params]
    extra = [n for n in params if n not in wanted]
    problems = []
    if missing or extra:
        problems.append(f"parameters {sorted(params)} (expected {list(wanted)})")
    if getattr(m, "has_post_expert_norm", False):
        problems.append("has_post_expert_norm")
    if any(p.shape[0] != m.num_experts for p in params.values()):
        problems.append(f"a parameter whose first dimension is not num_experts={m.num_experts}")
    with_params = [n for n, c in m.named_children() if next(c.parameters(), None) is not None]
    if with_params:
        problems.append(f"submodules with parameters {with_params}")
    if problems:
        raise UnsupportedError(
            f"experts module {name!r} ({type(m).__name__}): layout unknown to strata: "
            + "; ".join(problems)
        )


@dataclass
class _Part:
    """One part of a slice: `shape` elements at element `offset` of strata tensor `tensor`
    (offset 0 and the tensor's shape, unless the tensor is a run of several parts, Note [An
    expert in one piece])."""

    tensor: Tensor
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class _Slice:
    """Expert e's slice of one parameter: the parts that, joined along `dim`, make it."""

    parts: list[_Part]
    dim: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def one_view(self) -> bool:
        """Its parts lie in order, back to back, in one tensor, and join along the first
        dimension (or are one part): the slice is a view of that tensor's bytes."""
        first = self.parts[0]
        at = first.offset
        for p in self.parts:
            if p.tensor is not first.tensor or p.offset != at:
                return False
            at += p.numel
        return len(self.parts) == 1 or all(n == 1 for n in self.shape[: self.dim])


@dataclass
class Expert:
    """One routed expert of one layer: its slices (by parameter attribute), the strata tensors
    they lie in (each leased once) and their bytes."""

    layer: int
    index: int
    slices: dict[str, _Slice]
    tensors: list[Tensor] = field(init=False)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        seen: dict[int, Tensor] = {}
        for s in self.slices.values():
            for p in s.parts:
                seen.setdefault(p.tensor.id, p.tensor)
        self.tensors = list(seen.values())
        self.nbytes = sum(t.nbytes for t in self.tensors)


@dataclass
class _LayerStats:
    hits: int = 0
    host_hits: int = 0
    misses: int = 0
    bytes_moved: int = 0
    guessed: int = 0
    guessed_right: int = 0
    routed: int = 0  # experts used, summed over forwards
    routed_after_guess: int = 0  # of those, in forwards that had a guess
    # kept experts the runtime evicted for other tensors (Note [The expert cache])
    pushed_out: int = 0

    def as_dict(self) -> dict[str, Any]:
        d = dict(vars(self))
        found = self.hits + self.host_hits  # on a tier: not read from storage
        d["hit_rate"] = round(found / self.routed, 4) if self.routed else None
        d["guess_accuracy"] = (
            round(self.guessed_right / self.routed_after_guess, 4)
            if self.routed_after_guess
            else None
        )
        return d


@dataclass
class ExpertLayer:
    """An experts module under strata: its experts, its top_k, what was guessed for its next
    forward (Note [Pre-gating]) and its counters."""

    name: str
    module: nn.Module
    index: int
    experts: list[Expert]
    top_k: int
    guess: set[int] = field(default_factory=set)
    stats: _LayerStats = field(default_factory=_LayerStats)


def _fused_slices(
    qualname: str, mapped: MappedTensor, runtime: Runtime, owned: list[Tensor], n: int
) -> list[Tensor]:
    """Expert e's byte range of a fused 3-D tensor in its file, each mapped in place."""
    from ._compress import _read_header

    t = mapped.tensor
    if getattr(t, "compressed", False):
        raise UnsupportedError(f"{qualname!r}: a compressed fused experts tensor cannot be sliced")
    header, data_start = _read_header(mapped.path)
    entry = header.get(t.name)
    if entry is None:  # a tensor strata built, not one of the file's
        raise UnsupportedError(f"{qualname!r}: {t.name!r} is not a tensor of {str(mapped.path)!r}")
    begin = data_start + int(entry["data_offsets"][0])
    step = t.nbytes // n
    out = []
    for e in range(n):
        s = runtime.map_tensor(
            f"{t.name}[{e}]", t.shape[1:], t.dtype, mapped.path, begin + e * step
        )
        owned.append(s)
        out.append(s)
    return out


def slice_fused(
    modules: Sequence[tuple[str, nn.Module]],
    qualname_of: Callable[[nn.Parameter], str],
    tensors: Mapping[str, MappedTensor],
    keys: KeyMap,
    runtime: Runtime,
    owned: list[Tensor],
) -> dict[str, MappedTensor]:
    """Each expert's slice of the fused 3-D checkpoint tensors of the experts `modules` (those
    no conversion builds), mapped in place as "<tensor>[e]" (Note [Leased experts]); a tensor
    that cannot be sliced is left to build_experts, which names what is wrong."""
    out: dict[str, MappedTensor] = {}
    for _, module in modules:
        n = int(module.num_experts)
        for p in module.parameters(recurse=False):
            qualname = qualname_of(p)
            if keys.conversion_of(qualname) is not None:
                continue
            key = keys.key_of(qualname, tensors)
            if key is None or tuple(tensors[key].tensor.shape) != tuple(p.shape):
                continue
            names = [f"{key}[{e}]" for e in range(n)]
            if any(name in tensors for name in names):  # a checkpoint's own key: never shadowed
                continue
            mapped, made = tensors[key], []
            try:
                _fused_slices(qualname, mapped, runtime, made, n)  # into `made` as it maps
            except (UnsupportedError, OSError, ValueError):
                for t in made:  # the slices mapped before the failure
                    runtime.destroy(t)
                continue
            owned.extend(made)
            out.update({name: MappedTensor(t, mapped.path) for name, t in zip(names, made)})
    return out


def _per_expert_parts(conversion: Conversion, n: int) -> tuple[list[list[str]], int] | None:
    """When `conversion` stacks one tensor per expert (and joins a few such along a dimension):
    for each expert its source keys in join order, and the slice's join dimension; else None."""
    ops = [type(op).__name__ for op in getattr(conversion.converter, "operations", [])]
    if not ops or ops[0] != "MergeModulelist" or conversion.converter.operations[0].dim != 0:
        return None
    if ops == ["MergeModulelist"] and len(conversion.sources) == 1:
        dim = 0
    elif ops == ["MergeModulelist", "Concatenate"] and conversion.converter.operations[1].dim >= 1:
        dim = conversion.converter.operations[1].dim - 1
    else:
        return None
    if len(conversion.targets) != 1:
        return None
    per_expert: list[list[str]] = [[] for _ in range(n)]
    for keys in conversion.sources.values():
        if len(keys) != n:
            return None
        for e, k in enumerate(keys):
            per_expert[e].append(k)
    return per_expert, dim


def _missing_expert(conversion: Conversion, n: int) -> str | None:
    """The checkpoint key of an expert that the conversion's sources lack (named from another
    expert's key), or None when every source pattern has its n tensors."""
    import re

    for pattern, keys in conversion.sources.items():
        if len(keys) == n:
            continue
        rx = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))
        found: dict[int, str] = {}
        for k in keys:
            m = rx.search(k)
            if m is not None:
                found[int(m.group(1))] = k
        absent = [e for e in range(n) if e not in found]
        if found and absent:
            sample = next(iter(found.values()))
            m = rx.search(sample)
            assert m is not None
            return sample[: m.start(1)] + str(absent[0]) + sample[m.end(1) :]
        return f"{n - len(keys)} of the {n} tensors matching {pattern!r}"
    return None


def build_experts(
    name: str,
    module: nn.Module,
    index: int,
    qualname_of: Callable[[nn.Parameter], str],
    tensors: Mapping[str, MappedTensor],
    keys: KeyMap,
    runtime: Runtime,
    owned: list[Tensor],
    dtype: torch.dtype | None,
    runs: Runs | None = None,
) -> ExpertLayer:
    """The ExpertLayer of the experts module `name` (Note [Leased experts]): each expert's
    slices found in (or built from) the checkpoint `tensors`, back-to-back parts joined by
    `runs` (Note [An expert in one piece]; None: never joined). A missing expert tensor is a
    NotFoundError naming its key; a slice of the wrong shape an InvalidArgumentError."""
    n = int(module.num_experts)
    slices: list[dict[str, _Slice]] = [{} for _ in range(n)]
    for attr, p in module.named_parameters(recurse=False):
        qualname = qualname_of(p)
        shape = tuple(p.shape[1:])
        conversion = keys.conversion_of(qualname)
        if conversion is not None:
            missing = _missing_expert(conversion, n)
            if missing is not None:
                raise NotFoundError(
                    f"experts {qualname!r}: the checkpoint has no tensor {missing!r} "
                    f"(transformers' {conversion.describe()})"
                )
            plan = _per_expert_parts(conversion, n)
            if plan is None:
                parts = _built_slices(qualname, conversion, n, tensors, runtime, owned, module)
                for e in range(n):
                    slices[e][attr] = _Slice([_whole(parts[e])], 0, shape, p.dtype)
            else:
                per_expert, dim = plan
                for e, ks in enumerate(per_expert):
                    for k in ks:
                        if k not in tensors:
                            raise NotFoundError(
                                f"experts {qualname!r}: the checkpoint has no tensor {k!r}"
                            )
                    parts = [_whole(tensors[k].tensor) for k in ks]
                    slices[e][attr] = _Slice(parts, dim, shape, p.dtype)
        else:
            key = keys.key_of(qualname, tensors)
            if key is None:
                raise NotFoundError(
                    f"experts {qualname!r} {tuple(p.shape)}: in none of the checkpoint's files "
                    f"({keys.tried(qualname)})"
                )
            mapped = tensors[key]
            if tuple(mapped.tensor.shape) != tuple(p.shape):
                raise InvalidArgumentError(
                    f"tensor {key!r} in {str(mapped.path)!r} has shape "
                    f"{tuple(mapped.tensor.shape)}, experts parameter {qualname!r} {tuple(p.shape)}"
                )
            if all(f"{key}[{e}]" in tensors for e in range(n)):  # slice_fused's
                parts = [tensors[f"{key}[{e}]"].tensor for e in range(n)]
            else:
                parts = _fused_slices(qualname, mapped, runtime, owned, n)
            for e, part in enumerate(parts):
                slices[e][attr] = _Slice([_whole(part)], 0, shape, p.dtype)
    for e in range(n):
        for attr, s in slices[e].items():
            got = list(s.parts[0].shape)
            got[s.dim] = sum(t.shape[s.dim] for t in s.parts)
            # every part, not only the first, has the slice's other dimensions (a view of a
            # run would otherwise reinterpret bytes a join along `dim` would have refused)
            others = {tuple(d for i, d in enumerate(t.shape) if i != s.dim) for t in s.parts}
            if tuple(got) != s.shape or len(others) != 1:
                raise InvalidArgumentError(
                    f"expert {e} of {name!r}: {attr} from {[t.tensor.name for t in s.parts]} "
                    f"has shape {tuple(got)}, the module's slice {s.shape}"
                )
            file_dtype = torch_dtype(s.parts[0].tensor.dtype)
            s.dtype = dtype if (dtype is not None and file_dtype.is_floating_point) else file_dtype
    if runs is not None:
        for e in range(n):
            runs.join(slices[e])
    experts = [Expert(index, e, slices[e]) for e in range(n)]
    top_k = _top_k(module)
    return ExpertLayer(name, module, index, experts, top_k)


def _whole(t: Tensor) -> _Part:
    return _Part(t, 0, tuple(t.shape))


class Runs:
    """Maps the back-to-back runs of an expert's checkpoint tensors as one tensor each (Note
    [An expert in one piece]). Made once for a model from the tensors map_checkpoint mapped
    in place (not converted or compressed ones: their bytes are not the file's), each file's
    header read once."""

    def __init__(
        self,
        tensors: Mapping[str, MappedTensor],
        runtime: Runtime,
        owned: list[Tensor],
        compressed: set[int],
    ) -> None:
        from ._compress import _read_header

        self._runtime = runtime
        self._owned = owned
        self._where: dict[int, tuple[MappedTensor, int]] = {}  # tensor id -> (mapped, begin)
        headers: dict[Any, tuple[dict[str, Any], int]] = {}
        for m in tensors.values():
            t = m.tensor
            if t.id in compressed or getattr(t, "compressed", False):
                continue
            if m.path not in headers:
                try:
                    headers[m.path] = _read_header(m.path)
                except (OSError, ValueError, TypeError):  # not a file's: never joined
                    headers[m.path] = ({}, 0)
            header, data_start = headers[m.path]
            entry = header.get(t.name)
            if entry is None or int(entry["data_offsets"][1]) - int(
                entry["data_offsets"][0]
            ) != int(t.nbytes):
                continue
            self._where[t.id] = (m, data_start + int(entry["data_offsets"][0]))

    def join(self, slices: dict[str, _Slice]) -> None:
        """Replaces the parts of `slices` that lie back to back in one file with parts of one
        tensor mapped over each run."""
        parts = [p for s in slices.values() for p in s.parts]
        placed = sorted(
            (
                (str(self._where[p.tensor.id][0].path), self._where[p.tensor.id][1], i)
                for i, p in enumerate(parts)
                if p.offset == 0 and p.tensor.id in self._where
            ),
        )
        runs: list[list[int]] = []
        end = None
        for path, begin, i in placed:
            t = parts[i].tensor
            prev = parts[runs[-1][-1]].tensor if runs else None
            if (
                prev is not None
                and end == (path, begin)
                and t.dtype == prev.dtype
                and t.id != prev.id
            ):
                runs[-1].append(i)
            else:
                runs.append([i])
            end = (path, begin + int(t.nbytes))
        into: dict[int, _Part] = {}
        for run in runs:
            if len(run) < 2:
                continue
            first = parts[run[0]].tensor
            mapped, begin = self._where[first.id]
            numel = sum(parts[i].numel for i in run)
            name = f"{first.name}..{parts[run[-1]].tensor.name}"
            whole = self._runtime.map_tensor(name, (numel,), first.dtype, mapped.path, begin)
            self._owned.append(whole)
            at = 0
            for i in run:
                into[i] = _Part(whole, at, parts[i].shape)
                at += parts[i].numel
        i = 0
        for s in slices.values():
            for j in range(len(s.parts)):
                s.parts[j] = into.get(i, s.parts[j])
                i += 1


def _built_slices(
    qualname: str,
    conversion: Conversion,
    n: int,
    tensors: Mapping[str, MappedTensor],
    runtime: Runtime,
    owned: list[Tensor],
    model: nn.Module,
) -> list[Tensor]:
    """Expert e's slice built once by transformers' converter run on expert e's tensors alone,
    homed on the host tier (Note [Leased experts], third case)."""
    from copy import copy

    def read(key: str) -> torch.Tensor:
        m = tensors[key]
        with runtime.acquire(m.tensor, Tier.HOST, Access.READ) as lease:
            return torch.from_dlpack(lease).clone().view(m.tensor.shape)

    out = []
    for e in range(n):
        one = copy(conversion)
        one.sources = {p: [keys[e]] for p, keys in conversion.sources.items()}
        built = one.build(read, model)[qualname].detach()
        if built.dim() >= 1 and built.shape[0] == 1:
            built = built[0]
        value = built.contiguous()
        t = runtime.create_tensor(
            f"{qualname}[{e}]", tuple(value.shape), value.dtype, Tier.HOST, value
        )
        owned.append(t)
        out.append(t)
    return out


def _top_k(module: nn.Module) -> int:
    config = getattr(module, "config", None)
    for attr in ("num_experts_per_tok", "top_k", "moe_topk"):
        v = getattr(config, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    return 1


def find_router(parent: nn.Module, n: int, hidden: int) -> nn.Module | None:
    """The router of a sparse block: its child holding an (n, hidden) weight (`gate`, `router`)."""
    for child_name in ("gate", "router"):
        child = getattr(parent, child_name, None)
        w = getattr(child, "weight", None)
        if isinstance(w, torch.Tensor) and tuple(w.shape) == (n, hidden):
            return child
    return None


# Note [The expert cache]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Between forwards the experts used stay on the device tier (and the host tier) as unleased
# copies, within a share of each budget: the device budget less twice the largest dense block
# (the block leased and the one prefetched); the host budget less the same. The pipeline's
# windows leave those shares to the cache (PrefetchPipeline device_reserve, host_reserve), and
# it prefetches the dense blocks one step ahead (prefetch="auto" becomes "fixed" with a
# lookahead of 1, or on demand when two blocks and an expert do not fit the device budget
# together). "auto" within the reserves looks further ahead where the layers' blocks are
# smaller than the largest (the embedding, the head): measured on bench/moe-vs-accelerate.py's
# model, 6 blocks ahead, a cold token then read 506 MB instead of 415 and took 0.34 s instead
# of 0.25, the blocks' host copies on their way to the device pushing guessed experts out of
# the host tier before their layer ran (those copies are not in the host window's account).
# When the experts kept on a tier exceed their share, those of the lowest hit density are
# evicted from it (the quantity LHD, Beckmann et al., NSDI'18, ranks a cache's objects by): the
# likelihood that the expert's layer routes to it when that layer next runs, over how many
# experts layers run before then. The likelihood is the routing frequency with aging: each
# forward multiplies every count, and each layer's count of forwards, by DECAY, and adds one to
# each expert used and each layer run; the ratio of the two. Ties go to the least recently
# used. An expert used once long ago thus yields to one used often lately, one used every few
# tokens stays where pure LRU would let a burst of one-off experts push it out, and the
# distance keeps the layers about to run: a token runs the layers in a cycle, and when the
# experts it uses exceed the share, recency (or a count this forward's own uses dominate)
# evicts each layer's experts just before that layer runs again, so nothing is ever found
# (bench/moe-vs-accelerate.py: 0 of 64 experts a warm token, against 23 to 27 by density with
# a share of 27). The runtime's own eviction must not undo this: it drops a clean copy that a
# faster tier also holds (a dense block's host copy once the block is on the device tier)
# before any copy that is the only one above storage (Note [Duplicates go first],
# runtime/src/residency/eviction_policies.cpp). An expert kept on the device tier leaves the
# host share's account for that reason: its host copy is such a duplicate.
# `pushed_out` counts the kept experts found evicted by the runtime for other tensors (behind
# the cache's back: the cache keeps within its share, so it is 0 when the tiers' accounts hold).
# Which tier held a needed expert is counted per layer: `hits` (the device tier), `host_hits`
# (the host tier), `misses` (neither: read from its file or NVMe), `hit_rate` the share of
# the first two; `bytes_moved` counts the bytes brought to where the experts run (the device
# tier; the host tier on the host backend), by demand or by a guess.
#
# Note [Pre-gating]
# ~~~~~~~~~~~~~~~~~~
# The recorded schedule cannot say which experts the next layer will use. As a layer's experts
# start, the next experts layer's router weight (leased for the moment from the next layer's
# block, which the pipeline is bringing meanwhile) is applied to this layer's hidden states:
# the top_k experts of each token under it are that layer's guess, brought to where they run
# behind this layer's own experts as expert_prefetch allows (below; with the most frequent
# experts of that layer when there is no router found). The residual stream changes little
# from one layer to the next, so the guess is mostly right; `guessed_right` / `routed` is how
# often. A wrong guess costs bandwidth, never a result: the experts used are leased by what the
# router chose.
#
# Which guesses move (expert_prefetch): "auto" (the default) prefetches, most likely first, the
# guessed experts that are on the host tier (a move over the link, none on the host backend,
# where they run from there) and never reads one from storage for a guess; "all" prefetches
# every guess, from NVMe too; "off" none (the guesses are still made and counted). A decode
# token that reads its experts from NVMe is bound by the disk (on the 2-core VM it had 16 reads
# in flight for all but 25 ms of a 0.28 s cold token), so a guess read from NVMe hides little
# latency and a wrong one (a third of them) costs its bytes outright.
# bench/moe-vs-accelerate.py's strata child, two alternating rounds, 2026-12-07: "all" 0.24 to
# 0.31 s a cold token reading 418 MB and 0.18 s a warm one reading 274 MB; guesses from NVMe
# off, 0.24 s reading 355 MB (the least a token needs), 0.145 s and 205 MB warm.
#
# Note [Where an expert runs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An expert found on the host tier but not on the device tier need not move: on the host
# backend it is computed from its host copy (the same kernel, so the same bits), with no copy
# into the device arena. On CUDA (expert_compute="auto") it runs on the CPU from its host copy
# when the batch is small enough that the CPU's time for it is below the copy's time over the
# link, both measured as the model runs (CPU seconds per token-byte from the experts computed
# there, the link's bytes per second from the experts copied); "device" always copies, "host"
# always computes a host-resident expert on the host. A compressed expert's host copy is
# quantized, so it always runs on the device.

DECAY = 0.9


class ExpertCache:
    """The experts of every experts module of one Offloaded model: their leases, the cache
    policy (Note [The expert cache]), the pre-gating prefetch (Note [Pre-gating]) and where each
    runs (Note [Where an expert runs])."""

    def __init__(
        self,
        runtime: Runtime,
        layers: list[ExpertLayer],
        device: torch.device,
        device_share: int,
        host_share: int,
        compute: str,
        compressed: set[int] = frozenset(),  # type: ignore[assignment]
        prefetch: str = "auto",
    ) -> None:
        if compute not in ("auto", "device", "host"):
            raise InvalidArgumentError(
                f"expert_compute={compute!r}: expected 'auto', 'device' or 'host'"
            )
        if prefetch not in ("auto", "all", "off"):
            raise InvalidArgumentError(
                f"expert_prefetch={prefetch!r}: expected 'auto', 'all' or 'off'"
            )
        self.prefetch = prefetch  # which guesses move (Note [Pre-gating])
        self.runtime = runtime
        self.layers = layers
        self.device = device
        self.share = {Tier.DEVICE: max(device_share, 0), Tier.HOST: max(host_share, 0)}
        self.compute = compute
        # Note [Where an expert runs]: on the host backend experts are brought to the host tier
        # and run there (reads land in the pinned slab without the device arena's staging copy).
        self._fetch = Tier.HOST if device.type == "cpu" and compute != "device" else Tier.DEVICE
        self._compressed = compressed  # ids of tensors stored compressed (device-only leases)
        self._score: dict[tuple[int, int], float] = {}
        self._last: dict[tuple[int, int], int] = {}
        self._kept: dict[Tier, dict[tuple[int, int], int]] = {Tier.DEVICE: {}, Tier.HOST: {}}
        self._clock = 0
        self._current = -1  # the experts layer running; -1 before a forward's first
        self._runs: dict[int, float] = {}  # each layer's forwards, aged as the counts are
        self._protected: set[tuple[int, int]] = set()
        self._routers: dict[int, tuple[Tensor, tuple[int, ...]]] = {}
        # Note [Where an expert runs]: measured CPU seconds per (token x byte), link bytes/s.
        self._cpu_rate: float | None = None
        self._link_rate: float | None = None
        self._hooks: list[Any] = []

    # -- setup --

    def set_routers(self, routers: Mapping[int, tuple[Tensor, tuple[int, ...]]]) -> None:
        """Each layer's router weight (a tensor of its dense block) and shape, for pre-gating."""
        self._routers = dict(routers)

    def install(self) -> None:
        for layer in self.layers:
            layer.module.forward = types.MethodType(_make_forward(self, layer), layer.module)

    def begin_forward(self) -> None:
        """A forward of the model starts: counts age (Note [The expert cache])."""
        self._clock += 1
        self._current = -1
        self._protected = set()
        for k in self._score:
            self._score[k] *= DECAY
        for i in self._runs:
            self._runs[i] *= DECAY
        if self.layers and self._score:  # the first layer has no layer before it to pre-gate
            self._guess_by_frequency(self.layers[0])

    def _guess_by_frequency(self, layer: ExpertLayer, room: int | None = None) -> None:
        ranked = sorted(
            range(len(layer.experts)), key=lambda e: -self._score.get((layer.index, e), 0.0)
        )
        self._prefetch_guess(layer, ranked[: min(layer.top_k, len(layer.experts))], room)

    def _prefetch_guess(self, layer: ExpertLayer, chosen: list[int], room: int | None) -> None:
        """Prefetches the guessed experts of `layer` (most likely first) to where they run
        within `room` bytes (the share by default), protected from eviction until that layer
        runs; under expert_prefetch="auto" only those whose move reads no storage (Note
        [Pre-gating])."""
        layer.guess = set(chosen)
        if self.prefetch == "off":
            return
        budget = self.share[self._fetch] if room is None else room
        for e in chosen:
            expert = layer.experts[e]
            on_device = self._resident(expert, Tier.DEVICE)
            on = (on_device, not on_device and self._resident(expert, Tier.HOST))  # as run()'s
            if self.prefetch == "auto" and not (on[0] or on[1]):
                continue  # only on NVMe: its layer's router reads it, if it is chosen
            if expert.nbytes > budget:
                break
            budget -= expert.nbytes
            self._protected.add((layer.index, e))
            self._bring(expert, layer.stats, on)

    def close(self) -> None:
        for layer in self.layers:
            layer.module.__dict__.pop("forward", None)
        self._routers.clear()

    # -- the policy --

    def _resident(self, expert: Expert, tier: Tier) -> bool:
        return all(self.runtime.resident(t, tier) for t in expert.tensors)

    def _keep(self, expert: Expert, tier: Tier) -> None:
        key = (expert.layer, expert.index)
        if tier is Tier.DEVICE:
            # Its host copy, if any, is now a duplicate the runtime drops first (Note
            # [Duplicates go first]): not the host share's to keep.
            self._kept[Tier.HOST].pop(key, None)
        kept = self._kept[tier]
        kept[key] = expert.nbytes
        total = sum(kept.values())
        if total <= self.share[tier]:
            return
        # Over the share by the account: first forget those the runtime evicted to make room
        # (asked only now, not on every use).
        total = self._prune(tier, key)
        if total <= self.share[tier]:
            return
        # Never the experts this layer is about to use nor those guessed for the next one: they
        # were just brought, and their score (0 for a first guess) would make them go first.
        protected = self._protected
        victims = sorted(
            (k for k in kept if k != key and k not in protected),
            key=lambda k: (self._density(k), self._last.get(k, 0)),
        )
        for k in victims:
            if total <= self.share[tier]:
                break
            victim = self.layers[k[0]].experts[k[1]]
            for t in victim.tensors:
                self.runtime.evict(t, tier)
            total -= kept.pop(k)

    def _density(self, key: tuple[int, int]) -> float:
        """An expert's hit density (Note [The expert cache]): the likelihood that its layer
        routes to it when it next runs (its aged count over the layer's aged forwards) over how
        many experts layers run until then (1 for the next one, len(layers) for this one)."""
        runs = self._runs.get(key[0], 0.0)
        likelihood = self._score.get(key, 0.0) / runs if runs else 0.0
        return likelihood / ((key[0] - self._current - 1) % len(self.layers) + 1)

    def _prune(self, tier: Tier, keep: tuple[int, int] | None = None) -> int:
        """Forgets the kept experts the runtime has evicted from `tier` (but `keep`); returns
        the bytes still kept there."""
        kept = self._kept[tier]
        for k in [k for k in kept if k != keep]:
            if not self._resident(self.layers[k[0]].experts[k[1]], tier):
                del kept[k]
                self.layers[k[0]].stats.pushed_out += 1
        return sum(kept.values())

    def dropped(self) -> None:
        """Every copy of the experts on the device and host tiers was dropped (drop_caches):
        the cache keeps none."""
        for kept in self._kept.values():
            kept.clear()

    def _used(self, expert: Expert) -> None:
        key = (expert.layer, expert.index)
        self._score[key] = self._score.get(key, 0.0) + 1.0
        self._last[key] = self._clock

    def _fetch_tier(self, expert: Expert) -> Tier:
        """Where an expert that is on neither tier is brought: the host tier on the host backend
        (it runs there, Note [Where an expert runs]), else the device tier."""
        if self._fetch is Tier.HOST and not any(t.id in self._compressed for t in expert.tensors):
            return Tier.HOST
        return Tier.DEVICE

    def _bring(
        self, expert: Expert, stats: _LayerStats, on: tuple[bool, bool] | None = None
    ) -> None:
        """Starts moving `expert` to where it runs unless it is there (or on the device); `on`:
        whether it is on the device and on the host tier, when the caller just asked."""
        on_device = on[0] if on is not None else self._resident(expert, Tier.DEVICE)
        if on_device:
            return
        tier = self._fetch_tier(expert)
        # Asked again: bringing the experts before it may have evicted it since `on` was taken.
        if tier is Tier.HOST and (on is None or on[1]) and self._resident(expert, Tier.HOST):
            return
        for t in expert.tensors:
            self.runtime.prefetch(t, tier)
        stats.bytes_moved += expert.nbytes
        self._keep(expert, tier)

    def _where(self, expert: Expert, tokens: int, on_device: bool, on_host: bool) -> Tier:
        """The tier `expert` is leased on for this batch (Note [Where an expert runs]), given
        whether it is on the device and on the host tier now."""
        if on_device or self.compute == "device":
            return Tier.DEVICE
        if any(t.id in self._compressed for t in expert.tensors):
            return Tier.DEVICE
        if self.device.type == "cpu":
            return Tier.HOST
        if not on_host:
            return Tier.DEVICE
        if self.compute == "host":
            return Tier.HOST
        if self._cpu_rate is None or self._link_rate is None:
            return Tier.HOST if self._cpu_rate is None else Tier.DEVICE
        cpu_s = self._cpu_rate * tokens * expert.nbytes
        link_s = expert.nbytes / self._link_rate
        return Tier.HOST if cpu_s < link_s else Tier.DEVICE

    def _guess(self, layer: ExpertLayer, hidden: torch.Tensor, room: int) -> None:
        """Guesses and prefetches the next experts layer's experts (Note [Pre-gating])."""
        if layer.index + 1 >= len(self.layers):
            return
        nxt = self.layers[layer.index + 1]
        router = self._routers.get(nxt.index)
        k = min(nxt.top_k, len(nxt.experts))
        if router is None:
            self._guess_by_frequency(nxt, room)
            return
        # The router is in the next layer's block, which the pipeline is bringing meanwhile.
        tensor, shape = router
        with self.runtime.acquire(tensor, Tier.DEVICE, Access.READ) as lease, torch.no_grad():
            weight = torch.from_dlpack(lease).view(shape)
            logits = nn.functional.linear(hidden.to(weight.dtype), weight)
            top = torch.topk(logits.float().softmax(-1), k, dim=-1)
            # Each expert picked for some token, the most likely (summed over tokens) first.
            score = torch.zeros(logits.shape[-1], dtype=top.values.dtype, device=logits.device)
            score.index_add_(0, top.indices.flatten(), top.values.flatten())
            picked = top.indices.flatten().unique()  # the set topk picked (a 0 score included)
            order = torch.argsort(score[picked], descending=True, stable=True)
            chosen = picked[order].tolist()  # host-synced
        self._prefetch_guess(nxt, chosen, room)

    # -- a forward --

    def _enter(self, layer: ExpertLayer, used: Sequence[int]) -> None:
        """`layer` runs, using experts `used`: they are not evicted while it runs."""
        self._current = layer.index
        self._runs[layer.index] = self._runs.get(layer.index, 0.0) + 1.0
        self._protected = {(layer.index, e) for e in used}

    def run(
        self,
        layer: ExpertLayer,
        module: nn.Module,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """What transformers' eager experts forward computes, each expert leased in turn."""
        import time

        n = len(layer.experts)
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=n + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        used = [int(e) for e in hit[:, 0].tolist() if int(e) != n]
        stats = layer.stats
        stats.routed += len(used)
        if layer.guess:
            stats.guessed += len(layer.guess)
            stats.guessed_right += len(layer.guess.intersection(used))
            stats.routed_after_guess += len(used)
        layer.guess = set()
        self._enter(layer, used)
        tokens = hidden_states.shape[0]
        where: dict[int, Tier] = {}
        on: dict[int, tuple[bool, bool]] = {}  # each expert's residency, asked once
        absent: set[int] = set()  # not on the device tier when routed: they move
        for e in used:
            expert = layer.experts[e]
            on_device = self._resident(expert, Tier.DEVICE)
            on_host = not on_device and self._resident(expert, Tier.HOST)
            on[e] = (on_device, on_host)
            if on_device:
                stats.hits += 1
            elif on_host:
                stats.host_hits += 1
                absent.add(e)
            else:
                stats.misses += 1
                absent.add(e)
            where[e] = self._where(expert, tokens, on_device, on_host)
        # This layer's experts first, then the next layer's guess, behind them.
        room = self.share[self._fetch]
        for e in used:
            expert = layer.experts[e]
            if e in absent and expert.nbytes <= room:
                room -= expert.nbytes
                self._bring(expert, stats, on[e])
        self._guess(layer, hidden_states, room)
        for e in used:
            expert = layer.experts[e]
            self._used(expert)
            tier = where[e]
            moved = tier is Tier.DEVICE and e in absent
            start = time.perf_counter()
            leases = [self.runtime.acquire(t, tier, Access.READ) for t in expert.tensors]
            try:
                got = time.perf_counter()
                weights = _weights(expert, leases, self.device if tier is Tier.DEVICE else None)
                top_k_pos, token_idx = torch.where(mask[e])
                x = hidden_states[token_idx]
                if tier is Tier.HOST and self.device.type != "cpu":
                    x = x.to("cpu")
                out = _expert_forward(module, weights, x)
                out = out.to(final.device)
                out = out * top_k_weights[token_idx, top_k_pos, None]
                final.index_add_(0, token_idx, out.to(final.dtype))
                done = time.perf_counter()
            finally:
                if tier is Tier.DEVICE:
                    consumer_done(self.device)  # Note [Consumers' kernels]
                for lease in leases:
                    lease.release()
            if tier is Tier.DEVICE:
                self._keep(expert, Tier.DEVICE)
                if moved and got > start:
                    self._link_rate = expert.nbytes / (got - start)
            else:
                self._keep(expert, Tier.HOST)
                if self.device.type != "cpu" and token_idx.numel():
                    self._cpu_rate = (done - got) / (token_idx.numel() * expert.nbytes)
        return final

    def stats(self) -> dict[str, Any]:
        kept = {"device": self._prune(Tier.DEVICE), "host": self._prune(Tier.HOST)}  # counts first
        total = _LayerStats()
        for layer in self.layers:
            for k, v in vars(layer.stats).items():
                setattr(total, k, getattr(total, k) + v)
        out = total.as_dict()
        out["kept_bytes"] = kept
        out["share_bytes"] = {"device": self.share[Tier.DEVICE], "host": self.share[Tier.HOST]}
        out["layers"] = {layer.name: layer.stats.as_dict() for layer in self.layers}
        return out


def _weights(
    expert: Expert, leases: Sequence[Lease], device: torch.device | None
) -> dict[str, torch.Tensor]:
    """Each slice of `expert` as one tensor of its shape (its parts joined, when several)."""
    out: dict[str, torch.Tensor] = {}
    leased = {t.id: torch.from_dlpack(lease) for t, lease in zip(expert.tensors, leases)}
    for attr, s in expert.slices.items():
        if s.one_view():  # Note [An expert in one piece]
            p = s.parts[0]
            w = leased[p.tensor.id].view(-1)[p.offset : p.offset + math.prod(s.shape)].view(s.shape)
        else:
            views = [
                leased[p.tensor.id].view(-1)[p.offset : p.offset + p.numel].view(p.shape)
                for p in s.parts
            ]
            w = views[0] if len(views) == 1 else torch.cat(views, dim=s.dim)
        if w.dtype != s.dtype:
            w = w.to(s.dtype)
        out[attr] = w
    return out


def _linear(module: nn.Module, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    if module.is_transposed:
        y = x @ w
        return y + b if b is not None else y
    return nn.functional.linear(x, w, b)


def _expert_forward(module: nn.Module, w: Mapping[str, torch.Tensor], x: torch.Tensor):
    """One expert on its tokens, as transformers' eager experts forward computes it."""
    bias = module.has_bias
    if module.has_gate:
        h = _linear(module, x, w["gate_up_proj"], w.get("gate_up_proj_bias") if bias else None)
        h = module._apply_gate(h)
    else:
        h = _linear(module, x, w["up_proj"], w.get("up_proj_bias") if bias else None)
        h = module.act_fn(h)
    return _linear(module, h, w["down_proj"], w.get("down_proj_bias") if bias else None)


def _make_forward(cache: ExpertCache, layer: ExpertLayer) -> Callable[..., torch.Tensor]:
    def forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        return cache.run(layer, self, hidden_states, top_k_index, top_k_weights)

    return forward
