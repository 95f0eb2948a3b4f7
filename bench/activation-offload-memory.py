#!/usr/bin/env python3
"""Peak memory of a training step with and without strata.torch.offload_activations: a
GPT-2-like model's forward and backward on the host backend, saved activations of 1 MiB and
more sent to NVMe, each variant in fresh processes, alternating. Prints JSON: peak RSS (VmHWM)
of each, the saved bytes offloaded, their difference, and step seconds.

On the host backend the "device" is the CPU: the activations torch keeps for backward are
process memory, and offloading them to NVMe takes them out of it until backward reads them.

  .venv/bin/python bench/activation-offload-memory.py --dir /var/tmp/strata-act --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _pybench import gpt2, status_bytes


def child(args: argparse.Namespace) -> dict:
    import strata
    import strata.torch as st
    import torch

    model = gpt2(args.vocab, args.seq, args.hidden, args.layers)
    # The host tier holds the activations backward reads (up to 128 MiB at once here).
    rt = strata.Runtime(
        {
            "backend": "host",
            "device_budget": "16MiB",
            "host_budget": "256MiB",
            "quiet": True,
            "host_copy_on_the_way": False,
            "nvme": {"paths": [args.dir], "capacity": "8GiB"},
        }
    )
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    before = status_bytes("VmHWM")
    t = time.perf_counter()
    offloaded = 0
    if args.child == "offload":
        with st.offload_activations(rt, min_bytes="1MiB", tier=strata.Tier.NVME) as saved:
            loss = model(ids, labels=ids).loss
        offloaded = saved.offloaded_bytes
    else:
        loss = model(ids, labels=ids).loss
    loss.backward()
    return {
        "kind": args.child,
        "step_s": time.perf_counter() - t,
        "peak_rss_bytes": status_bytes("VmHWM"),
        "rss_before_step_bytes": before,
        "offloaded_bytes": offloaded,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp/strata-act")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", choices=["plain", "offload"])
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"plain": [], "offload": []}
    for r in range(args.rounds):
        for kind in ["plain", "offload"] if r % 2 == 0 else ["offload", "plain"]:
            cmd = [sys.executable, __file__, "--child", kind]
            for k in ("dir", "layers", "hidden", "vocab", "batch", "seq"):
                cmd += [f"--{k}", str(getattr(args, k))]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise SystemExit(f"{kind} failed:\n{out.stderr[-3000:]}")
            runs[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    print(
        json.dumps(
            {
                "model": f"GPT-2 {args.layers} x {args.hidden}, batch {args.batch} x {args.seq}",
                "peak_rss_plain_bytes": med("plain", "peak_rss_bytes"),
                "peak_rss_offload_bytes": med("offload", "peak_rss_bytes"),
                "peak_rss_saved_bytes": med("plain", "peak_rss_bytes")
                - med("offload", "peak_rss_bytes"),
                "activations_offloaded_bytes": med("offload", "offloaded_bytes"),
                "step_s_plain": round(med("plain", "step_s"), 3),
                "step_s_offload": round(med("offload", "step_s"), 3),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
