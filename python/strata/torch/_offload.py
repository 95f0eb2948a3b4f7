"""Running a torch.nn.Module whose parameters live in a strata Runtime (Note [Blocks]).

offload() leaves each parameter as a placeholder that holds no bytes and hooks the module's
blocks: a block's forward leases its tensors on the device tier through the prefetch pipeline,
puts them in as the parameters, and gives them back when the forward ends. The pipeline
records the first forward of the model and prefetches the next blocks within the budgets
while the current one computes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._core import Access, Tier
from .._errors import InvalidArgumentError, NotFoundError, OutOfMemoryError, UnsupportedError
from .._pipeline import PrefetchPipeline
from .._runtime import Lease, Runtime, Tensor
from ._checkpoint import Checkpoint, MappedTensor, checkpoint_files, map_checkpoint
from ._compress import Rule, compress_checkpoint
from ._dtypes import torch_dtype
from ._experts import (
    ExpertCache,
    ExpertLayer,
    Runs,
    build_experts,
    find_experts,
    find_router,
    slice_fused,
)
from ._keys import KeyMap, checkpoint_keys
from ._runtimes import Budget, consumer_done, make_runtime

# Note [Blocks]
# ~~~~~~~~~~~~~
# A block is the unit that is leased for one forward: each layer of the model's layer list (its
# largest nn.ModuleList by parameter count), and every other submodule with parameters that does
# not contain that list (the embedding, the final norm, the head). Blocks run one after another;
# a block called while another is open is an error naming both. The model's own forward is one
# iteration of the prefetch pipeline, so generate() repeats the same steps for every token.
# A parameter outside a forward is a placeholder on the right device with the right dtype and
# shape, holding one NaN broadcast to that shape (model.device and model.dtype stay right, and a
# use of it outside its block's forward shows as NaN rather than as plausible numbers).


@dataclass
class _Slot:
    """One parameter of a block: where it sits and which runtime tensor fills it."""

    owner: nn.Module
    name: str
    use: int  # index into the block's uses (a tensor tied twice in a block is leased once)
    shape: torch.Size
    dtype: torch.dtype
    placeholder: nn.Parameter


@dataclass
class Block:
    """A module leased as one step: its name, its parameters' tensors and their bytes."""

    name: str
    module: nn.Module
    tensors: list[Tensor] = field(default_factory=list)
    slots: list[_Slot] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _find_layers(root: nn.Module) -> nn.ModuleList | None:
    best, best_count = None, 0
    for m in root.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1:
            count = sum(p.numel() for p in m.parameters())
            if count > best_count:
                best, best_count = m, count
    return best


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def find_blocks(root: nn.Module, names: Sequence[str] | None = None) -> list[tuple[str, nn.Module]]:
    """The blocks of `root` (Note [Blocks]), or the submodules `names` when given."""
    if names is not None:
        modules = dict(root.named_modules())
        missing = [n for n in names if n not in modules]
        if missing:
            raise NotFoundError(f"blocks: the module has no submodule {missing[0]!r}")
        return [(n, modules[n]) for n in names]
    layers = _find_layers(root)
    out: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, m: nn.Module) -> None:
        if m is layers:
            out.extend((_join(prefix, n), child) for n, child in m.named_children())
            return
        container = m is root or any(x is layers for x in m.modules())
        if not container:
            if next(m.parameters(), None) is not None:
                out.append((prefix, m))
            return
        own = [n for n, p in m._parameters.items() if p is not None]
        if own:
            raise UnsupportedError(
                f"module {prefix or type(m).__name__!r} holds parameters {own} itself and "
                "contains the other blocks; pass blocks=[...] naming the submodules to lease"
            )
        for n, child in m.named_children():
            visit(_join(prefix, n), child)

    visit("", root)
    return out


def _placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    fill = math.nan if dtype.is_floating_point else 0
    return nn.Parameter(torch.full((), fill, dtype=dtype, device=device).expand(shape), False)


