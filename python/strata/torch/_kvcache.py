"""KVCache: a transformers Cache whose keys and values live in pages of `page_tokens` tokens, each
a strata tensor on the device, host and NVMe tiers, under the same budgets as the weights
(Note [KV pages])."""

from __future__ import annotations

import contextlib
import os
from collections import deque
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .._core import Access, Tier
from .._errors import Error, InvalidArgumentError, OutOfMemoryError, UnsupportedError
from .._pipeline import PrefetchPipeline
from .._runtime import LeaseFuture, Runtime, Tensor
from ._dtypes import STRATA_DTYPES
from ._runtimes import Budget, consumer_done, has_nvme_tier, in_pages, make_runtime

# Note [KV pages]
# ~~~~~~~~~~~~~~~
# A layer's cache is a list of pages, each a runtime tensor of shape [2, batch, kv_heads,
# page_tokens, head_dim]: its keys, then its values, one contiguous block per move (0.5-2 MiB at
# the usual sizes, the size the tiers move at their rate). Page i holds tokens [i*P, (i+1)*P).
# The last page, while it has room, is open: made unwritten (Runtime.create_unwritten: no room
# taken and no zeros written to NVMe until its first lease), then leased for writing on the
# device tier as tokens append, so its copy there is dirty and goes down the tiers only when it
# is evicted. A page that fills is closed; with compress="int8" it is remade from its bytes as
# a compressed tensor (quantized once, read-only, its host and NVMe copies int8, dequantized on
# arrival). Pages are homed on NVMe when the runtime has an NVMe tier of its own (nvme_dir),
# else on the host tier; the runtime moves them down when a tier is full (LRU) and back up when
# leased.
#
# update() for a layer leases its closed pages one after another, the next ones already on their
# way (acquire_async: `depth` pages that must move, 2 to 64 of them, as many as an eighth of the
# tiers they pass through holds, so that NVMe sees a queue of large reads), copies each into the
# keys and values that attention reads, then appends the new tokens to the open page (and to new
# pages when they overflow it), and ends by prefetching the next layer's first `depth` pages that
# must move (of layer 0 after the last: the next token's), which NVMe reads while this layer
# attends (Note [Streamed pages]).
# The keys and values handed to attention are transient tensors of one layer, as DynamicCache's
# concatenation makes them; nothing of the cache stays outside the runtime between updates.
#
# On the host backend (the device tier a CPU arena), a closed page that is on the host tier and
# not on the device is read from its host copy, and one only on NVMe is brought to the host tier
# (into the pinned slab at the disk's rate): the copy into the device arena would be one more
# memcpy of the same CPU memory. Compressed pages are read on the device tier, where they are
# dequantized. On CUDA every page is read on the device tier.
#
# A step that fails (an EIO reading a page, a tier or the disk full when a page must go down)
# is rolled back before the error leaves update(): the layers that already took the step's
# tokens give them back (crop), so the cache holds exactly what it held before the step, and the
# same step may be tried again (Note [A failed step]).

_DEPTH = 2  # closed pages on their way while one is copied, at least
_MAX_DEPTH = 64  # and at most (Note [Streamed pages])
# Pages a layer leases at once on its read tier, at least: the one copied and those on their way,
# and on CUDA the one before, whose copies may still run (Note [Consumers' kernels]).
_WORKING = _DEPTH + 1


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# the floating dtypes a page may hold, by their strata names
_DTYPE_NAMES = {t: STRATA_DTYPES[t] for t in (torch.float32, torch.float16, torch.bfloat16)}


