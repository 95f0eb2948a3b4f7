#!/usr/bin/env python3
"""A training step of a GPT-2-like model with strata.torch.optim.AdamW, its optimizer states in
memory (offload="host", a host budget that holds them) against states on NVMe four times the
host budget (offload="nvme"), both updating during backward (overlap=True); alternating, one
process each run. Prints JSON: step seconds (median) of each, their ratio, bytes moved to and
from NVMe per step, and writes the NVMe run's Chrome trace (open it in Perfetto).

  .venv/bin/python bench/zero-offload-step.py --dir /var/tmp/strata-zero --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _pybench import gpt2


def child(args: argparse.Namespace) -> dict:
    import strata.torch as st
    import torch

    model = gpt2(args.vocab, args.seq, args.hidden, args.layers)
    params = sum(p.numel() for p in model.parameters())
    state_bytes = 8 * params  # fp32 moments; fp32 CPU parameters are their own master
    if args.child == "memory":
        opt = st.optim.AdamW(
            model.parameters(), lr=1e-4, overlap=True, host_budget=state_bytes + (64 << 20)
        )
    else:
        opt = st.optim.AdamW(
            model.parameters(),
            lr=1e-4,
            overlap=True,
            offload="nvme",
            nvme_dir=args.dir,
            host_budget=state_bytes // 4 + (1 << 20),
        )
    g = torch.Generator().manual_seed(1)
    times = []
    nvme = []
    for i in range(args.steps + 1):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        before = opt.runtime.stats()["transfers"]
        t = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if i > 0:  # the first step allocates the states
            times.append(time.perf_counter() - t)
            after = opt.runtime.stats()["transfers"]
            nvme.append(
                after["bytes_nvme_to_host"]
                - before["bytes_nvme_to_host"]
                + after["bytes_host_to_nvme"]
                - before["bytes_host_to_nvme"]
            )
    if args.trace:
        opt.runtime.export_trace(args.trace)
    return {
        "kind": args.child,
        "params": params,
        "state_bytes": state_bytes,
        "host_capacity_bytes": opt.runtime.stats()["tiers"]["Host"]["capacity_bytes"],
        "step_s": statistics.median(times),
        "nvme_bytes_per_step": statistics.median(nvme),
        "updates_during_backward": opt.updates_during_backward,
        "pipeline": opt.pipeline.stats(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp/strata-zero")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", choices=["memory", "nvme"])
    ap.add_argument("--trace")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"memory": [], "nvme": []}
    trace = Path(args.dir) / "zero-offload-nvme-trace.json"
    for r in range(args.rounds):
        for kind in ["memory", "nvme"] if r % 2 == 0 else ["nvme", "memory"]:
            cmd = [sys.executable, __file__, "--child", kind]
            for k in ("dir", "layers", "hidden", "vocab", "batch", "seq", "steps"):
                cmd += [f"--{k}", str(getattr(args, k))]
            if kind == "nvme" and r == 0:
                cmd += ["--trace", str(trace)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise SystemExit(f"{kind} failed:\n{out.stderr[-3000:]}")
            runs[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r}: {kind} done", file=sys.stderr)
    mem = statistics.median(r["step_s"] for r in runs["memory"])
    nv = statistics.median(r["step_s"] for r in runs["nvme"])
    last = runs["nvme"][-1]
    print(
        json.dumps(
            {
                "params": last["params"],
                "state_bytes": last["state_bytes"],
                "nvme_host_capacity_bytes": last["host_capacity_bytes"],
                "states_over_host": round(last["state_bytes"] / last["host_capacity_bytes"], 2),
                "step_s_memory": round(mem, 4),
                "step_s_nvme": round(nv, 4),
                "nvme_over_memory": round(nv / mem, 3),
                "nvme_bytes_per_step": last["nvme_bytes_per_step"],
                "nvme_gbps_during_step": round(last["nvme_bytes_per_step"] / nv / 1e9, 3),
                "updates_during_backward": last["updates_during_backward"],
                "step_s_runs": {k: [round(r["step_s"], 4) for r in v] for k, v in runs.items()},
                "trace": str(trace),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