class Offloaded:
    """What offload() did to a module: its runtime, prefetch pipeline and blocks.

    ``stats()`` gives the pipeline's and the runtime's counters; ``remove()`` takes the hooks
    off and destroys the tensors offload() mapped (the module's parameters stay placeholders).
    """

    def __init__(
        self,
        module: nn.Module,
        runtime: Runtime,
        pipeline: PrefetchPipeline,
        blocks: list[Block],
        owned: list[Tensor],
        device: torch.device,
    ) -> None:
        self.module = module
        self.runtime = runtime
        self.pipeline = pipeline
        self.blocks = blocks
        self.device = device
        self._owned = owned
        self._hooks: list[Any] = []
        self._depth = 0  # nested calls of the root module
        self._open: tuple[Block, list[Lease]] | None = None
        self._implicit_iteration = False
        # What compress= did (strata.torch._compress.CacheReport), None without it.
        self.compression: Any = None
        # The routed experts leased one by one (Note [Leased experts]), None without any.
        self.experts: ExpertCache | None = None

    # The root's forward is one iteration.
    def _begin_iteration(self, *_: Any) -> None:
        self._depth += 1
        if self._depth == 1:
            self.pipeline._core.begin_iteration()
            if self.experts is not None:
                self.experts.begin_forward()

    def _end_iteration(self, *_: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            if self._open is not None:  # a block's forward raised and left its step open
                self._end_block(self._open[0])
            self.pipeline._core.end_iteration()

    def _begin_block(self, block: Block) -> None:
        if self._open is not None:
            raise InvalidArgumentError(
                f"strata.torch: block {block.name!r} was called inside block "
                f"{self._open[0].name!r}; blocks must run one after another (pass blocks=[...])"
            )
        if self._depth == 0:  # called on its own, outside the model's forward
            self.pipeline._core.begin_iteration()
            self._implicit_iteration = True
        uses = [(t.id, Tier.DEVICE, Access.READ) for t in block.tensors]
        cores = self.pipeline._core.begin_step(block.name, uses)
        leases = [Lease(c, t) for c, t in zip(cores, block.tensors)]
        self._open = (block, leases)
        views = [torch.from_dlpack(lease) for lease in leases]
        for slot in block.slots:
            t = views[slot.use]
            if t.dtype != slot.dtype:
                t = t.to(slot.dtype)
            slot.owner._parameters[slot.name] = nn.Parameter(t.view(slot.shape), False)

    def _end_block(self, block: Block) -> None:
        if self._open is None or self._open[0] is not block:
            return
        _, leases = self._open
        self._open = None
        for slot in block.slots:
            slot.owner._parameters[slot.name] = slot.placeholder
        consumer_done(self.device)  # Note [Consumers' kernels]
        for lease in leases:
            lease.release()
        self.pipeline._core.end_step()
        if self._implicit_iteration:
            self._implicit_iteration = False
            self.pipeline._core.end_iteration()

    def _install(self) -> None:
        root = self.module
        self._hooks.append(root.register_forward_pre_hook(self._begin_iteration))
        self._hooks.append(root.register_forward_hook(self._end_iteration, always_call=True))
        for block in self.blocks:

            def pre(_m: nn.Module, _args: Any, block: Block = block) -> None:
                self._begin_block(block)

            def post(_m: nn.Module, _args: Any, _out: Any, block: Block = block) -> None:
                self._end_block(block)

            self._hooks.append(block.module.register_forward_pre_hook(pre))
            self._hooks.append(block.module.register_forward_hook(post, always_call=True))

    def stats(self) -> dict[str, Any]:
        """{"pipeline": prefetches, on-demand loads, steps ...; "runtime": per-tier counters;
        with routed experts, "experts": hits, host_hits, misses, bytes_moved, the pre-gating
        guesses, in all and per layer (Note [The expert cache])}."""
        out = {"pipeline": self.pipeline.stats(), "runtime": self.runtime.stats()}
        if self.experts is not None:
            out["experts"] = self.experts.stats()
        return out

    def drop_caches(self) -> None:
        """Drops every copy the device and host tiers keep of the model's tensors between
        forwards (none may be leased): the next forward reads them from their files, as a cold
        start does, without a new process. For benchmarks."""
        self.runtime.synchronize()
        for t in self._owned:
            self.runtime.evict(t, Tier.DEVICE)
            self.runtime.evict(t, Tier.HOST)
        if self.experts is not None:
            self.experts.dropped()

    def remove(self) -> None:
        """Takes the hooks off and destroys the tensors offload() mapped."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.experts is not None:
            self.experts.close()
            self.experts = None
        for t in self._owned:
            self.runtime.destroy(t)
        self._owned.clear()

    def __repr__(self) -> str:
        total = sum(b.nbytes for b in self.blocks)
        return (
            f"<strata.torch.Offloaded {type(self.module).__name__}: {len(self.blocks)} blocks, "
            f"{total / 2**20:.1f} MiB on {self.device}>"
        )


def _selector(
    module: nn.Module,
    tensors: Mapping[str, MappedTensor],
    keys: KeyMap,
    rule: Rule | None,
    expert_keys: Sequence[str] = (),
    fused: set[str] = frozenset(),  # type: ignore[assignment]
) -> Rule:
    """Which checkpoint tensors to compress: parameters only (buffers are read on the host),
    those `rule` picks; by default the 2-D weights of linear layers (nn.Linear, transformers'
    Conv1D) that no embedding shares (a tied lm_head stays full width with its embedding), and
    the routed experts' 2-D weights (`expert_keys`, Note [Leased experts]), never a `fused`
    experts tensor whole (each expert's slice of it is one of `expert_keys`)."""
    # Per parameter object (tied ones are one): every name it goes by, and whether every use is
    # a linear layer's 2-D weight.
    names_of: dict[int, list[str]] = {}
    linear_use: dict[int, bool] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            names_of.setdefault(id(p), []).append(_join(mod_name, attr))
            is_linear = (
                attr == "weight"
                and p.dim() == 2
                and (isinstance(mod, nn.Linear) or type(mod).__name__ == "Conv1D")
            )
            linear_use[id(p)] = linear_use.get(id(p), True) and is_linear
    linear: dict[str, bool] = {}  # checkpoint name -> compress by default
    for pid, names in names_of.items():
        mapped = _resolve(names, tensors, keys)
        if mapped is not None:
            name = mapped.tensor.name
            linear[name] = linear.get(name, True) and linear_use[pid]
    for name in expert_keys:
        if name in tensors and len(tensors[name].tensor.shape) == 2:
            linear.setdefault(name, True)

    def select(name: str, shape: tuple[int, ...], dtype: str) -> bool:
        if name not in linear or name in fused:
            return False
        return rule(name, shape, dtype) if rule is not None else linear[name]

    return select


def _resolve(
    qualnames: Sequence[str], tensors: Mapping[str, MappedTensor], keys: KeyMap
) -> MappedTensor | None:
    """The checkpoint tensor of a parameter known by `qualnames` (several when tied): the key
    `keys` maps each name to (Note [Checkpoint keys]), or a tensor built for it."""
    for q in qualnames:
        key = keys.key_of(q, tensors)
        if key is not None:
            return tensors[key]
    return None


# Note [Converted parameters]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A parameter transformers builds from several checkpoint tensors (Note [Checkpoint keys]: fused
# experts) has no bytes in the files to map. offload() builds it once, before anything runs,
# with transformers' own converter on the source tensors read through the host tier, and makes
# it a tensor of the runtime homed on the host tier under the parameter's name (as the
# optimizer's states are): from then on it is leased, prefetched and evicted like any weight,
# written to the NVMe tier when the host budget is full (give nvme_dir for a large MoE model).
# Its sources stay mapped and are never leased; it is not compressed (compress= picks tensors
# of the files).


def _build_conversions(
    module: nn.Module,
    keys: KeyMap,
    tensors: Mapping[str, MappedTensor],
    runtime: Runtime,
    owned: list[Tensor],
    skip: set[str] = frozenset(),  # type: ignore[assignment]
) -> dict[str, MappedTensor]:
    """The tensors of the converted parameters (Note [Converted parameters]), added to `owned`
    as they are made; not those whose names are all in `skip` (routed experts, built per expert
    by strata.torch._experts)."""

    def read(key: str) -> torch.Tensor:
        m = tensors[key]
        with runtime.acquire(m.tensor, Tier.HOST, Access.READ) as lease:
            return torch.from_dlpack(lease).clone().view(m.tensor.shape)

    built: dict[str, MappedTensor] = {}
    for conversion in keys.conversions():
        if all(t in skip for t in conversion.targets):
            continue
        how = f"transformers' {conversion.describe()} ({conversion.keys[0]!r}, ...)"
        try:
            out = conversion.build(read, module)
        except Exception as e:
            raise InvalidArgumentError(f"parameter {conversion.first!r}: {how} failed: {e}") from e
        path = tensors[conversion.keys[0]].path
        for name in conversion.targets:
            if name not in out:
                raise NotFoundError(
                    f"parameter {name!r}: {how} built {sorted(out)}, not it (in {str(path)!r})"
                )
            value = out[name].detach().contiguous()
            try:
                t = runtime.create_tensor(name, tuple(value.shape), value.dtype, Tier.HOST, value)
            except OutOfMemoryError as e:
                raise OutOfMemoryError(
                    f"parameter {name!r}, built by {how}, needs {value.nbytes} bytes on the host "
                    f"tier or NVMe: raise host_budget or give nvme_dir ({e})"
                ) from e
            owned.append(t)
            built[name] = MappedTensor(t, path)
    return built


def _device_budget(runtime: Runtime) -> int:
    tiers = runtime.stats().get("tiers", {})
    for key, value in tiers.items():
        if key.lower() == "device":
            return int(value["capacity_bytes"])
    return 0


def offload(
    module: nn.Module,
    checkpoint: Checkpoint | Mapping[str, Tensor] | None = None,
    *,
    runtime: Runtime | None = None,
    device: str | torch.device = "cpu",
    device_budget: Budget = "2GiB",
    host_budget: Budget = "4GiB",
    nvme_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
    prefetch: str = "auto",
    blocks: Sequence[str] | None = None,
    compress: str | None = None,
    compress_group: int = 64,
    compress_rule: Rule | None = None,
    compress_cache: str | os.PathLike[str] | None = None,
    verify_cache: bool = True,
    experts: str = "leased",
    expert_compute: str = "auto",
    expert_prefetch: str = "auto",
) -> Offloaded:
    """Runs `module` with its parameters in a strata Runtime, leased block by block.

    `compress` ("int8" or "int4") keeps the weights that `compress_rule(name, shape, dtype)`
    picks (default: the 2-D weights of linear layers; embeddings, norms and biases stay full
    width) compressed on the host and NVMe tiers, in groups of `compress_group` along their last
    dimension, dequantized as each block is leased (Note [Compressed copies]). They are
    quantized once into a cache in `compress_cache` (default: `nvme_dir`, else
    ~/.cache/strata/compressed), reused while the checkpoint file is unchanged (Note [The
    compressed cache]); ``handle.compression`` says what was reused or rebuilt, and why.

    `checkpoint` is a safetensors checkpoint (a directory, a file or a list of files; its
    tensors are mapped in place) or a mapping of parameter names to tensors already in
    `runtime`. Names follow ``module.state_dict()``, or for a transformers model the keys its
    conversion mapping gives them (renames and fused tensors, Note [Checkpoint keys]; a fused one
    is built once, Note [Converted parameters]); tied parameters may appear once. `runtime`
    defaults to a new one for `device` with the budgets (strings with units or bytes). `dtype`
    converts floating parameters as they are leased (default: the file's dtype). Persistent
    buffers found in the checkpoint are copied into the module once; the others stay as built.

    A mixture-of-experts model's routed experts (transformers' experts modules) are leased one
    by one as the router picks them (``experts="leased"``, Note [Leased experts]), kept on the
    tiers by routing frequency (Note [The expert cache]) and prefetched by pre-gating (Note
    [Pre-gating]); ``experts="whole"`` leases each layer with all its experts. On the host tier
    an expert may be computed where it is (`expert_compute`, Note [Where an expert runs]);
    `expert_prefetch` says which guesses move ("auto": never one read from storage; "all";
    "off").

    Every parameter must be found with the right shape, and every block must fit the device
    budget, before anything runs: otherwise NotFoundError, InvalidArgumentError or
    OutOfMemoryError name the tensor (and file) or block and the sizes, and the tensors mapped
    so far are destroyed. Returns the Offloaded handle (also at ``module.strata``).
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)
    if runtime is None:
        runtime = make_runtime(dev, device_budget, host_budget, nvme_dir)
    if experts not in ("leased", "whole"):
        raise InvalidArgumentError(f"experts={experts!r}: expected 'leased' or 'whole'")
    expert_modules = find_experts(module) if experts == "leased" else []
    owned: list[Tensor] = []
    if checkpoint is None:
        raise InvalidArgumentError("offload: give a checkpoint (path or files) or tensors")
    if isinstance(checkpoint, Mapping):
        tensors = {
            n: MappedTensor(t, getattr(t, "path", None) or "<runtime>")
            for n, t in checkpoint.items()
        }
    else:
        tensors = map_checkpoint(runtime, checkpoint_files(checkpoint))
        owned = [m.tensor for m in tensors.values()]
    keys = checkpoint_keys(module, tensors)
    # Every name a parameter object goes by (tied weights have several).
    names_of: dict[int, list[str]] = {}
    for qualname, p in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(qualname)
    expert_names = {
        names_of[id(p)][0] for _, m in expert_modules for p in m.parameters(recurse=False)
    }
    expert_keys = [
        k for name in expert_names if (c := keys.conversion_of(name)) is not None for k in c.keys
    ]
    if compress is not None and isinstance(checkpoint, Mapping):
        raise InvalidArgumentError("offload: compress= needs a checkpoint's files")
    # Fused 3-D experts tensors: each expert's slice a tensor of its own, before compression
    # (Note [Leased experts]); the fused tensor itself is then never compressed whole.
    sliced = slice_fused(
        expert_modules, lambda p: names_of[id(p)][0], tensors, keys, runtime, owned
    )
    fused = {name.rsplit("[", 1)[0] for name in sliced}
    tensors = {**tensors, **sliced}
    expert_keys += list(sliced)
    report = None
    compressed: set[int] = set()
    if compress is not None:
        cache = compress_cache or nvme_dir or Path.home() / ".cache" / "strata" / "compressed"
        full_width = {n: m.tensor.id for n, m in tensors.items()}
        try:
            tensors, report = compress_checkpoint(
                runtime,
                tensors,
                _selector(module, tensors, keys, compress_rule, expert_keys, fused),
                compress=compress,
                group=compress_group,
                cache_dir=Path(cache),
                verify=verify_cache,
            )
        except BaseException:
            for t in owned:
                runtime.destroy(t)
            raise
        owned = [m.tensor for m in tensors.values()]
        compressed = {m.tensor.id for n, m in tensors.items() if full_width.get(n) != m.tensor.id}
    try:
        # Note [An expert in one piece]: runs only of the tensors mapped in place
        runs = Runs(tensors, runtime, owned, compressed) if expert_modules else None
        tensors = {
            **tensors,
            **_build_conversions(module, keys, tensors, runtime, owned, expert_names),
        }
        layers = [
            build_experts(
                name,
                m,
                i,
                lambda p: names_of[id(p)][0],
                tensors,
                keys,
                runtime,
                owned,
                dtype,
                runs,
            )
            for i, (name, m) in enumerate(expert_modules)
        ]
        expert_params = {id(p) for _, m in expert_modules for p in m.parameters(recurse=False)}
        found: list[Block] = []
        budget = _device_budget(runtime)
        for block_name, block_module in find_blocks(module, blocks):
            block = Block(block_name, block_module)
            index_of: dict[int, int] = {}
            for local, p in block_module.named_parameters(remove_duplicate=False):
                if id(p) in expert_params:
                    continue  # leased expert by expert (Note [Leased experts])
                qualnames = names_of[id(p)]
                mapped = _resolve(qualnames, tensors, keys)
                if mapped is None:
                    raise NotFoundError(
                        f"parameter {qualnames[0]!r} {tuple(p.shape)} is in none of the "
                        f"checkpoint's files ({_files(tensors)}): {keys.tried(qualnames[0])}"
                    )
                if tuple(mapped.tensor.shape) != tuple(p.shape):
                    conversion = keys.conversion_of(mapped.tensor.name)
                    built = (
                        f", built by transformers' {conversion.describe()}," if conversion else ""
                    )
                    raise InvalidArgumentError(
                        f"tensor {mapped.tensor.name!r} in {str(mapped.path)!r}{built} has shape "
                        f"{tuple(mapped.tensor.shape)}, parameter {qualnames[0]!r} of the model "
                        f"{tuple(p.shape)}"
                    )
                use = index_of.setdefault(mapped.tensor.id, len(block.tensors))
                if use == len(block.tensors):
                    block.tensors.append(mapped.tensor)
                file_dtype = torch_dtype(mapped.tensor.dtype)
                target = dtype if (dtype is not None and file_dtype.is_floating_point) else None
                param_dtype = target or file_dtype
                owner_name, _, attr = local.rpartition(".")
                owner = block_module.get_submodule(owner_name)
                block.slots.append(
                    _Slot(
                        owner,
                        attr,
                        use,
                        p.shape,
                        param_dtype,
                        _placeholder(p.shape, param_dtype, dev),
                    )
                )
            if budget and block.nbytes > budget:
                raise OutOfMemoryError(
                    f"block {block_name!r} needs {block.nbytes} bytes "
                    f"({block.nbytes / 2**20:.1f} MiB) on the device tier, the device budget is "
                    f"{budget} bytes ({budget / 2**20:.1f} MiB): raise device_budget"
                )
            found.append(block)
        routers = _routers(module, expert_modules, layers, names_of, tensors, keys)
        shares = _expert_shares(layers, found, routers, expert_modules, runtime, budget)
        _copy_buffers(module, tensors, keys, runtime, dev)
    except BaseException:
        for t in owned:
            runtime.destroy(t)
        raise
    for block in found:
        for slot in block.slots:
            slot.owner._parameters[slot.name] = slot.placeholder
    for _, m in expert_modules:
        for attr, p in list(m.named_parameters(recurse=False)):
            m._parameters[attr] = _placeholder(p.shape, p.dtype, dev)
    if layers:
        # Note [The expert cache]: the dense blocks are prefetched one ahead, within what the
        # experts' shares leave of each tier; when two blocks and an expert do not fit the
        # device, on demand.
        room = 2 * max(b.nbytes for b in found) + max(e.nbytes for lr in layers for e in lr.experts)
        if prefetch == "auto":
            prefetch = "fixed" if not budget or room <= budget else "none"
        pipeline = PrefetchPipeline(
            runtime, prefetch, fixed_lookahead=1, device_reserve=shares[0], host_reserve=shares[1]
        )
    else:
        pipeline = PrefetchPipeline(runtime, prefetch)
    handle = Offloaded(module, runtime, pipeline, found, owned, dev)
    handle.compression = report
    if layers:
        cache = ExpertCache(
            runtime, layers, dev, shares[0], shares[1], expert_compute, compressed, expert_prefetch
        )
        cache.set_routers(routers)
        cache.install()
        handle.experts = cache
    handle._install()
    module.__dict__["strata"] = handle
    return handle


def _routers(
    module: nn.Module,
    expert_modules: Sequence[tuple[str, nn.Module]],
    layers: Sequence[ExpertLayer],
    names_of: Mapping[int, list[str]],
    tensors: Mapping[str, MappedTensor],
    keys: KeyMap,
) -> dict[int, tuple[Tensor, tuple[int, ...]]]:
    """Each experts layer's router weight, when its sparse block has one (Note [Pre-gating]):
    the tensor and its shape, by layer index."""
    out: dict[int, tuple[Tensor, tuple[int, ...]]] = {}
    hidden = getattr(getattr(module, "config", None), "hidden_size", None)
    for (name, m), layer in zip(expert_modules, layers):
        parent = module.get_submodule(name.rpartition(".")[0])
        w = next(iter(layer.experts[0].slices.values())).shape
        size = hidden or (w[0] if m.is_transposed else w[-1])
        router = find_router(parent, len(layer.experts), int(size))
        if router is None:
            continue
        mapped = _resolve(names_of[id(router.weight)], tensors, keys)
        if mapped is not None and torch_dtype(mapped.tensor.dtype).is_floating_point:
            out[layer.index] = (mapped.tensor, tuple(router.weight.shape))
    return out


def _expert_shares(
    layers: Sequence[ExpertLayer],
    blocks: Sequence[Block],
    routers: Mapping[int, tuple[Tensor, tuple[int, ...]]],
    expert_modules: Sequence[tuple[str, nn.Module]],
    runtime: Runtime,
    budget: int,
) -> tuple[int, int]:
    """The device and host bytes the expert cache may keep (Note [The expert cache]); a device
    budget below a layer's dense block, its largest expert and the next layer's router (leased
    for pre-gating) is an OutOfMemoryError with both numbers."""
    if not layers:
        return 0, 0
    router = max((t.nbytes for t, _ in routers.values()), default=0)
    largest_block = max((b.nbytes for b in blocks), default=0)
    if budget:
        for (name, _), layer in zip(expert_modules, layers):
            block = next(
                (b for b in blocks if name == b.name or name.startswith(b.name + ".")), None
            )
            dense = block.nbytes if block is not None else 0
            one = max(e.nbytes for e in layer.experts)
            need = dense + one + router
            if need > budget:
                raise OutOfMemoryError(
                    f"experts {name!r}: its layer's dense block"
                    f"{' ' + repr(block.name) if block else ''} ({dense} bytes), its largest "
                    f"expert ({one} bytes) and a router for pre-gating ({router} bytes) "
                    f"need {need} bytes ({need / 2**20:.1f} MiB) on the device tier at once, the "
                    f"device budget is {budget} bytes ({budget / 2**20:.1f} MiB): raise "
                    "device_budget"
                )
    host = 0
    for key, value in runtime.stats().get("tiers", {}).items():
        if key.lower() == "host":
            host = int(value["capacity_bytes"])
    device_share = budget - 2 * largest_block - router if budget else 0
    host_share = host - 2 * largest_block if host else 0
    return max(device_share, 0), max(host_share, 0)


def _files(tensors: Mapping[str, MappedTensor]) -> str:
    files = sorted({str(m.path) for m in tensors.values()})
    return ", ".join(files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")


def _copy_buffers(
    module: nn.Module,
    tensors: Mapping[str, MappedTensor],
    keys: KeyMap,
    runtime: Runtime,
    device: torch.device,
) -> None:
    """Persistent buffers found in the checkpoint are read into the module (they are small);
    every buffer moves to `device`."""
    for qualname, buf in module.named_buffers():
        owner_name, _, attr = qualname.rpartition(".")
        owner = module.get_submodule(owner_name)
        mapped = None
        if attr not in owner._non_persistent_buffers_set:
            mapped = _resolve([qualname], tensors, keys)
        if mapped is not None:
            with runtime.acquire(mapped.tensor, Tier.HOST, Access.READ) as lease:
                value = torch.from_dlpack(lease).clone().view(buf.shape).to(buf.dtype)
            owner._buffers[attr] = value.to(device)
        elif buf.device != device:
            owner._buffers[attr] = buf.to(device)
