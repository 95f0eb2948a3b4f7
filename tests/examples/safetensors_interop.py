#!/usr/bin/env python3
"""Interop with the reference safetensors implementation (the `safetensors` Python package).

1. A model written by `safetensors.numpy.save_file` (F32 and F16 layers, unaligned offsets) is
   streamed by stream_inference; its output equals stream_inference --reference bit for bit.
   (stream_inference_numpy.py compares the output with numpy's forward pass.)
2. A model written by `stream_inference --generate` loads with `safetensors.numpy.load_file`
   with the shapes and dtypes strata wrote.

Without numpy or safetensors it exits 77 (skipped, saying why), except in CI (CI set), where a
missing dependency is a failure: mlp_numpy checks them when imported.
"""
import os
import subprocess
import sys

from mlp_numpy import np  # exits 77 (or 1 in CI) without numpy or safetensors
from safetensors.numpy import load_file, save_file

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
assert streamed.size == batch * dims[-1] and np.count_nonzero(streamed) > 0, streamed.size

generated = os.path.join(work, "gen.safetensors")
subprocess.run([binary, "--generate", generated, "--layers", "3", "--hidden", "40", "--dtype",
                "f16"], check=True, stdout=subprocess.DEVNULL)
loaded = load_file(generated)
assert sorted(loaded) == sorted(f"layers.{i}.{k}" for i in range(3) for k in ("weight", "bias"))
assert loaded["layers.2.weight"].shape == (40, 40) and loaded["layers.2.weight"].dtype == np.float16
assert loaded["layers.0.bias"].shape == (40,)
print("interop ok: safetensors.numpy files stream bit-exactly; strata's files load in safetensors")
