#!/usr/bin/env python3
"""Writes the fuzzer's seed corpus (tests/fuzz/corpus/seed-*): one small safetensors image per
part of the format's grammar, so that libFuzzer starts from inputs that reach each branch of the
parser (every dtype spelling, the known-but-refused ones, scalars and empty tensors, metadata,
escapes, padding) and from each class of malformed file the parser must name (offsets that gap,
overlap or overrun, a size that disagrees with dtype and shape, a header longer than the file,
a header that is not an object, duplicate names, negative or overflowing dimensions).

usage: tests/fuzz/make_seeds.py [DIR]   (default: tests/fuzz/corpus beside this script)
The files are committed; run it again after changing it. tests/fuzz/corpus/grown holds what
the fuzzer grew from them (90 s, merged to the inputs that add coverage: 885 files, coverage
1775 edges at start against 1282 from the seeds alone and 684 from the first five); refresh it
with `safetensors_fuzz -merge=1 tests/fuzz/corpus/grown build-fuzz/corpus`.
"""

import json
import struct
import sys
from pathlib import Path

SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
REFUSED = [
    "U16",
    "U32",
    "U64",
    "F8_E4M3",
    "F8_E5M2",
    "F8_E8M0",
    "F6_E2M3",
    "F6_E3M2",
    "F4",
    "C64",
    "C128",
]


def image(header: str, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header.encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def tensors(spec: dict, pad_to: int = 1) -> bytes:
    """A well-formed image of `spec` {name: (dtype, shape)}, tensors tiled in order."""
    header, offset = {}, 0
    for name, (dtype, shape) in spec.items():
        n = SIZES.get(dtype, 1)
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":"))
    text += " " * (-len(text) % pad_to)
    return image(text, bytes(range(256)) * (offset // 256) + bytes(offset % 256))


def seeds() -> dict[str, bytes]:
    out = {}
    for dtype in SIZES:
        out[f"dtype-{dtype}"] = tensors({"t": (dtype, [2, 3])})
    for dtype in REFUSED:
        out[f"refused-{dtype}"] = image(
            json.dumps({"t": {"dtype": dtype, "shape": [2], "data_offsets": [0, 2]}}), bytes(2)
        )
    out["scalar"] = tensors({"s": ("F32", [])})
    out["zero-dim"] = tensors({"z": ("F32", [4, 0]), "w": ("F16", [2])})
    out["padded-header"] = tensors({"w": ("F32", [3])}, pad_to=8)
    out["metadata-many"] = image(
        json.dumps(
            {
                "__metadata__": {"format": "pt", "a": "1", "empty": ""},
                "w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
            }
        ),
        b"\x07",
    )
    out["escaped-names"] = image(
        '{"a\\"b\\\\c\\u00e9\\n": {"dtype":"I8","shape":[1],"data_offsets":[0,1]}}', b"\x01"
    )
    out["whitespace"] = image(
        ' {\n "w" : { "dtype" : "I16" , "shape" : [ 1 , 1 ] , "data_offsets" : [ 0 , 2 ] } }\t',
        bytes(2),
    )
    out["keys-reordered"] = image(
        '{"w":{"data_offsets":[0,4],"shape":[1],"dtype":"F32"}}', bytes(4)
    )
    out["many-tensors"] = tensors({f"layers.{i}.weight": ("BF16", [i + 1]) for i in range(12)})
    # Malformed: each must be a named error, never an accepted file or a crash.
    w = '"dtype":"F32","shape":[2]'
    out["bad-gap"] = image(
        '{"a":{%s,"data_offsets":[0,8]},"b":{%s,"data_offsets":[12,20]}}' % (w, w), bytes(20)
    )
    out["bad-overlap"] = image(
        '{"a":{%s,"data_offsets":[0,8]},"b":{%s,"data_offsets":[4,12]}}' % (w, w), bytes(12)
    )
    out["bad-overrun"] = image('{"a":{%s,"data_offsets":[0,8]}}' % w, bytes(4))
    out["bad-size"] = image('{"a":{%s,"data_offsets":[0,12]}}' % w, bytes(12))
    out["bad-reversed"] = image('{"a":{%s,"data_offsets":[8,0]}}' % w, bytes(8))
    out["bad-header-length"] = image('{"a":{%s,"data_offsets":[0,8]}}' % w, bytes(8), 1 << 40)
    out["bad-short-length"] = struct.pack("<Q", 5)[:6]
    out["bad-not-object"] = image("[1,2,3]")
    out["bad-duplicate"] = image(
        '{"a":{%s,"data_offsets":[0,8]},"a":{%s,"data_offsets":[8,16]}}' % (w, w), bytes(16)
    )
    out["bad-negative-dim"] = image(
        '{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}', bytes(4)
    )
    out["bad-overflow-dims"] = image(
        '{"a":{"dtype":"F64","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}}', bytes(8)
    )
    out["bad-unknown-dtype"] = image('{"a":{"dtype":"F3","shape":[1],"data_offsets":[0,1]}}', b"x")
    out["bad-extra-field"] = image(
        '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}}', b"x"
    )
    out["bad-metadata-value"] = image(
        '{"__metadata__":{"n":1},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x"
    )
    out["bad-truncated-json"] = image('{"a":{"dtype":"U8","shape":[1],"data_off')
    return out


def main() -> None:
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "corpus"
    target.mkdir(parents=True, exist_ok=True)
    for name, data in seeds().items():
        (target / f"seed-{name}").write_bytes(data)
    print(f"wrote {len(seeds())} seeds to {target}")


if __name__ == "__main__":
    main()