def _stored_bytes(page: Tensor, packed: bool, group: int) -> int:
    """The bytes a page's host or NVMe copy holds: int8 codes and an fp16 min and step per
    group when packed (Note [Compressed copies]), else its full width."""
    if not packed:
        return page.nbytes
    n = 1
    for s in page.shape:
        n *= s
    return n + 4 * -(-n // group)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


class _PagedLayer(CacheLayerMixin):
    """One decoder layer's keys and values in pages (Note [KV pages])."""

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, cache: KVCache, index: int) -> None:
        super().__init__()
        self._cache = cache
        self.index = index
        self.pages: list[Tensor] = []
        self.packed: list[bool] = []  # page i is stored compressed (closed, read-only)
        self.tokens = 0
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None
        self.batch_size = 0
        self.heads = 0
        self.head_dim = 0
        self.depth = _DEPTH

    # -- what transformers asks --

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        c = self._cache
        if key_states.shape != value_states.shape:
            raise UnsupportedError(
                f"KVCache layer {self.index}: keys {tuple(key_states.shape)} and values "
                f"{tuple(value_states.shape)} differ in shape; pages hold both of one shape"
            )
        if key_states.dtype not in _DTYPE_NAMES:
            raise UnsupportedError(
                f"KVCache layer {self.index}: keys of {key_states.dtype}; pages hold float32, "
                "float16 or bfloat16"
            )
        self.batch_size, self.heads, _, self.head_dim = key_states.shape
        self.device = key_states.device
        self.dtype = key_states.dtype
        c._check_room(self.batch_size, self.heads, self.head_dim, self.dtype)
        page = c.page_bytes(self.batch_size, self.heads, self.head_dim, self.dtype)
        # Note [Streamed pages]: an eighth of the tiers a streamed page passes through; on the
        # host backend a full-width page from NVMe stops at the host tier, where it is read.
        room = c._capacity["Host"]
        if c.compress is not None or not c._host_backend:
            room = min(c._capacity["Device"] - c._model_block_bytes, room)
        self.depth = max(_DEPTH, min(_MAX_DEPTH, room // 8 // page))
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.tokens

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.tokens + query_length, 0

    def offload(self) -> None:  # the runtime places the pages
        pass

    def prefetch(self) -> None:
        self._cache._prefetch_layer(self)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, n, d = key_states.shape
        if (b, h, d) != (self.batch_size, self.heads, self.head_dim):
            raise InvalidArgumentError(
                f"KVCache layer {self.index}: keys of batch {b}, {h} heads of {d} after "
                f"{self.batch_size}, {self.heads}, {self.head_dim}: one cache serves one batch "
                "(reset() it for another)"
            )
        before = self.tokens
        shape = (b, h, before + n, d)
        keys = torch.empty(shape, dtype=self.dtype, device=self.device)
        values = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._gather(keys, values)
        keys[:, :, before:].copy_(key_states)
        values[:, :, before:].copy_(value_states)
        self._append(key_states, value_states)
        return keys, values

    # -- pages --

    @property
    def page_tokens(self) -> int:
        return self._cache.page_tokens

    def _page_shape(self) -> tuple[int, ...]:
        return (2, self.batch_size, self.heads, self.page_tokens, self.head_dim)

    def _page_name(self, i: int) -> str:
        return f"{self._cache._prefix}.layers.{self.index}.page.{i}"

    def _named(self, e: Exception, i: int, what: str) -> Exception:
        """`e` again, of its type, naming this layer and page."""
        msg = (
            f"KVCache layer {self.index}, page {i} (tokens {i * self.page_tokens}.."
            f"{(i + 1) * self.page_tokens - 1}), {what}: {e}"
        )
        try:
            out = type(e)(msg)
        except TypeError:
            out = Error(msg)
        return out

    def _view(self, lease: Any) -> torch.Tensor:
        return torch.from_dlpack(lease).view(self.dtype).view(self._page_shape())

    def _gather(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copies every page's tokens into `keys` and `values` (Note [KV pages])."""
        c = self._cache
        runtime = c.runtime
        p = self.page_tokens
        count = len(self.pages)
        futures: deque = deque()
        later = 0  # the next page to lease
        scan = 0  # the next closed page whose move may start before its lease
        moving: deque = deque()  # pages after the one copied whose move has started, in order

        def lease_to(last: int) -> None:
            """Leases the pages up to `last`, in order (`depth` ahead of the one copied)."""
            nonlocal later
            while later <= min(last, count - 1):
                tier, brought = c._read_tier(self, later)
                futures.append((tier, brought, runtime.acquire_async(self.pages[later], tier)))
                if brought and later >= scan:  # its move starts now
                    moving.append(later)
                later += 1

        def move_ahead() -> None:
            """Starts the moves of the closed pages beyond the leased ones until `depth` moves
            are under way (Note [Streamed pages]): pages already on their read tier do not
            count, and beyond the `depth` leased ones they are not leased early (which would pin
            them, and on the device tier fill it)."""
            nonlocal scan
            scan = max(scan, later)
            while scan < count - 1 and len(moving) < depth:
                started = c._start_move(self, scan)
                if started is None:  # no room now: the page's lease brings it
                    break
                if started:
                    moving.append(scan)
                scan += 1

        # On CUDA a page's lease ends once its copies ran (Note [Consumers' kernels]): the event
        # after them is waited for one page later, when it has most likely passed.
        cuda = self.device.type == "cuda"
        in_use: deque = deque()

        def finish(lease: Any, event: Any, j: int, tier: Tier, brought: bool | str) -> None:
            if event is not None:
                event.synchronize()
            lease.release()
            if brought and j < count - 1:  # Note [Streamed pages]; the open one stays
                c._keep_or_drop(self, j, tier, room)
                if tier == Tier.DEVICE and brought == "nvme":  # its copy on the way too
                    c._keep_or_drop(self, j, Tier.HOST, room)

        i = 0
        held: Any = None
        try:
            depth = self.depth
            # Note [Streamed pages]: those a prefetch brought already hold their room; on CUDA
            # the page before the one copied is still leased.
            pending = sum(1 for page in self.pages if page.id in c._prefetched)
            room = c._room(max(0, depth + 1 + int(cuda) - pending), self)
            lease_to(depth - 1)
            move_ahead()
            for i in range(count):
                tier, brought, future = futures.popleft()
                held = future  # given back by the handler until in_use holds its lease
                while moving and moving[0] <= i:
                    moving.popleft()
                arrived = future.done()
                lease_to(i + depth)
                move_ahead()
                lease = held = future.result()
                if brought:
                    c._arrivals[arrived] += 1
                page = self._view(lease)
                n = min(p, self.tokens - i * p)
                dst = slice(i * p, i * p + n)
                keys[:, :, dst].copy_(page[0, :, :, :n])
                values[:, :, dst].copy_(page[1, :, :, :n])
                del page  # a view holds the lease
                event = None
                if cuda:
                    event = torch.cuda.Event()
                    event.record()
                in_use.append((lease, event, i, tier, brought))
                held = None
                while len(in_use) > int(cuda):
                    finish(*in_use.popleft())
            while in_use:
                finish(*in_use.popleft())
        except Exception as e:
            if cuda:
                consumer_done(self.device)
            for entry in in_use:
                with contextlib.suppress(Exception):
                    entry[0].release()
            if held is not None:  # the page being copied
                with contextlib.suppress(Exception):
                    (held.result() if isinstance(held, LeaseFuture) else held).release()
            for _, _, f in futures:  # give back what is on its way
                with contextlib.suppress(Exception):
                    f.result().release()
            raise self._named(e, i, "reading it back") from e

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Writes the new tokens into the open page and new ones; self.tokens counts them as
        they land, so a failure part way leaves a count crop() can take back."""
        c = self._cache
        p = self.page_tokens
        n = key_states.shape[-2]
        done = 0
        while done < n:
            i, at = divmod(self.tokens, p)
            if i == len(self.pages):
                try:
                    page = c.runtime.create_unwritten(
                        self._page_name(i), self._page_shape(), _DTYPE_NAMES[self.dtype], c.home
                    )
                except Exception as e:
                    raise self._named(e, i, "making it") from e
                self.pages.append(page)
                self.packed.append(False)
                access = Access.WRITE  # nothing there yet: write-discard moves nothing
            else:
                access = Access.READ_WRITE
            take = min(p - at, n - done)
            try:
                with c.runtime.acquire(self.pages[i], Tier.DEVICE, access) as lease:
                    page = self._view(lease)
                    page[0, :, :, at : at + take].copy_(key_states[:, :, done : done + take])
                    page[1, :, :, at : at + take].copy_(value_states[:, :, done : done + take])
                    if access == Access.WRITE and at + take < p:
                        page[:, :, :, at + take :].zero_()  # defined bytes below and on disk
                    del page
                    consumer_done(self.device)  # Note [Consumers' kernels]
            except Exception as e:
                if access == Access.WRITE:  # never written: it holds nothing
                    c._destroy(self.pages.pop())
                    self.packed.pop()
                raise self._named(e, i, "writing tokens into it") from e
            self.tokens += take
            done += take
            if self.tokens % p == 0 and c.compress is not None:
                self._pack(i)

    def _pack(self, i: int) -> None:
        """Remakes the full page i as a compressed tensor (quantized once, read-only)."""
        c = self._cache
        old = self.pages[i]
        try:
            with c.runtime.acquire(old, Tier.DEVICE, Access.READ) as lease:
                src = self._view(lease).cpu()  # on CUDA a host copy; else the lease's bytes
                new = c.runtime.create_tensor(
                    self._page_name(i) + ".int8",
                    self._page_shape(),
                    _DTYPE_NAMES[self.dtype],
                    c.home,
                    src,
                    compress=c.compress,
                    group=c._group(self.head_dim),
                )
                del src  # on the host backend, a view of the lease
        except Exception as e:
            raise self._named(e, i, "compressing it") from e
        self.pages[i] = new
        self.packed[i] = True
        c._destroy(old)
        if c.home == Tier.NVME:  # create_tensor wrote it there, not a move the runtime counts
            c._nvme_written += _stored_bytes(new, True, c._group(self.head_dim))

    def _unpack(self, i: int) -> None:
        """Makes the compressed page i writable again (a crop left it partly full)."""
        c = self._cache
        old = self.pages[i]
        new = c.runtime.create_unwritten(
            self._page_name(i), self._page_shape(), _DTYPE_NAMES[self.dtype], c.home
        )
        with (
            c.runtime.acquire(old, Tier.DEVICE, Access.READ) as src,
            c.runtime.acquire(new, Tier.DEVICE, Access.WRITE) as dst,
        ):
            self._view(dst).copy_(self._view(src))
            consumer_done(self.device)  # Note [Consumers' kernels]
        self.pages[i] = new
        self.packed[i] = False
        c._destroy(old)

    def _remake(self, edit: Any, batch_size: int) -> None:
        """Every page again through `edit` (a batch index_select or repeat), for beam search."""
        c = self._cache
        if c.compress is not None and any(self.packed):
            raise UnsupportedError(
                f"KVCache layer {self.index}: reordering the batch of int8 pages would quantize "
                "them twice; use compress=None with beam search or batch selection"
            )
        old_batch = self.batch_size
        pages = []
        try:
            for i, old in enumerate(self.pages):
                self.batch_size = old_batch
                with c.runtime.acquire(old, Tier.DEVICE, Access.READ) as lease:
                    edited = edit(self._view(lease)).clone()  # a copy, never a view of it
                    consumer_done(self.device)  # Note [Consumers' kernels]
                self.batch_size = batch_size
                new = c.runtime.create_unwritten(
                    self._page_name(i) + ".b", self._page_shape(), _DTYPE_NAMES[self.dtype], c.home
                )
                pages.append(new)
                with c.runtime.acquire(new, Tier.DEVICE, Access.WRITE) as lease:
                    self._view(lease).copy_(edited)
                    consumer_done(self.device)  # Note [Consumers' kernels]
        except Exception:
            self.batch_size = old_batch
            for t in pages:
                c._destroy(t)
            raise
        for old in self.pages:
            c._destroy(old)
        self.pages = pages
        self.batch_size = batch_size

    # -- what the Cache API also asks --

    def reset(self) -> None:
        for t in self.pages:
            self._cache._destroy(t)
        self.pages, self.packed, self.tokens = [], [], 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last -tokens_to_remove tokens (transformers' convention: a negative count),
        or keeps the first `tokens_to_remove` when positive (the legacy absolute length)."""
        keep = self.tokens + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove
        self._truncate(max(0, min(self.tokens, keep)))

    def _truncate(self, keep: int) -> None:
        p = self.page_tokens
        pages = -(-keep // p)
        while len(self.pages) > pages:
            self._cache._destroy(self.pages.pop())
            self.packed.pop()
        self.tokens = keep
        if keep % p and self.packed and self.packed[-1]:
            self._unpack(len(self.pages) - 1)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.tokens:
            idx = beam_idx.to("cpu" if self.device is None else self.device)
            self._remake(lambda page: page.index_select(1, idx.to(page.device)), len(beam_idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.tokens:
            self._remake(
                lambda page: page[:, indices.to(page.device)],
                int(torch.empty(self.batch_size)[indices].shape[0]),
            )

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.tokens:
            self._remake(
                lambda page: page.repeat_interleave(repeats, dim=1), self.batch_size * repeats
            )
        else:
            self.batch_size *= repeats


class KVCache(Cache):
    """A transformers Cache whose keys and values are pages of `page_tokens` tokens on strata's
    tiers (Note [KV pages])::

        cache = st.KVCache(model, host_budget="4GiB", nvme_dir="/mnt/nvme")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=512)
        cache.stats()

    `model` is any transformers causal LM: one in memory (a runtime of `device_budget`,
    `host_budget` and `nvme_dir` is made for the cache), or one `st.load_model` runs, whose
    runtime the cache then shares (`runtime=None`): one set of budgets covers weights and KV.
    `compress="int8"`: closed pages are stored int8 in groups along head_dim on the host and
    NVMe tiers (strata.quant), dequantized on arrival: the tokens may then differ from full
    width. Beam search and batch selection reorder full-width pages; int8 pages refuse them.
    """

    def __init__(
        self,
        model: Any,
        device_budget: Budget | None = None,
        host_budget: Budget | None = None,
        nvme_dir: str | os.PathLike[str] | None = None,
        page_tokens: int = 256,
        compress: str | None = None,
        runtime: Runtime | None = None,
        nvme_capacity: Budget = "16GiB",
    ) -> None:
        config = model.config.get_text_config(decoder=True)
        types = getattr(config, "layer_types", None)
        if types is not None and any(t != "full_attention" for t in types):
            odd = sorted({t for t in types if t != "full_attention"})
            raise UnsupportedError(
                f"KVCache: {type(model).__name__} has {', '.join(odd)} layers; pages hold "
                "full-attention layers only"
            )
        if not isinstance(page_tokens, int) or page_tokens < 1:
            raise InvalidArgumentError(f"KVCache: page_tokens {page_tokens!r} is not >= 1")
        if compress not in (None, "int8"):
            raise InvalidArgumentError(f"KVCache: compress {compress!r} is not None or 'int8'")
        self.page_tokens = page_tokens
        self.compress = compress
        offloaded = getattr(model, "strata", None)
        self._model_block_bytes = 0
        if runtime is None and offloaded is not None:
            if device_budget is not None or host_budget is not None or nvme_dir is not None:
                raise InvalidArgumentError(
                    "KVCache: the model runs on strata (st.load_model / st.offload): the cache "
                    "shares its runtime and budgets; pass no device_budget, host_budget or "
                    "nvme_dir (or pass runtime= to use another)"
                )
            runtime = offloaded.runtime
            self._model_block_bytes = max((b.nbytes for b in offloaded.blocks), default=0)
            # Note [Arrival in pieces] (scheduler/src/planner.cpp): the model's pipeline may
            # place the next block over the running block's room, and then no more device room
            # may be asked for before that block's leases end, which is what a layer's pages
            # do inside its block: the next block waited for the pages' lease and the pages'
            # lease for the block's room. The model's pipeline is made again without it.
            pipeline = offloaded.pipeline
            if pipeline.options["arrival_in_pieces"]:
                offloaded.pipeline = PrefetchPipeline(
                    runtime, **{**pipeline.options, "arrival_in_pieces": False}
                )
        self._owned = runtime is None
        if runtime is None:
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            runtime = make_runtime(
                device,
                device_budget if device_budget is not None else "256MiB",
                host_budget if host_budget is not None else "4GiB",
                nvme_dir,
                nvme_capacity,
                # pages of up to 256 KiB are one stripe piece each, read by one request (a
                # smaller page shares its stripe: Note [Small extents] in io/src/swap_space.cpp)
                stripe="256KiB",
            )
        self.runtime = runtime
        self.home = Tier.NVME if has_nvme_tier(runtime) else Tier.HOST
        stats = runtime.stats()
        tiers = stats["tiers"]
        self._capacity = {t: tiers[t]["capacity_bytes"] for t in ("Device", "Host", "Nvme")}
        self._host_backend = stats["backend"] == "host"
        self._prefix = f"kv{id(self):x}"
        self._nvme_read = 0
        self._nvme_written = 0  # compressed pages made on NVMe (Note [KV pages])
        # Pages a prefetch brought, and from where (Note [Streamed pages]).
        self._prefetched: dict[int, bool | str] = {}
        # Pages that moved for a read: [waited for, had arrived when their layer reached them].
        self._arrivals = [0, 0]
        base = stats["transfers"]
        self._written0 = base["bytes_device_to_nvme"] + base["bytes_host_to_nvme"]
        self._step_tokens = 0
        layers = [_PagedLayer(self, i) for i in range(config.num_hidden_layers)]
        super().__init__(layers=layers)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        dtype = getattr(config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self._check_room(1, heads, head_dim, dtype if dtype in _DTYPE_NAMES else torch.float32)

    # -- budgets --

    def page_bytes(self, batch_size: int, heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """The bytes one page takes of a budget (whole 4 KiB pages)."""
        return in_pages(2 * batch_size * heads * self.page_tokens * head_dim * _element_size(dtype))

    def _check_room(self, batch_size: int, heads: int, head_dim: int, dtype: torch.dtype) -> None:
        page = self.page_bytes(batch_size, heads, head_dim, dtype)
        working = _WORKING + (0 if self._host_backend else 1)
        need = working * page
        shape = f"[2, {batch_size}, {heads}, {self.page_tokens}, {head_dim}]"
        for tier, extra, why in (
            ("Device", self._model_block_bytes, " plus the model's largest block"),
            ("Host", 0, ""),
        ):
            have = self._capacity[tier]
            if need + extra > have:
                raise OutOfMemoryError(
                    f"KVCache: one layer's working pages ({working} pages of {shape} "
                    f"{str(dtype).removeprefix('torch.')}, {_mib(need)})"
                    f"{f'{why} ({_mib(extra)})' if extra else ''} do not fit the {tier} tier's "
                    f"budget of {_mib(have)}: raise it, or lower page_tokens"
                )

    def _group(self, head_dim: int) -> int:
        return 64 if head_dim % 64 == 0 else head_dim

    def _stored(self, layer: _PagedLayer, i: int) -> int:
        """The bytes page i of `layer` holds on the host and NVMe tiers."""
        return _stored_bytes(layer.pages[i], layer.packed[i], self._group(layer.head_dim))

    # -- moving pages --

    # Note [Streamed pages]
    # ~~~~~~~~~~~~~~~~~~~~~
    # Every step reads every page of every layer in the same order: a cyclic scan. When the pages
    # are more than a tier holds, LRU evicts from it, each time, the page that is needed soonest,
    # and every read misses. So a page brought to its read tier for one use (it was not there, or
    # a prefetch brought it), and the host copy it left on its way up from NVMe, stay there only
    # while the tier has free room beyond what the pages on their way need (counted from the
    # tier's figures as the layer starts); else they leave after the use (dropped: clean, the copy
    # below is current). The pages a tier holds stay there and hit every step, and the rest stream
    # through the room the last streamed one left.
    #
    # That room is `depth` + 1 pages, and a layer's reads run `depth` moving pages ahead of its
    # copies, the first of them started while the layer before attends. The depth trades pages
    # held for overlap: each page of room is one more page read per step, and attention's time is
    # the disk's to fill only if the reads in flight last that long. At 32k tokens on the 2-core
    # VM (bench/kv-cache.py: 512 KiB pages, 128 MiB host tier) attention takes about 25 ms a
    # layer, in which the disk reads 50 pages or more; depth 8 (the cap until 2026-12-07) left
    # the disk idle for most of it: 0.72 s a step against 0.42 to 0.48 s at depths 24 to 96 in
    # the same run, where depth 96 read 11% more bytes. An eighth of the host tier (32 pages
    # there) reads 3% more than depth 8. Pages that had arrived when their layer reached them
    # are stats()["prefetch_hits"] of "pages_moved".
    def _room(self, pages: int, layer: _PagedLayer) -> dict[Tier, int]:
        """Free bytes on the device and host tiers beyond `pages` of `layer`'s pages (the room
        streaming needs), now."""
        page = self.page_bytes(layer.batch_size, layer.heads, layer.head_dim, layer.dtype)
        room = {}
        for tier in (Tier.DEVICE, Tier.HOST):
            capacity, used, _ = self.runtime.tier_bytes(tier)
            room[tier] = capacity - used - pages * page
        return room

    def _keep_or_drop(self, layer: _PagedLayer, i: int, tier: Tier, room: dict[Tier, int]) -> None:
        """A page brought to `tier` for one use stays while the tier has free room for it, else
        leaves (Note [Streamed pages])."""
        if tier == self.home:  # its floor: never dropped from there
            return
        page = layer.pages[i]
        packed = layer.packed[i] and tier != Tier.DEVICE
        nbytes = in_pages(_stored_bytes(page, packed, self._group(layer.head_dim)))
        if room[tier] >= nbytes:
            room[tier] -= nbytes
        else:
            self.runtime.evict(page, tier)

    def _read_tier(self, layer: _PagedLayer, i: int) -> tuple[Tier, bool | str]:
        """Where page i of `layer` is read (Note [KV pages]) and whether this read brings it there
        (Note [Streamed pages]); counts the bytes that come from NVMe."""
        page = layer.pages[i]
        runtime = self.runtime
        on_device = runtime.resident(page, Tier.DEVICE)
        on_host = on_device or runtime.resident(page, Tier.HOST)
        if not on_host:
            self._nvme_read += self._stored(layer, i)
        if layer.packed[i] or not self._host_backend or on_device:
            tier, there = Tier.DEVICE, on_device
        else:
            tier, there = Tier.HOST, on_host
        # "nvme": it leaves the host tier after its use too, if it stopped there on its way.
        brought: bool | str = "nvme" if not on_host else not there
        return tier, self._prefetched.pop(page.id, brought)

    def _start_move(self, layer: _PagedLayer, i: int) -> bool | None:
        """Starts bringing closed page i of `layer` to its read tier (a prefetch: no lease).
        True when it is on its way (now or before), False when it is there already, None when
        the tier has no room for it now (a hint: no error)."""
        page = layer.pages[i]
        if page.id in self._prefetched:
            return True
        tier, brought = self._read_tier(layer, i)
        if not brought:
            return False
        try:
            self.runtime.prefetch(page, tier)
        except OutOfMemoryError:
            if brought != "nvme":
                return None
            if self.runtime.resident(page, Tier.HOST):
                # On its way to the device through the host tier, the host leg started before
                # the device had no room: read from NVMe after all, and it leaves the host tier
                # after its use as a page brought from there does.
                self._prefetched[page.id] = "nvme"
                return None
            # not read after all: counted when its lease reads it
            self._nvme_read -= self._stored(layer, i)
            return None
        self._prefetched[page.id] = brought
        return True

    def _destroy(self, page: Tensor) -> None:
        """Destroys a page, and forgets that a prefetch brought it."""
        self._prefetched.pop(page.id, None)
        self.runtime.destroy(page)

    def _prefetch_layer(self, layer: _PagedLayer) -> None:
        """Starts the moves of the first `depth` closed pages of `layer` that are not on their
        read tier (Note [Streamed pages]), while the layer before attends."""
        started = 0
        for i in range(len(layer.pages) - 1):  # closed pages
            if started == layer.depth:
                break
            moved = self._start_move(layer, i)
            if moved is None:
                break
            started += moved

    # -- the Cache API --

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        if layer_idx == 0:
            self._step_tokens = key_states.shape[-2]
        before = layer.tokens
        try:
            out = layer.update(key_states, value_states, *args, **kwargs)
        except Exception:
            self._roll_back(layer_idx, before)
            raise
        if len(self.layers) > 1:
            self._prefetch_layer(self.layers[(layer_idx + 1) % len(self.layers)])
        return out

    # Note [A failed step]
    # ~~~~~~~~~~~~~~~~~~~~
    # A forward updates the layers in order, each with the step's tokens. When layer L fails,
    # layers 0..L-1 hold the step's tokens and L part of them: each gives them back (crop), so
    # every layer holds what it held before the step and the same step can run again (a retry
    # after a transient EIO, or after freeing room), and generate's tokens so far stay valid.
    def _roll_back(self, failed: int, before: int) -> None:
        self.layers[failed]._truncate(before)
        for layer in self.layers[:failed]:
            layer._truncate(max(0, layer.tokens - self._step_tokens))

    def stats(self) -> dict[str, Any]:
        """pages, tokens, page_bytes, bytes per tier (of the pages' copies there), stored_bytes
        (what the pages' host or NVMe copies hold: int8 codes for compressed ones),
        nvme_bytes_read (pages brought from NVMe, counted as their move starts) and
        nvme_bytes_written (the runtime's writes to NVMe since the cache began: on a shared
        runtime, inference writes nothing else), bytes_on_the_way (pages a prefetch is bringing
        up that no read has used yet), pages_moved (pages a read had to bring up) and
        prefetch_hits (those of them that had arrived when their layer reached them)."""
        tiers = {"device": 0, "host": 0, "nvme": 0}
        pages = 0
        compressed = 0
        stored_bytes = 0
        on_the_way = 0
        for layer in self.layers:
            for i, t in enumerate(layer.pages):
                pages += 1
                compressed += layer.packed[i]
                stored = self._stored(layer, i)
                stored_bytes += stored
                if t.id in self._prefetched:
                    on_the_way += stored
                if self.runtime.resident(t, Tier.DEVICE):
                    tiers["device"] += t.nbytes
                if self.runtime.resident(t, Tier.HOST):
                    tiers["host"] += stored
                if self.runtime.resident(t, Tier.NVME):
                    tiers["nvme"] += stored
        now = self.runtime.stats()["transfers"]
        written = now["bytes_device_to_nvme"] + now["bytes_host_to_nvme"] - self._written0
        written += self._nvme_written
        first = next((layer for layer in self.layers if layer.is_initialized), None)
        return {
            "pages": pages,
            "compressed_pages": compressed,
            "tokens": self.get_seq_length(),
            "page_tokens": self.page_tokens,
            "page_bytes": 0
            if first is None
            else self.page_bytes(first.batch_size, first.heads, first.head_dim, first.dtype),
            "bytes": tiers,
            "stored_bytes": stored_bytes,
            "home": self.home.name.lower(),
            "nvme_bytes_read": self._nvme_read,
            "nvme_bytes_written": written,
            "bytes_on_the_way": on_the_way,
            "pages_moved": sum(self._arrivals),
            "prefetch_hits": self._arrivals[1],
        }

    def close(self) -> None:
        """Destroys every page (the cache is empty after)."""
        for layer in self.layers:
            layer.reset()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
