#!/usr/bin/env python3
"""Optimizer step throughput: strata.torch.optim.AdamW (offload="host") against torch's own
AdamW (fused=True, its fastest on CPU, and foreach=True) and DeepSpeedCPUAdam when deepspeed is
installed, on the same fp32 parameters and gradients, alternating, in one process.

Prints one JSON object per size: milliseconds per step (median) and parameters per second for
each, strata's ratio to each peer, and the memory traffic each step moves against strata-bench
adam's same-traffic baseline on this machine (a figure above that bound is a measurement
error, flagged).

  .venv/bin/python bench/optim-vs-torch.py --sizes 64M 256M --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import _pybench  # noqa: F401 (sets the path to the package)
import torch


def parse_count(s: str) -> int:
    units = {"K": 10**3, "M": 2**20, "G": 2**30}
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def bound_gbps(n: int, threads: int) -> float:
    """The memory traffic an Adam step can reach here: strata-bench adam's baseline, a
    streaming pass that reads and writes the same arrays as Adam (p, g, m, v in; p, m, v out)
    with no arithmetic, on n parameters and the same threads. 0 when the C++ bench is not
    built."""
    bench = Path(__file__).resolve().parent.parent / "build" / "bench" / "strata-bench"
    if not bench.exists():
        return 0.0
    out = subprocess.run(
        [
            str(bench),
            "adam",
            "--json",
            "--params",
            str(n),
            "--grad",
            "f32",
            "--copy",
            "none",
            "--threads",
            str(threads),
            "--iters",
            "5",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["baseline_bytes_per_s"] / 1e9


def make(n: int, tensors: int, seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(tensors):
        p = torch.nn.Parameter(torch.randn(n // tensors, generator=g))
        p.grad = torch.randn(n // tensors, generator=g)
        params.append(p)
    return params


def timed(opt, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["64M", "256M"])
    ap.add_argument("--tensors", type=int, default=16, help="parameters per model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import strata.torch as st

    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # noqa: BLE001 (reported in the output)
        DeepSpeedCPUAdam = None
        deepspeed_missing = f"{type(e).__name__}: {e}"[:200]
    results = []
    for size in args.sizes:
        n = parse_count(size)
        bw = bound_gbps(n, args.threads)
        kw = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
        kinds = ["strata", "torch_fused", "torch_foreach"]
        if DeepSpeedCPUAdam is not None:
            kinds.append("deepspeed_cpu_adam")

        def build(kind: str, params: list, n: int = n, kw: dict = kw):
            if kind == "strata":
                return st.optim.AdamW(params, host_budget=int(3 * 4 * n * 1.1) + (64 << 20), **kw)
            if kind == "torch_fused":
                return torch.optim.AdamW(params, fused=True, **kw)
            if kind == "torch_foreach":
                return torch.optim.AdamW(params, foreach=True, **kw)
            return DeepSpeedCPUAdam(params, adamw_mode=True, **kw)

        makers = {k: (lambda p, k=k: build(k, p)) for k in kinds}
        times: dict[str, list[float]] = {k: [] for k in makers}
        opts = {k: make_opt(make(n, args.tensors, 0)) for k, make_opt in makers.items()}
        for opt in opts.values():
            opt.step()  # states allocated, kernels warm
        for r in range(args.rounds):
            order = list(opts) if r % 2 == 0 else list(reversed(list(opts)))
            for k in order:
                times[k] += timed(opts[k], args.steps)
        del opts
        bw = max(bw, bound_gbps(n, args.threads))  # before and after: the VM drifts
        row: dict = {"params": n, "threads": args.threads, "bound_gbps": round(bw, 2)}
        # Bytes each step must move per parameter: Adam reads p, g, m, v and writes p, m, v
        # (28 for all four; strata's fp32 CPU parameters are their own master copy).
        traffic = {"strata": 28, "torch_fused": 28, "torch_foreach": 28, "deepspeed_cpu_adam": 28}
        for k, ts in times.items():
            ms = statistics.median(ts) * 1e3
            entry = {
                "ms_per_step": round(ms, 2),
                "params_per_s": round(n / (ms / 1e3)),
                "traffic_gbps": round(traffic[k] * n / (ms / 1e3) / 1e9, 2),
            }
            if bw and entry["traffic_gbps"] > bw * 1.05:
                entry["error"] = "above the same-traffic baseline: a measurement error"
            row[k] = entry
        for k in times:
            if k != "strata":
                row[f"strata_speedup_over_{k}"] = round(
                    row[k]["ms_per_step"] / row["strata"]["ms_per_step"], 3
                )
        if DeepSpeedCPUAdam is None:
            row["deepspeed_cpu_adam"] = f"not run: {deepspeed_missing}"
        results.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
