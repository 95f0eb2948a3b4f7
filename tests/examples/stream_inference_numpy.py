#!/usr/bin/env python3
"""stream_inference's streamed output against an independent reference: numpy.

`stream_inference --reference` shares the kernels and the safetensors parser with the streamed
path, so it proves only that streaming changes nothing. Here the weights are read by the
safetensors package (mlp_numpy.load_mlp: its Rust loader, bf16 decoded from its bit patterns
here) and the forward pass is numpy's, in float64. Models, for each of BF16, F16 and F32:
  - one written by `stream_inference --generate` (square layers), streamed with a device budget
    a fraction of the model;
  - one written by safetensors' own writer with layers of different widths, one dtype per layer.

Tolerance (Note [numpy tolerance]). The weights and biases decode exactly to float32 and to
float64, so the two computations differ only by float32 rounding in the streamed one: each
output of a layer is a sum of n products accumulated in float32. Those rounding errors behave
as independent random terms (Higham and Mary, "A new approach to probabilistic rounding error
analysis", 2019): a layer adds a relative error of order sqrt(n) * u (u = 2^-24) to the
activations, and a He-scaled layer neither amplifies nor damps an error already there, so after
L layers the norm-wise relative error is of order L * sqrt(n) * u (summing the layers' bounds,
not their random walk). TOL = 4 * L * sqrt(n) * u, with n the widest layer, is that with a
factor 4 to spare; what is measured (printed) is 40-80x below it. Its power is checked, not
assumed: for every layer, the forward pass with that layer skipped, transposed, its bias dropped,
its relu dropped (or one added after the last layer) differs from the true one by more than
100 * TOL (the smallest such difference is printed), so a streamed output computed that way would
fail the comparison by a wide margin.

Usage: stream_inference_numpy.py STREAM_INFERENCE WORKDIR
"""
import json
import os
import subprocess
import sys

from mlp_numpy import (U32, forward, load_mlp, np, relative_error, run_stream_inference,
                       save_raw, to_bf16_bits)

binary, work = sys.argv[1], sys.argv[2]
os.makedirs(work, exist_ok=True)
rng = np.random.default_rng(11)
BATCH = 5
MARGIN = 100  # every mutation must miss the true output by more than MARGIN * TOL


def tolerance(layers):
    width = max(max(w.shape) for w, _, _ in layers)
    return 4 * len(layers) * np.sqrt(width) * U32


def forward_with_relu(layers, x, relu_after):
    """The forward pass with a relu after the layers in relu_after."""
    h = np.asarray(x, dtype=np.float64)
    for i, (w, b, _) in enumerate(layers):
        h = h @ w.T + b
        if i in relu_after:
            h = np.maximum(h, 0.0)
    return h


def mistakes(layers, x):
    """(what, the output computed that way) for every mistake the comparison must catch."""
    hidden = set(range(len(layers) - 1))
    for i, (w, b, d) in enumerate(layers):
        if w.shape[0] == w.shape[1]:
            yield f"layers.{i} skipped", forward(layers[:i] + layers[i + 1:], x)
            yield f"layers.{i} transposed", forward(layers[:i] + [(w.T, b, d)] + layers[i + 1:], x)
        yield f"layers.{i} without its bias", forward(
            layers[:i] + [(w, 0 * b, d)] + layers[i + 1:], x)
        if i in hidden:
            yield f"no relu after layers.{i}", forward_with_relu(layers, x, hidden - {i})
    yield "a relu after the last layer", forward_with_relu(layers, x, hidden | {len(layers) - 1})


def check(name, model, *args):
    layers = load_mlp(model)
    x = rng.standard_normal((BATCH, layers[0][0].shape[1])).astype(np.float32)
    streamed = run_stream_inference(binary, model, x, work, "--no-measure", "--passes", "2", *args)
    ref = forward(layers, x.astype(np.float64))
    assert streamed.shape == ref.shape, f"{name}: output {streamed.shape}, expected {ref.shape}"
    assert np.count_nonzero(ref) > ref.size // 2, f"{name}: a mostly-zero output proves little"
    tol = tolerance(layers)
    err = relative_error(streamed, ref)
    assert err <= tol, f"{name}: streamed output differs from numpy by {err:.3e} > {tol:.3e}"
    least = min((relative_error(y, ref), what) for what, y in mistakes(layers, x))
    assert least[0] > MARGIN * tol, f"{name}: {least[1]} changes the output by only {least[0]:.3e}"
    print(f"{name}: relative error {err:.2e}, tolerance {tol:.2e}, smallest mistake "
          f"{least[0]:.2e} ({least[1]})")


for dtype in ("bf16", "f16", "f32"):
    model = os.path.join(work, f"gen-{dtype}.safetensors")
    subprocess.run([binary, "--generate", model, "--layers", "12", "--hidden", "128", "--dtype",
                    dtype], check=True, stdout=subprocess.DEVNULL)
    # The working buffers (about 137 KiB) and two to four of the twelve layers fit the device.
    budget = ("--device-budget", "288KiB")
    info = subprocess.run([binary, "--model", model, "--batch", str(BATCH), "--no-measure",
                           "--passes", "1", "--json", *budget], check=True, capture_output=True,
                          text=True)
    d = json.loads(info.stdout)
    assert d["model_bytes"] > d["device_budget"] >= d["peak_device_bytes"], d
    check(f"generated {dtype}", model, *budget, "--prefetch", "auto")
    check(f"generated {dtype}, no prefetch", model, *budget, "--prefetch", "none")

# Written by safetensors, widths that differ (every offset after the first unaligned), and one
# dtype per layer: every dtype meets every position.
dims = [37, 96, 96, 64, 96, 29]
for shift, dtypes in enumerate((["BF16", "F16", "F32"], ["F16", "F32", "BF16"],
                                ["F32", "BF16", "F16"])):
    tensors = {}
    for i in range(len(dims) - 1):
        dt = dtypes[i % 3]
        bound = np.sqrt(6.0 / dims[i])
        w = rng.uniform(-bound, bound, (dims[i + 1], dims[i]))
        b = rng.uniform(-0.1, 0.1, dims[i + 1])
        for name, a in ((f"layers.{i}.weight", w), (f"layers.{i}.bias", b)):
            if dt == "BF16":
                tensors[name] = (dt, to_bf16_bits(a))
            else:
                tensors[name] = (dt, a.astype(np.float32 if dt == "F32" else np.float16))
    model = os.path.join(work, f"py-{shift}.safetensors")
    save_raw(tensors, model, metadata={"writer": "safetensors.serialize"})
    check(f"safetensors-written {'/'.join(dtypes)}", model, "--device-budget", "144KiB")

print("stream_inference == numpy (float64, weights read by safetensors) for bf16, f16 and f32")
