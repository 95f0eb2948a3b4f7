#!/usr/bin/env python3
"""Training a GPT-2-like model whose parameters + gradients + optimizer states are 4x and 8x the
device budget with strata.torch.train (states on the host tier, and on NVMe), against the same
model trained in memory with torch.optim.AdamW (the bound for this machine); alternating, one
process a run. Prints JSON: tokens/s, step_s, over_memory (step_s / the in-memory step's),
compute_s (the in-memory forward + backward: the compute a step cannot hide, its update being
able to run behind backward), bytes moved per step against the least a step must move (the
working copies to the device, again for backward those the device budget cannot keep; from
NVMe the fp32 master, moments and working copies in and out once), the disk's rates measured
with strata-bench io in the same run, io_s (the NVMe bytes at those rates) and roofline =
max(compute_s, io_s) / step_s (above 1.02: a measurement error, reported untrusted). The peak
RSS of each process, and what it takes beyond the budgets and the loaded libraries.

  .venv/bin/python bench/train-larger-than-memory.py --dir /var/tmp/strata-train --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _pybench import gpt2, reset_peak_rss, status_bytes

ROOT = Path(__file__).resolve().parent.parent
MAX_ROOFLINE = 1.02


def training_bytes(model) -> int:
    """Parameters, gradients (model dtype), fp32 masters and both moments: what training holds."""
    return sum(p.numel() * (2 * p.element_size() + 12) for p in model.parameters())


def child(args: argparse.Namespace) -> dict:
    import strata.torch as st
    import torch

    torch.set_num_threads(args.threads)
    base_rss = status_bytes("VmRSS")  # torch and strata loaded, no model yet
    model = gpt2(args.vocab, args.seq, args.hidden, args.layers)
    state = training_bytes(model)
    params = sum(p.numel() for p in model.parameters())
    work_bytes = 4 * params
    if args.child.startswith("memory"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        kw = {"device_budget": state // args.ratio}
        if args.child == "nvme":
            kw.update(nvme_dir=args.dir, host_budget=state // args.ratio)
        else:
            kw.update(host_budget=state + (64 << 20))
        model, opt = st.train.offload(model, lr=1e-4, **kw)
    g = torch.Generator().manual_seed(1)
    steps, computes, moved = [], [], []
    reset_peak_rss()
    for i in range(args.steps + 1):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        before = None if args.child.startswith("memory") else opt.stats()["runtime"]["transfers"]
        t = time.perf_counter()
        model(ids, labels=ids, use_cache=False).loss.backward()
        t_backward = time.perf_counter()
        opt.step()
        opt.zero_grad()
        end = time.perf_counter()
        if i == 0:
            continue  # the first step records the schedule and touches every page
        steps.append(end - t)
        computes.append(t_backward - t)
        if before is not None:
            after = opt.stats()["runtime"]["transfers"]
            moved.append({k: after[k] - before[k] for k in after})
    out = {
        "kind": args.child,
        "params": params,
        "training_bytes": state,
        "step_s": statistics.median(steps),
        "step_s_runs": steps,
        "forward_backward_s": statistics.median(computes),
        "peak_rss_bytes": status_bytes("VmHWM"),
        "base_rss_bytes": base_rss,
    }
    if not args.child.startswith("memory"):
        stats = opt.stats()
        last = moved[len(moved) // 2]
        out.update(
            device_budget=stats["device_budget"],
            host_budget=stats["host_budget"],
            peak_device_bytes=stats["peak_device_bytes"],
            peak_host_bytes=stats["peak_host_bytes"],
            bytes_to_device=last["bytes_host_to_device"] + last["bytes_nvme_to_device"],
            nvme_bytes_read=last["bytes_nvme_to_host"] + last["bytes_nvme_to_device"],
            nvme_bytes_written=last["bytes_host_to_nvme"] + last["bytes_device_to_nvme"],
            # The least a step moves: the working copies to the device for forward, and again
            # for backward those the device budget could not keep (the budget is all a block
            # may stay on); with an NVMe home, the fp32 master and moments in and out.
            min_bytes_to_device=work_bytes + max(0, work_bytes - stats["device_budget"]),
            # From NVMe a step reads the fp32 master, moments and working copies the host tier
            # cannot keep, and writes them back.
            min_nvme_bytes=2 * max(0, 12 * params + work_bytes - stats["host_budget"])
            if args.child == "nvme"
            else 0,
            updates_during_backward=stats["updates_during_backward"],
            pipeline=stats["pipeline"],
        )
    return out


def fio_reader(directory: str) -> list[str] | None:
    """fio reading a 1 GiB file of `directory` at the disk's limit (1 MiB, 8 deep, O_DIRECT,
    io_uring) until killed: the load under which the in-memory step is timed again
    (compute_under_io_s), as bench/compute-under-io.sh does; None without fio."""
    if shutil.which("fio") is None:
        return None
    path = str(Path(directory) / "fio-read.bin")
    base = ["fio", "--name=r", f"--filename={path}", "--size=1g", "--bs=1m", "--direct=1"]
    subprocess.run([*base, "--rw=write"], capture_output=True, check=True)  # laid out once
    # --thread: the job runs as a thread of the fio process that is killed. A forked job is a
    # session of its own (setsid): killing fio's process group left it reading the disk for the
    # rest of its hour, under every later run of this bench.
    return [
        *base,
        "--rw=read",
        "--iodepth=8",
        "--ioengine=io_uring",
        "--thread",
        "--time_based",
        "--runtime=3600",
    ]


def disk_rates(directory: str) -> dict:
    """The disk's sequential read and write rates through strata-bench io (1 MiB, 8 deep)."""
    bench = ROOT / "build" / "bench" / "strata-bench"
    rates = {}
    for rw in ("write", "read"):
        cmd = [str(bench), "io", "--rw", rw, "--bs", "1MiB", "--qd", "8", "--size", "1GiB"]
        cmd += ["--path", directory, "--json"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise SystemExit(f"strata-bench io --rw {rw} failed:\n{out.stderr[-2000:]}")
        rates[rw] = json.loads(out.stdout.strip().splitlines()[-1])["mb_per_s"] / 1e3
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp/strata-train")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ratios", default="4,8", help="training bytes / device budget")
    ap.add_argument("--child", choices=["memory", "memory-io", "host", "nvme"])
    ap.add_argument("--ratio", type=int, default=4)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    rates = disk_rates(args.dir)
    reader = fio_reader(args.dir)
    kinds = (
        [("memory", 0)]
        + ([("memory-io", 0)] if reader else [])
        + [(k, int(r)) for r in args.ratios.split(",") for k in ("host", "nvme")]
    )
    runs: dict[str, list[dict]] = {f"{k}{'' if r == 0 else f'-{r}x'}": [] for k, r in kinds}
    for rnd in range(args.rounds):
        order = kinds if rnd % 2 == 0 else kinds[::-1]
        for kind, ratio in order:
            cmd = [sys.executable, __file__, "--child", kind, "--ratio", str(ratio or 4)]
            for k in ("dir", "layers", "hidden", "vocab", "batch", "seq", "steps", "threads"):
                cmd += [f"--{k}", str(getattr(args, k))]
            fio = None
            if kind == "memory-io":  # its own group, its job a thread (fio_reader): killed whole
                fio = subprocess.Popen(reader, stdout=subprocess.DEVNULL, start_new_session=True)
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            finally:
                if fio is not None:
                    os.killpg(fio.pid, signal.SIGKILL)
                    fio.wait()
                    left = subprocess.run(
                        ["pgrep", "-f", "fio-read.bin"], capture_output=True, check=False
                    )
                    if left.stdout:
                        raise SystemExit(
                            "the fio reader outlived its kill: it would race later runs"
                        )
            if out.returncode != 0:
                raise SystemExit(f"{kind} {ratio}x failed:\n{out.stderr[-3000:]}")
            name = f"{kind}{'' if ratio == 0 else f'-{ratio}x'}"
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {rnd}: {name} done", file=sys.stderr)
    mem = runs["memory"]
    memory_s = statistics.median(r["step_s"] for r in mem)
    # The compute a step cannot hide: forward and backward (the update can run behind backward,
    # as strata's does; torch's in memory runs after it).
    compute_s = statistics.median(r["forward_backward_s"] for r in mem)
    # The same compute while fio reads the disk at its limit: what perfect overlap would cost
    # on a machine whose disk reads slow its compute (this VM's, bench/compute-under-io.sh).
    under_io = runs.get("memory-io", [])
    compute_io_s = (
        statistics.median(r["forward_backward_s"] for r in under_io) if under_io else None
    )
    tokens = args.batch * args.seq
    report: dict = {
        "model": {
            "params": mem[-1]["params"],
            "training_bytes": mem[-1]["training_bytes"],
            "layers": args.layers,
            "hidden": args.hidden,
            "vocab": args.vocab,
            "tokens_per_step": tokens,
            "threads": args.threads,
        },
        "disk_gbps": rates,
        "memory": {
            "step_s": round(memory_s, 4),
            "forward_backward_s": round(compute_s, 4),
            "tokens_per_s": round(tokens / memory_s, 1),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in mem),
            # torch's own overhead: peak RSS beyond the training state and the loaded libraries
            "rss_over_state_bytes": max(
                r["peak_rss_bytes"] - r["base_rss_bytes"] - r["training_bytes"] for r in mem
            ),
            "step_s_runs": [round(s, 4) for r in mem for s in r["step_s_runs"]],
        },
    }
    if compute_io_s is not None:
        report["memory"]["compute_under_io_s"] = round(compute_io_s, 4)
        report["memory"]["compute_slowdown_under_io"] = round(compute_io_s / compute_s, 3)
    for name, rs in runs.items():
        if name.startswith("memory"):
            continue
        step_s = statistics.median(r["step_s"] for r in rs)
        last = rs[-1]
        io_s = last["nvme_bytes_read"] / (rates["read"] * 1e9) + last["nvme_bytes_written"] / (
            rates["write"] * 1e9
        )
        roofline = max(compute_s, io_s) / step_s
        trusted = roofline <= MAX_ROOFLINE
        report[name] = {
            "step_s": round(step_s, 4),
            "tokens_per_s": round(tokens / step_s, 1),
            "over_memory": round(step_s / memory_s, 3),
            "compute_s": round(compute_s, 4),
            "io_s": round(io_s, 4),
            "roofline": round(roofline, 3),
            # The step against the compute alone under a disk read at the disk's limit (a
            # reference, not a bound: fio reads more than the step does)
            "step_over_compute_under_io": None
            if compute_io_s is None or not name.startswith("nvme")
            else round(step_s / compute_io_s, 3),
            "figures_trusted": trusted,
            "warning": None
            if trusted
            else f"roofline {roofline:.3f} above {MAX_ROOFLINE}: a measurement error",
            "training_over_device_budget": round(last["training_bytes"] / last["device_budget"], 2),
            "device_budget": last["device_budget"],
            "peak_device_bytes": max(r["peak_device_bytes"] for r in rs),
            "host_budget": last["host_budget"],
            "peak_host_bytes": max(r["peak_host_bytes"] for r in rs),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rs),
            # Peak RSS beyond the budgets and what torch and strata take loaded (activations,
            # gradients on their way, the allocator's slack): the fixed overhead.
            "rss_over_budgets_bytes": max(
                r["peak_rss_bytes"] - r["base_rss_bytes"] - r["device_budget"] - r["host_budget"]
                for r in rs
            ),
            "bytes_to_device_per_step": last["bytes_to_device"],
            "min_bytes_to_device_per_step": last["min_bytes_to_device"],
            "nvme_bytes_read_per_step": last["nvme_bytes_read"],
            "nvme_bytes_written_per_step": last["nvme_bytes_written"],
            "min_nvme_bytes_per_step": last["min_nvme_bytes"],
            "updates_during_backward": last["updates_during_backward"],
            "pipeline_on_demand": last["pipeline"]["on_demand"],
            "step_s_runs": [round(s, 4) for r in rs for s in r["step_s_runs"]],
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
