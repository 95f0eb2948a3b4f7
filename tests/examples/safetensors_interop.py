#!/usr/bin/env python3
"""Interop with the reference safetensors implementation (the `safetensors` Python package).

1. A model written by `safetensors.numpy.save_file` (F32 and F16 layers, unaligned offsets) is
   streamed by stream_inference; its output equals stream_inference --reference bit for bit and
   numpy's own forward pass to float32 rounding.
2. A model written by `stream_inference --generate` loads with `safetensors.numpy.load_file`
   with the shapes and dtypes strata wrote.

Without numpy or safetensors it exits 77 (skipped, saying why), except in CI (CI set), where a
missing dependency is a failure: scripts/install-deps.sh installs both.
"""
import os
import subprocess
import sys

try:
    import numpy as np
    from safetensors.numpy import load_file, save_file
except ImportError as e:  # pragma: no cover
    if os.environ.get("CI"):
        print(f"FAIL: {e}: CI must have numpy and safetensors (scripts/install-deps.sh)")
        sys.exit(1)
    print(f"SKIP: {e} (scripts/install-deps.sh installs numpy and safetensors into .venv)")
    sys.exit(77)

binary, work = sys.argv[1], sys.argv[2]
os.makedirs(work, exist_ok=True)
rng = np.random.default_rng(3)
dims = [37, 64, 51, 20]  # odd sizes: every tensor after the first is at an unaligned offset
tensors = {}
for i in range(len(dims) - 1):
    dtype = np.float16 if i % 2 else np.float32
    tensors[f"layers.{i}.weight"] = (rng.standard_normal((dims[i + 1], dims[i])) * 0.2).astype(dtype)
    tensors[f"layers.{i}.bias"] = (rng.standard_normal(dims[i + 1]) * 0.1).astype(dtype)
model = os.path.join(work, "py.safetensors")
save_file(tensors, model, metadata={"writer": "safetensors.numpy"})

batch = 6
x = rng.standard_normal((batch, dims[0])).astype(np.float32)
x.tofile(os.path.join(work, "x.bin"))


def run(*args):
    subprocess.run([binary, "--model", model, "--input", os.path.join(work, "x.bin"), *args],
                   check=True, stdout=subprocess.DEVNULL)


run("--output", os.path.join(work, "s.bin"), "--device-budget", "96KiB", "--no-measure",
    "--passes", "1")
run("--output", os.path.join(work, "r.bin"), "--reference")
streamed = np.fromfile(os.path.join(work, "s.bin"), dtype=np.float32)
reference = np.fromfile(os.path.join(work, "r.bin"), dtype=np.float32)
assert streamed.tobytes() == reference.tobytes(), "streamed != reference"

h = x
for i in range(len(dims) - 1):
    w = tensors[f"layers.{i}.weight"].astype(np.float32)
    b = tensors[f"layers.{i}.bias"].astype(np.float32)
    h = h @ w.T + b
    if i + 1 < len(dims) - 1:
        h = np.maximum(h, 0)
assert np.allclose(streamed.reshape(batch, -1), h, rtol=1e-4, atol=1e-5), "differs from numpy"

generated = os.path.join(work, "gen.safetensors")
subprocess.run([binary, "--generate", generated, "--layers", "3", "--hidden", "40", "--dtype",
                "f16"], check=True, stdout=subprocess.DEVNULL)
loaded = load_file(generated)
assert sorted(loaded) == sorted(f"layers.{i}.{k}" for i in range(3) for k in ("weight", "bias"))
assert loaded["layers.2.weight"].shape == (40, 40) and loaded["layers.2.weight"].dtype == np.float16
assert loaded["layers.0.bias"].shape == (40,)
print("interop ok: safetensors.numpy files stream bit-exactly; strata's files load in safetensors")
