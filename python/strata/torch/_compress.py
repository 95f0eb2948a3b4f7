"""Compressed offload of a checkpoint's weights (Note [Compressed copies] in
runtime/include/strata/quant/group_quant.h): each safetensors file's selected tensors are
quantized once into a compressed cache file beside it on NVMe, kept and reused across runs while
the source file is unchanged, and mapped in place as compressed tensors; the device copy of each
is dequantized on arrival.

Note [The compressed cache]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
One cache file per source file and (int8 | int4, group size): a safetensors file whose tensors are
the compressed copies (U8 blobs, strata.quant.quantize's bytes, padded to 4 KiB so that each
starts on a page, the data section too: the NVMe reads are O_DIRECT) and whose ``__metadata__``
"strata" entry (JSON) is its key and its contents: the source file's absolute path, size and
modification time in nanoseconds, the compression and group size, and per tensor its dtype,
shape, stored bytes and CRC32C. The key is the path, size and mtime (not a hash of the source:
hashing a 100 GB checkpoint at every start would cost a full read of it); a cache whose key or
selection of tensors differs, or that cannot be parsed, is stale: it is rebuilt (written to a
temporary file, then renamed over it), never used. With ``verify=True`` (the default) every blob's
CRC32C is checked when the cache is opened, so a corrupt cache is rebuilt too.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import quant
from .._core import quant as _quant
from .._errors import InvalidArgumentError
from .._runtime import Runtime, Tensor
from ._checkpoint import MappedTensor

FORMAT = 1
PAGE = 4096
COMPRESSIBLE = ("float32", "bfloat16", "float16")

# (name, shape, dtype name) -> compress it?
Rule = Callable[[str, tuple[int, ...], str], bool]


@dataclass
class CacheReport:
    """What opening the caches did: files reused and rebuilt (with why), bytes written."""

    reused: list[str]
    rebuilt: list[tuple[str, str]]  # (cache file, why)
    compressed_tensors: int
    stored_bytes: int
    full_bytes: int


def cache_path(source: Path, cache_dir: Path, compress: str, group: int) -> Path:
    """<stem>-<CRC32C of the absolute path, hex>.<compress>-g<group>.safetensors: the name the
    C++ side (strata/runtime/compressed_cache.h, stream_inference --compress) uses too."""
    import numpy as np

    where = np.frombuffer(bytearray(str(source.resolve()).encode()), dtype=np.uint8)
    return cache_dir / f"{source.stem}-{_quant.crc32c(where):08x}.{compress}-g{group}.safetensors"


def _key(source: Path, compress: str, group: int) -> dict[str, Any]:
    st = source.stat()
    return {
        "format": FORMAT,
        "source": str(source.resolve()),
        "source_size": st.st_size,
        "source_mtime_ns": st.st_mtime_ns,
        "compress": compress,
        "group": group,
    }


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors header of `path` and where its data section starts."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:
            raise ValueError(f"a header of {n} bytes")
        header = json.loads(f.read(n))
    return header, 8 + n


def _why_stale(path: Path, key: dict[str, Any], names: list[str], verify: bool) -> str | None:
    """None when the cache at `path` can be used; else why not."""
    if not path.is_file():
        return "no cache yet"
    try:
        header, start = _read_header(path)
        meta = json.loads(header["__metadata__"]["strata"])
        for k, v in key.items():
            if meta.get(k) != v:
                return f"{k} changed ({meta.get(k)!r} -> {v!r})"
        if sorted(meta.get("tensors", {})) != sorted(names):
            return "another selection of tensors"
        if verify:
            return _why_corrupt(path, header, start, meta)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        return f"unreadable ({type(e).__name__}: {e})"
    return None


def _why_corrupt(path: Path, header: dict, start: int, meta: dict) -> str | None:
    """Which blob fails its CRC32C, if one does."""
    import numpy as np

    with open(path, "rb") as f:
        for name, info in meta["tensors"].items():
            a, _ = header[name]["data_offsets"]
            f.seek(start + a)
            blob = np.fromfile(f, dtype=np.uint8, count=info["stored_bytes"])
            crc = f"{_quant.crc32c(blob):08x}"
            if len(blob) != info["stored_bytes"] or crc != info["crc32c"]:
                return f"tensor {name!r} fails its CRC32C (a corrupt cache)"
    return None


def _write(
    path: Path,
    source: Path,
    key: dict[str, Any],
    tensors: dict[str, Tensor],
    group: int,
    progress: bool,
) -> None:
    """Quantizes `tensors` (the source's, by name) into a new cache at `path` (a temporary file
    renamed over it). Holds one tensor at a time."""
    from safetensors import safe_open

    compress = key["compress"]
    names = list(tensors)
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    layout = {n: quant.layout(shapes[n], compress, group) for n in names}
    padded = {n: -(-layout[n]["bytes"] // PAGE) * PAGE for n in names}
    entries: dict[str, Any] = {}
    at = 0
    for n in names:
        entries[n] = {"dtype": "U8", "shape": [padded[n]], "data_offsets": [at, at + padded[n]]}
        at += padded[n]
    meta = dict(key)
    meta["tensors"] = {
        n: {
            "dtype": tensors[n].dtype,  # "float32", "bfloat16" or "float16", as C++ writes
            "shape": list(shapes[n]),
            "stored_bytes": layout[n]["bytes"],
            "crc32c": "00000000",  # hex, fixed width: the header keeps its length
        }
        for n in names
    }

    def header_bytes() -> bytes:
        h = json.dumps({"__metadata__": {"strata": json.dumps(meta)}, **entries}).encode()
        # Spaces pad it so the data section starts on a page (the format allows them).
        return h + b" " * (-(8 + len(h)) % PAGE)

    tmp = path.with_suffix(f".tmp{os.getpid()}")
    bar = _progress(sum(padded.values()), f"strata: compressing {source.name} to {compress}")
    try:
        with open(tmp, "wb") as out, safe_open(str(source), framework="pt") as f:
            head = header_bytes()
            out.write(struct.pack("<Q", len(head)) + head)
            present = set(f.keys())
            for n in names:
                packed = quant.quantize(_source_tensor(f, n, present), compress, group, name=n)
                meta["tensors"][n]["crc32c"] = f"{_quant.crc32c(packed):08x}"
                out.write(packed.tobytes())
                out.write(b"\0" * (padded[n] - len(packed)))
                if progress:
                    bar(padded[n])
            # The CRCs are known now: the header again, of the same length (fixed-width hex).
            head2 = header_bytes()
            assert len(head2) == len(head)
            out.seek(8)
            out.write(head2)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
        if progress:
            bar(None)


def _source_tensor(f: Any, name: str, present: set[str]) -> Any:
    """The source file's tensor `name`, or for "<tensor>[e]" (an expert's slice of a fused
    tensor, Note [Leased experts]) that slice alone, read from the file without the rest."""
    if name.endswith("]") and name not in present:
        base, e = name[:-1].rsplit("[", 1)
        return f.get_slice(base)[int(e)]
    return f.get_tensor(name)


def _progress(total: int, desc: str) -> Callable[[int | None], None]:
    """A progress bar on stderr (tqdm, which transformers brings); None closes it."""
    try:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr)
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        bar = None

    def step(n: int | None) -> None:
        if bar is None:
            return
        if n is None:
            bar.close()
        else:
            bar.update(n)

    return step


def compress_checkpoint(
    runtime: Runtime,
    tensors: Mapping[str, MappedTensor],
    select: Rule,
    *,
    compress: str,
    group: int,
    cache_dir: Path,
    verify: bool = True,
    progress: bool = True,
) -> tuple[dict[str, MappedTensor], CacheReport]:
    """`tensors` (mapped in place from their files) with those `select` picks replaced by
    compressed tensors mapped from each file's cache, built or rebuilt first when needed (Note
    [The compressed cache]). A tensor picked whose dtype cannot be compressed raises
    InvalidArgumentError naming it. The replaced tensors are destroyed."""
    if compress not in ("int8", "int4"):
        raise InvalidArgumentError(f'compress: "{compress}" is not int8, int4 or None')
    picked: dict[Path, list[str]] = {}
    for name, m in tensors.items():
        t = m.tensor
        if not select(name, tuple(t.shape), t.dtype):
            continue
        if t.dtype not in COMPRESSIBLE:
            raise InvalidArgumentError(
                f"tensor {name!r} in {str(m.path)!r} is {t.dtype}: only float32, bfloat16 and "
                "float16 tensors can be compressed (change the compress rule)"
            )
        picked.setdefault(Path(m.path), []).append(name)
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = dict(tensors)
    report = CacheReport([], [], 0, 0, 0)
    made, replaced = [], []
    try:
        for source, names in picked.items():
            names.sort()
            path = cache_path(source, cache_dir, compress, group)
            key = _key(source, compress, group)
            why = _why_stale(path, key, names, verify)
            if why is None:
                report.reused.append(str(path))
            else:
                picked_tensors = {n: tensors[n].tensor for n in names}
                _write(path, source, key, picked_tensors, group, progress)
                report.rebuilt.append((str(path), why))
            header, start = _read_header(path)
            meta = json.loads(header["__metadata__"]["strata"])
            for name in names:
                info = meta["tensors"][name]
                a, _ = header[name]["data_offsets"]
                t = runtime.map_tensor(
                    name, info["shape"], info["dtype"], path, start + a, compress, group
                )
                made.append(t)
                replaced.append(out[name].tensor)
                out[name] = MappedTensor(t, path)
                report.compressed_tensors += 1
                report.stored_bytes += info["stored_bytes"]
                report.full_bytes += t.nbytes
    except BaseException:
        for t in made:
            runtime.destroy(t)
        raise
    for t in replaced:  # the full-width mappings, now unused
        runtime.destroy(t)
    return out, report
