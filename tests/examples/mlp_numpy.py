"""The stream_inference MLP computed in numpy, independently of strata, for the example's tests.

Weights are read with the safetensors package's own loader (`safetensors.deserialize`, the Rust
implementation: raw bytes, dtype and shape per tensor), never with strata's parser, and decoded
here: F32 and F16 through numpy's IEEE types, BF16 from its bit patterns (the upper half of an
f32). The forward pass is float64: y = relu(x W^T + b) after every layer but the last.

Importing this module checks the dependencies: without numpy or safetensors it exits 77 (the
test is skipped, saying why), except in CI (the environment variable CI set), where a missing
dependency is a failure (exit 1): scripts/install-deps.sh installs both.
"""
import os
import subprocess
import sys

try:
    import numpy as np
    import safetensors
    from safetensors import TensorSpec
except ImportError as e:  # pragma: no cover
    if os.environ.get("CI"):
        print(f"FAIL: {e}: CI must have numpy and safetensors (scripts/install-deps.sh)")
        sys.exit(1)
    print(f"SKIP: {e} (scripts/install-deps.sh installs numpy and safetensors into .venv)")
    sys.exit(77)

U32 = 2.0**-24  # the unit roundoff of float32


def bf16_bits_to_f32(bits):
    """uint16 bf16 bit patterns as float32: the same bits in the upper half of an f32."""
    return (bits.astype("<u4") << 16).view("<f4")


def decode(dtype, data, shape):
    """A safetensors tensor's bytes as a float64 array (exact: every F32/F16/BF16 fits)."""
    if dtype == "F32":
        a = np.frombuffer(data, dtype="<f4")
    elif dtype == "F16":
        a = np.frombuffer(data, dtype="<f2")
    elif dtype == "BF16":
        a = bf16_bits_to_f32(np.frombuffer(data, dtype="<u2"))
    else:
        raise ValueError(f"unsupported dtype {dtype}")
    return a.astype(np.float64).reshape(shape)


def load_mlp(path):
    """[(W [out, in], b [out], weight dtype)] for layers.0 .. layers.L-1, read by safetensors."""
    with open(path, "rb") as f:
        tensors = {name: t for name, t in safetensors.deserialize(f.read())}
    layers = []
    while f"layers.{len(layers)}.weight" in tensors:
        w = tensors[f"layers.{len(layers)}.weight"]
        b = tensors[f"layers.{len(layers)}.bias"]
        layers.append((decode(w["dtype"], w["data"], w["shape"]),
                       decode(b["dtype"], b["data"], b["shape"]), w["dtype"]))
    assert layers, f"{path}: no layers.0.weight"
    return layers


def forward(layers, x):
    """The MLP in float64: x [batch, in] -> [batch, out]."""
    h = np.asarray(x, dtype=np.float64)
    for i, (w, b, _) in enumerate(layers):
        h = h @ w.T + b
        if i + 1 < len(layers):
            h = np.maximum(h, 0.0)
    return h


def save_raw(tensors, path, metadata=None):
    """Writes {name: (safetensors dtype name, array of the raw values)} with safetensors' own
    writer; BF16 tensors are given as uint16 bit patterns (numpy has no bfloat16)."""
    names = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
    keep = {}
    specs = {}
    for name, (dtype, a) in tensors.items():
        a = np.ascontiguousarray(a)
        keep[name] = a
        specs[name] = TensorSpec(dtype=names[dtype], shape=list(a.shape),
                                 data_ptr=a.ctypes.data, data_len=a.nbytes)
    data = safetensors.serialize(specs, metadata=metadata)
    with open(path, "wb") as f:
        f.write(bytes(data))


def to_bf16_bits(a):
    """float -> bf16 bit patterns, rounding to nearest even (NaN-free inputs)."""
    u = np.asarray(a, dtype=np.float32).view("<u4").astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def run_stream_inference(binary, model, x, work, *args):
    """Runs the example on input x (float32 [batch, in]); returns its output [batch, out]."""
    inp, out = os.path.join(work, "x.bin"), os.path.join(work, "y.bin")
    np.asarray(x, dtype="<f4").tofile(inp)
    subprocess.run([binary, "--model", model, "--input", inp, "--output", out, *args],
                   check=True, stdout=subprocess.DEVNULL)
    y = np.fromfile(out, dtype="<f4")
    assert y.size % x.shape[0] == 0, (y.size, x.shape)
    return y.reshape(x.shape[0], -1)


def relative_error(y, ref):
    """||y - ref||_2 / ||ref||_2 over every element."""
    return float(np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref))
