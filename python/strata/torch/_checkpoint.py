"""Finding a checkpoint's safetensors files and mapping them into a Runtime, in place.

A checkpoint is a directory (``model.safetensors.index.json`` naming the shards, else
``model.safetensors``, else every ``*.safetensors`` in it), one file, or a list of files. Every
tensor is registered with ``map_tensor`` semantics: its bytes stay in the file (read with
O_DIRECT when a tier asks for them), nothing is copied to disk.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from .. import safetensors
from .._errors import CorruptDataError, InvalidArgumentError, NotFoundError
from .._runtime import Runtime, Tensor

Checkpoint = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class MappedTensor:
    """A checkpoint tensor registered with the runtime, and the file it lives in."""

    tensor: Tensor
    path: Path


def checkpoint_files(checkpoint: Checkpoint) -> list[Path]:
    """The safetensors files of `checkpoint`, each checked to exist. A shard the index names but
    the directory lacks is a NotFoundError naming the shard and a tensor it should hold."""
    if isinstance(checkpoint, (str, os.PathLike)):
        root = Path(checkpoint)
        if root.is_file():
            return [root]
        if not root.is_dir():
            raise NotFoundError(f"checkpoint {str(root)!r}: no such file or directory")
        index = root / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CorruptDataError(f"{index}: not a safetensors index ({e})") from e
            shards: dict[str, str] = {}
            for tensor_name, shard in weight_map.items():
                shards.setdefault(shard, tensor_name)
            files = []
            for shard, tensor_name in shards.items():
                path = root / shard
                if not path.is_file():
                    raise NotFoundError(
                        f"checkpoint {str(root)!r}: shard {shard!r} named by {INDEX_NAME} "
                        f"(it holds {tensor_name!r}, among others) is missing"
                    )
                files.append(path)
            return files
        if (root / SINGLE_NAME).is_file():
            return [root / SINGLE_NAME]
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise NotFoundError(
                f"checkpoint {str(root)!r}: no {INDEX_NAME}, {SINGLE_NAME} or *.safetensors file"
            )
        return files
    files = [Path(f) for f in checkpoint]
    if not files:
        raise InvalidArgumentError("checkpoint: an empty list of files")
    for f in files:
        if not f.is_file():
            raise NotFoundError(f"checkpoint file {str(f)!r}: no such file")
    return files


def map_checkpoint(runtime: Runtime, files: Sequence[Path]) -> dict[str, MappedTensor]:
    """Registers every tensor of `files` with `runtime`, in place. A name in two files is an
    InvalidArgumentError naming both. On any error the tensors already mapped are destroyed."""
    mapped: dict[str, MappedTensor] = {}
    try:
        for path in files:
            for name, tensor in safetensors.map(runtime, path).items():
                if name in mapped:
                    runtime.destroy(tensor)
                    raise InvalidArgumentError(
                        f"tensor {name!r} is in both {str(mapped[name].path)!r} and {str(path)!r}"
                    )
                mapped[name] = MappedTensor(tensor, path)
    except BaseException:
        for m in mapped.values():
            runtime.destroy(m.tensor)
        raise
    return mapped
