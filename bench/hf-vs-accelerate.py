#!/usr/bin/env python3
"""strata.torch against accelerate's disk offload on one Hugging Face checkpoint and one budget.

Builds a random-initialised Llama checkpoint offline (from a config, save_pretrained, sharded
safetensors; once, under --dir), measures the disk's read rate with fio on it, then runs, in
alternating fresh processes:
  reference   transformers from_pretrained, the whole model in memory (the compute time)
  strata      strata.torch.load_model, device_budget + host_budget = the budget
  accelerate  from_pretrained(device_map="auto", max_memory={"cpu": budget}, offload_folder=...)
Each child times a 128-token prefill forward, a one-token decode step (with the KV cache) and
greedy generation, cold (the checkpoint's pages dropped from the page cache before the pass)
and warm (right after), after one untimed warm-up pass; it reports its peak RSS and its RSS
before loading (the fixed overhead of torch and transformers). Prints one JSON object:
per-framework medians, strata/accelerate speedups, and strata's roofline
max(compute_s, io_s) / step_s with io_s = strata's bytes read from storage in that pass over
the fastest read rate seen in the run (fio on the checkpoint's files before and after the
rounds, and strata's own passes). A roofline above 1 is a measurement error and is flagged.

  .venv/bin/python bench/hf-vs-accelerate.py --dir /var/tmp/strata-hf --rounds 3

--compress int8 int4 adds strata runs with compressed offload (load_model(compress=...): the
linear weights int8 / int4 on the slow tiers, the cache built before the timed passes, its files
dropped from the page cache with the checkpoint's), reported as strata_int8 and strata_int4. Each
pass also reports the bytes the operating system read from storage for the process
(/proc/self/io read_bytes), not only strata's own counters, and the figures compare them with
full width.

--device cuda (bench/gpu-check.sh) runs the three on the GPU: the reference moved whole to it,
strata with device="cuda" (half the budget its HBM arena, half pinned host memory), accelerate
with max_memory={0: half, "cpu": half} and the rest in its offload folder; each pass ends with
torch.cuda.synchronize() before the clock stops.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
from _pybench import (
    MemoryLimit,
    disk_gbps,
    drop_page_cache,
    os_read_bytes,
    reset_peak_rss,
    run_json_child,
    status_bytes,
)


def make_checkpoint(path: Path, args: argparse.Namespace) -> None:
    if (path / "config.json").is_file():
        return
    if not args.child:
        cmd = [sys.executable, __file__, "--child", "checkpoint", "--checkpoint", str(path)]
        for k in ("layers", "hidden", "intermediate", "heads", "vocab"):
            cmd += [f"--{k}", str(getattr(args, k))]
        subprocess.run(cmd, check=True, stdout=sys.stderr)  # stdout is the JSON's alone
        return
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = path.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="200MB")
    tmp.rename(path)


# ---- one framework in its own process ---------------------------------------------------


def child(args: argparse.Namespace) -> dict:
    base_rss = status_bytes("VmRSS")  # before torch: the interpreter
    import torch
    import transformers

    torch.manual_seed(1)
    path = Path(args.checkpoint)
    files = sorted(path.glob("*.safetensors"))
    offload = Path(args.dir) / "accelerate-offload"
    ids = torch.randint(0, args.vocab, (1, args.prefill)).to(args.device)
    import_rss = status_bytes("VmRSS")
    rt = None
    if args.child == "reference":
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.to(args.device)
    elif args.child == "strata":
        import strata.torch as st

        half = args.budget // 2
        model = st.load_model(
            path,
            device=args.device,
            device_budget=half,
            host_budget=args.budget - half,
            dtype=torch.float32,
            compress=args.compress_one,
            compress_cache=Path(args.dir) / "compressed",
        )
        rt = model.strata.runtime
    else:
        shutil.rmtree(offload, ignore_errors=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path,
            device_map="auto",
            max_memory=(
                {"cpu": args.budget}
                if args.device == "cpu"
                else {0: args.budget // 2, "cpu": args.budget - args.budget // 2}
            ),
            offload_folder=str(offload),
            dtype=torch.float32,
        )
    model.eval()
    drop_targets = files + ([offload] if offload.exists() else [])
    if args.compress_one:
        drop_targets.append(Path(args.dir) / "compressed")

    def bytes_read() -> int:
        return rt.stats()["io"]["bytes_read"] if rt is not None else 0

    def timed(fn, cold: bool) -> dict:
        how = drop_page_cache(drop_targets) if cold else None
        before, os_before = bytes_read(), os_read_bytes()
        start = time.perf_counter()
        with torch.no_grad():
            fn()
        if args.device == "cuda":
            torch.cuda.synchronize()
        s = time.perf_counter() - start
        out = {
            "s": s,
            "bytes_read": bytes_read() - before,
            "os_read_bytes": os_read_bytes() - os_before,
        }
        if how:
            out["dropped_by"] = how
        return out

    # The passes' own memory (activations, KV cache, logits) is the peak after loading over the
    # RSS once loaded: the high-water mark is reset here (clear_refs 5), after the load's own
    # transient peak (from_pretrained's copies) is kept.
    load_peak = status_bytes("VmHWM")
    reset_peak_rss()
    result: dict = {"framework": args.child, "rss_loaded_bytes": status_bytes("VmRSS")}
    with torch.no_grad():
        model(ids)  # warm-up (strata records its pipeline here)
        logits = model(ids).logits
    result["logits_checksum"] = float(logits.double().sum())

    def prefill():
        model(ids)

    cache = {}

    def start_decode():
        out = model(ids, use_cache=True)
        cache["past"] = out.past_key_values
        cache["next"] = out.logits[:, -1:].argmax(-1)

    def decode():
        out = model(cache["next"], past_key_values=cache["past"], use_cache=True)
        cache["past"] = out.past_key_values
        cache["next"] = out.logits[:, -1:].argmax(-1)

    def generate():
        cache["tokens"] = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)

    for temp in ("cold", "warm"):
        result[f"prefill_{temp}"] = timed(prefill, temp == "cold")
    with torch.no_grad():
        start_decode()
    for temp in ("cold", "warm"):
        result[f"decode_{temp}"] = timed(decode, temp == "cold")
    for temp in ("cold", "warm"):
        g = timed(generate, temp == "cold")
        g["tokens_per_s"] = args.new_tokens / g["s"]
        result[f"generate_{temp}"] = g
    result["tokens"] = cache["tokens"][0, -args.new_tokens :].tolist()
    result["rss_before_torch_bytes"] = base_rss
    result["rss_after_imports_bytes"] = import_rss
    result["peak_rss_after_load_bytes"] = status_bytes("VmHWM")
    result["peak_rss_bytes"] = max(load_peak, result["peak_rss_after_load_bytes"])
    if rt is not None:
        result["pipeline"] = model.strata.stats()["pipeline"]
    return result


# ---- the comparison ------------------------------------------------------------------------


def run_child(
    kind: str, args: argparse.Namespace, checkpoint: Path, limit_bytes: int | None = None
) -> dict:
    """One framework in a fresh process; with `limit_bytes`, inside a memory cgroup of that size
    (Note [Benchmarks under a memory limit] in _pybench.py). A child the kernel kills for memory
    is a result too: {"oom": True, ...}."""
    compress = kind.removeprefix("strata_") if kind.startswith("strata_") else None
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "strata" if compress else kind,
        *(["--compress-one", compress] if compress else []),
        "--checkpoint",
        str(checkpoint),
        "--budget",
        str(args.budget),
        "--prefill",
        str(args.prefill),
        "--new-tokens",
        str(args.new_tokens),
        "--vocab",
        str(args.vocab),
        "--dir",
        args.dir,
        "--device",
        args.device,
    ]
    result, peak = run_json_child(cmd, limit_bytes, kind)
    if result is None:
        return {"framework": kind, "oom": True, "cgroup_peak_bytes": peak}
    if peak is not None:
        result["cgroup_peak_bytes"] = peak
    return result


def median(runs: list[dict], *keys: str) -> float:
    values = []
    for r in runs:
        v = r
        for k in keys:
            v = v[k]
        values.append(v)
    return statistics.median(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp/strata-hf")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--budget-fraction", type=float, default=1 / 3)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument(
        "--memory-limit",
        choices=["both", "off", "only"],
        default="both",
        help="run strata and accelerate unconstrained (off), inside a memory cgroup of budget + "
        "the measured fixed overhead (only), or both (default)",
    )
    ap.add_argument("--child", choices=["reference", "strata", "accelerate", "checkpoint"])
    ap.add_argument("--checkpoint")
    ap.add_argument("--budget", type=int)
    ap.add_argument("--compress", nargs="*", default=[], choices=["int8", "int4"])
    ap.add_argument("--compress-one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "checkpoint":
        make_checkpoint(Path(args.checkpoint), args)
        return
    if args.child:
        print(json.dumps(child(args)))
        return

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    name = f"llama-{args.layers}x{args.hidden}-v{args.vocab}"
    checkpoint = root / name
    make_checkpoint(checkpoint, args)  # in a child: the parent stays small (no torch)
    model_bytes = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    args.budget = int(model_bytes * args.budget_fraction)
    rates = disk_gbps(checkpoint)
    strata_kinds = ["strata"] + [f"strata_{c}" for c in args.compress]
    kinds = [*strata_kinds, "accelerate"]
    ref = run_child("reference", args, checkpoint)
    # The fixed overhead a process needs beside its budget: what the in-memory reference held
    # beyond the weights at its peak during the passes (the interpreter, torch and
    # transformers, the model's skeleton, activations, KV cache, logits). Its weights are all
    # resident then (touched by the passes, mmapped or copied), so peak - model_bytes is the
    # rest. The limited runs get budget + this, page cache included.
    libraries = ref["rss_after_imports_bytes"]
    overhead = max(libraries, ref["peak_rss_after_load_bytes"] - model_bytes)
    passes_bytes = overhead - libraries
    limit_bytes = args.budget + overhead
    modes = {"off": [None], "only": [limit_bytes], "both": [None, limit_bytes]}[args.memory_limit]
    try:
        MemoryLimit(limit_bytes, "probe").close()
        limit_error = None
    except OSError as e:
        limit_error = f"not run: {e}"
        modes = [m for m in modes if m is None]
    runs: dict[object, dict[str, list[dict]]] = {m: {k: [] for k in kinds} for m in modes}
    for r in range(args.rounds):
        for m in modes:  # unconstrained and limited alternate within a round, kinds too
            order = kinds if r % 2 == 0 else kinds[::-1]
            for kind in order:
                runs[m][kind].append(run_child(kind, args, checkpoint, m))
                print(
                    f"round {r}: {kind} {'limited' if m else 'unconstrained'} done", file=sys.stderr
                )
    rates += disk_gbps(checkpoint)
    if None in runs:
        # The roofline's io time uses the fastest read rate seen in the run, fio's or strata's
        # own in any pass (this VM's disk drifts between 0.8 and 2 GB/s, and strata's many
        # concurrent reads have beaten fio's): the most favourable bound for the disk, so the
        # least favourable roofline for strata, and never one above 1 from a slow fio minute.
        achieved = [
            r[f"{phase}_{temp}"]["bytes_read"] / r[f"{phase}_{temp}"]["s"] / 1e9
            for r in runs[None]["strata"]
            for phase in ("prefill", "decode")
            for temp in ("cold", "warm")
        ]
    else:
        achieved = []
    gbps = max(rates + achieved) if rates or achieved else 0.0

    out: dict = {
        "checkpoint": str(checkpoint),
        "model_bytes": model_bytes,
        "budget_bytes": args.budget,
        "strata_device_budget_bytes": args.budget // 2,
        "strata_host_budget_bytes": args.budget - args.budget // 2,
        "disk_read_gbps": round(gbps, 3),
        "disk_read_gbps_fio_runs": [round(x, 3) for x in rates],
        "prefill_tokens": args.prefill,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "cpu_count": os.cpu_count(),
        "device": args.device,
        "reference_in_memory": {
            "prefill_s": ref["prefill_warm"]["s"],
            "decode_s": ref["decode_warm"]["s"],
            "generate_tokens_per_s": ref["generate_warm"]["tokens_per_s"],
            "peak_rss_bytes": ref["peak_rss_bytes"],
        },
        "fixed_overhead_bytes": overhead,
        "fixed_overhead_parts": {"libraries": libraries, "skeleton_and_passes": passes_bytes},
    }
    if None in runs:
        out.update(figures(runs[None], kinds, strata_kinds, ref, gbps, args))
    if limit_bytes in runs:
        limited = figures(runs[limit_bytes], kinds, strata_kinds, ref, gbps, args)
        limited["limit_bytes"] = limit_bytes
        limited["limit"] = (
            "budget + fixed_overhead_bytes, page cache included (Note [Benchmarks under a "
            "memory limit] in bench/_pybench.py)"
        )
        out["memory_limited"] = limited
    elif args.memory_limit != "off":
        out["memory_limited"] = limit_error
    print(json.dumps(out, indent=1))


def figures(
    runs: dict[str, list[dict]],
    kinds: list[str],
    strata_kinds: list[str],
    ref: dict,
    gbps: float,
    args: argparse.Namespace,
) -> dict:
    """Per-framework medians, strata's speedups over accelerate, its roofline and the compressed
    runs against full width, for one set of runs (unconstrained or under the memory limit)."""
    out: dict = {}
    for kind in kinds:
        rs = [r for r in runs[kind] if not r.get("oom")]
        ooms = len(runs[kind]) - len(rs)
        if not rs:
            out[kind] = {"oom_kills": ooms, "figures": "every run was killed for memory"}
            continue
        fig: dict = {"oom_kills": ooms}
        for phase in ("prefill", "decode"):
            for temp in ("cold", "warm"):
                fig[f"{phase}_{temp}_s"] = median(rs, f"{phase}_{temp}", "s")
                fig[f"{phase}_{temp}_os_read_bytes"] = median(
                    rs, f"{phase}_{temp}", "os_read_bytes"
                )
        for temp in ("cold", "warm"):
            fig[f"generate_{temp}_tokens_per_s"] = median(rs, f"generate_{temp}", "tokens_per_s")
        fig["peak_rss_bytes"] = median(rs, "peak_rss_bytes")
        if "cgroup_peak_bytes" in rs[0]:
            fig["cgroup_peak_bytes"] = median(rs, "cgroup_peak_bytes")
        fig["rss_after_imports_bytes"] = median(rs, "rss_after_imports_bytes")
        fig["same_logits_as_reference"] = all(
            r["logits_checksum"] == ref["logits_checksum"] for r in rs
        )
        fig["same_tokens_as_reference"] = all(r["tokens"] == ref["tokens"] for r in rs)
        out[kind] = fig
    s, a = out["strata"], out["accelerate"]
    if "prefill_cold_s" not in s or "prefill_cold_s" not in a:
        out["speedup_strata_over_accelerate"] = "not comparable: a side was killed for memory"
        return out
    out["speedup_strata_over_accelerate"] = {
        k: round(a[f"{k}_s"] / s[f"{k}_s"], 3)
        for k in ("prefill_cold", "prefill_warm", "decode_cold", "decode_warm")
    }
    for temp in ("cold", "warm"):
        out["speedup_strata_over_accelerate"][f"generate_{temp}"] = round(
            s[f"generate_{temp}_tokens_per_s"] / a[f"generate_{temp}_tokens_per_s"], 3
        )
    # strata's roofline per pass: max(compute, io) / step, io = bytes read / disk rate.
    roof = {}
    for phase in ("prefill", "decode"):
        for temp in ("cold", "warm"):
            rs = [r for r in runs["strata"] if not r.get("oom")]
            step = median(rs, f"{phase}_{temp}", "s")
            io_s = median(rs, f"{phase}_{temp}", "bytes_read") / (gbps * 1e9) if gbps else 0.0
            compute = ref[f"{phase}_warm"]["s"]
            read = median(rs, f"{phase}_{temp}", "bytes_read")
            r = {
                "roofline": round(max(compute, io_s) / step, 3),
                "achieved_read_gbps": round(read / step / 1e9, 3),
                "compute_s": round(compute, 4),
                "io_s": round(io_s, 4),
                "step_s": round(step, 4),
                "bytes_read": read,
                "figures_trusted": True,
            }
            if r["roofline"] > 1.0:
                r["figures_trusted"] = False
                r["warning"] = (
                    f"{phase} {temp}: roofline above 1: a measurement error, not a result"
                )
                print(f"hf-vs-accelerate: warning: {r['warning']}", file=sys.stderr)
            roof[f"{phase}_{temp}"] = r
    out["strata_roofline"] = roof
    # Compressed offload against full width, same budget: the bytes the OS read per pass and
    # the time per pass (decode: one token, the I/O-bound regime).
    for c in args.compress:
        k = f"strata_{c}"
        if "prefill_cold_s" not in out[k]:
            continue
        cmp = {}
        for phase in ("prefill", "decode"):
            for temp in ("cold", "warm"):
                full_b = s[f"{phase}_{temp}_os_read_bytes"]
                cmp[f"{phase}_{temp}_os_read_vs_full"] = (
                    round(out[k][f"{phase}_{temp}_os_read_bytes"] / full_b, 3) if full_b else None
                )
                cmp[f"{phase}_{temp}_speedup_vs_full"] = round(
                    s[f"{phase}_{temp}_s"] / out[k][f"{phase}_{temp}_s"], 3
                )
                cmp[f"{phase}_{temp}_speedup_vs_accelerate"] = round(
                    a[f"{phase}_{temp}_s"] / out[k][f"{phase}_{temp}_s"], 3
                )
        out[f"{k}_vs_full"] = cmp
    out["strata_rss_over_budget_bytes"] = s["peak_rss_bytes"] - args.budget
    out["strata_fixed_overhead_bytes"] = s["rss_after_imports_bytes"]
    return out


if __name__ == "__main__":
    main()
