#!/usr/bin/env python3
"""ZeRO across ranks (strata.torch.optim partition=True) at N = 1, 2 and 4 ranks on this machine:
per rank, the optimizer states it holds, its peak RSS, its step time, and the bytes it moved a
step against the formula of docs/zero-across-ranks.md.

Each N is one `torchrun --standalone` on gloo (CPU). The model is an MLP of `--layers` square
layers (`--width`), the same on every rank; each rank's host budget is sized to its shard of
the states (12 bytes a parameter / N, plus 16 MiB), with offload="host", so its RSS is its
shard plus a fixed part (the interpreter, torch, the model, its gradients and the buckets);
`--offload nvme` puts the states in each rank's own directory instead. Prints one JSON object.

  .venv/bin/python bench/zero-ranks.py --ranks 1 2 4 --width 2048 --layers 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
from _pybench import status_bytes


def child(args: argparse.Namespace) -> None:
    import strata.torch as st
    import torch
    import torch.distributed as dist

    base_rss = status_bytes("VmRSS")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    model = torch.nn.Sequential(*layers)
    params = sum(p.numel() for p in model.parameters())
    states = 12 * params // world
    # The host tier holds the shard (pieces page-aligned) beside the staging slots.
    kw = {"offload": args.offload, "partition": True, "host_budget": states * 5 // 4 + (32 << 20)}
    if args.offload == "nvme":
        kw["nvme_dir"] = tempfile.mkdtemp(prefix=f"rank{rank}-", dir=args.dir)
        kw["host_budget"] = 64 << 20
    opt = st.optim.AdamW(model.parameters(), lr=1e-4, **kw)
    import_rss = status_bytes("VmRSS")
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    times = []
    for step in range(args.steps + 1):  # the first is a warm-up (first touches)
        dist.barrier()
        start = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step > 0:
            times.append(time.perf_counter() - start)
        if step == 0:
            s0 = opt.runtime.stats()
    s1 = opt.runtime.stats()
    moved = {
        k: (s1["transfers"][k] - s0["transfers"][k]) / args.steps
        for k in ("bytes_host_to_nvme", "bytes_nvme_to_host")
    }
    out = {
        "rank": rank,
        "world": world,
        "params": params,
        "offloaded_elements": opt._zero.offloaded_elements,
        "offloaded_state_bytes": 12 * opt._zero.offloaded_elements,
        "host_budget": kw["host_budget"],
        "rss_before_torch_bytes": base_rss,
        "rss_after_setup_bytes": import_rss,
        "peak_rss_bytes": status_bytes("VmHWM"),
        "step_s": statistics.median(times),
        "nvme_bytes_per_step": moved["bytes_host_to_nvme"] + moved["bytes_nvme_to_host"],
    }
    Path(args.dir, f"rank{rank}.json").write_text(json.dumps(out))
    opt.close()
    dist.destroy_process_group()
    # torch 2.15 on gloo can abort at the interpreter's exit (torch issue 190489; see
    # exit_now() in tests/python/zero_worker.py): the figures are written, leave without it.
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--offload", choices=["host", "nvme"], default="host")
    ap.add_argument("--dir", default="/var/tmp/strata-zero-ranks")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    results = {}
    for n in args.ranks:
        run_dir = Path(args.dir) / f"n{n}"
        run_dir.mkdir(parents=True, exist_ok=True)
        for f in run_dir.glob("rank*.json"):
            f.unlink()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(n),
            __file__,
            "--child",
            "--dir",
            str(run_dir),
        ]
        for k in ("width", "layers", "batch", "steps", "offload"):
            cmd += [f"--{k}", str(getattr(args, k))]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if out.returncode != 0:
            raise SystemExit(f"N={n} failed:\n{out.stderr[-3000:]}")
        ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(n)]
        params = ranks[0]["params"]
        results[str(n)] = {
            "offloaded_state_bytes_per_rank": [r["offloaded_state_bytes"] for r in ranks],
            "offloaded_fraction_of_whole": [
                round(r["offloaded_state_bytes"] / (12 * params), 4) for r in ranks
            ],
            "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
            "step_s_per_rank": [round(r["step_s"], 4) for r in ranks],
            "nvme_bytes_per_step_per_rank": [r["nvme_bytes_per_step"] for r in ranks],
            # docs/zero-across-ranks.md: the collectives' bytes in and out of a rank.
            "collective_bytes_per_step_formula": int(2 * 2 * (n - 1) / n * 4 * params),
            "state_bytes_per_step_formula_if_on_nvme": int(2 * 12 * params / n),
        }
    out = {
        "params": params,
        "offload": args.offload,
        "width": args.width,
        "layers": args.layers,
        "batch": args.batch,
        "cpu_count": os.cpu_count(),
        "ranks": results,
        # Peak RSS less the rank's shard of the states: the fixed part, the same at every N
        # when RSS falls as 1/N.
        "rss_minus_shard_bytes": {
            k: [
                r - s
                for r, s in zip(v["peak_rss_bytes_per_rank"], v["offloaded_state_bytes_per_rank"])
            ]
            for k, v in results.items()
        },
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
