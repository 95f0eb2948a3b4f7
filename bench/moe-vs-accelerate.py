#!/usr/bin/env python3
"""strata.torch against accelerate's disk offload on a mixture-of-experts model a quarter of which
fits the memory given to each.

Builds a random-initialised Qwen3-MoE-like checkpoint offline once under --dir (from a config,
save_pretrained: per-expert safetensors tensors, about 1.5 GB at the defaults: 8 layers of 48
experts, top-8), then runs in alternating fresh processes:
  reference     transformers from_pretrained, the whole model in memory (eager experts)
  strata        strata.torch.load_model, device_budget + host_budget = the budget, experts
                leased one by one (Note [Leased experts])
  strata_whole  the same with experts="whole": each layer leased with all its experts (what
                load_model did before; the prefill is compared with it)
  accelerate    from_pretrained(device_map="auto", max_memory={"cpu": budget}, offload_folder)
Each child times a 128-token prefill, then decode tokens one at a time with the KV cache: cold
(before each token the checkpoint's pages are dropped from the page cache and, for strata, its
tiers emptied: Offloaded.drop_caches) and warm (tokens one after another, caches kept). Per pass:
seconds, the bytes the operating system read from storage for the process (/proc/self/io
read_bytes: O_DIRECT and page-cache reads alike), and for strata the expert cache's hit rate and
the pre-gating guess accuracy. Prints one JSON object: per-framework medians, strata over
accelerate, and the bytes a decode token read against the least it must (the dense part and
top_k experts per layer).

Note [Ratios by round]: this VM's disk drifts (fio read 1.2 to 2.2 GB/s within one run of this
bench), and a cold token is bound by it. Each round runs the kinds back to back (in alternating
order) after one fio measure of its own; `speedup_by_round` is strata over accelerate within each
round and `speedup_median_of_rounds` their median, the figure the drift moves least (the
medians of each side over all rounds, `speedup_strata_over_accelerate`, are kept beside it).

  .venv/bin/python bench/moe-vs-accelerate.py --dir /var/tmp/strata-moe --rounds 2

With --memory-limit (default on where a memory cgroup can be made), strata and accelerate run
inside a memory cgroup of budget + the fixed overhead the in-memory reference measured, page
cache included (Note [Benchmarks under a memory limit] in _pybench.py): without it accelerate's
warm tokens read the offloaded weights from a page cache larger than its budget.
"""

from __future__ import annotations

import argparse
import json
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

KINDS = ("strata", "strata_whole", "accelerate")


def make_checkpoint(path: Path, args: argparse.Namespace) -> None:
    if (path / "config.json").is_file():
        return
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        moe_intermediate_size=args.expert_intermediate,
        intermediate_size=args.expert_intermediate * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=args.hidden // 16,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = path.with_suffix(".tmp")
    model.save_pretrained(tmp, max_shard_size="400MB")
    tmp.rename(path)


def _layer_bytes(checkpoint: Path) -> int:
    """The bytes of layer 0 (attention and all its experts), from the files' headers."""
    total = 0
    for f in checkpoint.glob("*.safetensors"):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, entry in header.items():
            if name.startswith("model.layers.0."):
                a, b = entry["data_offsets"]
                total += b - a
    return total


def child(args: argparse.Namespace) -> dict:
    import torch
    import transformers

    torch.manual_seed(1)
    import_rss = status_bytes("VmRSS")
    path = Path(args.checkpoint)
    files = sorted(path.glob("*.safetensors"))
    offload = Path(args.dir) / "accelerate-offload"
    ids = torch.randint(0, args.vocab, (1, args.prefill))
    handle = None
    if args.child == "reference":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, experts_implementation="eager"
        )
    elif args.child.startswith("strata"):
        import strata.torch as st

        half = args.budget // 2
        device_budget = half
        if args.child == "strata_whole":  # two whole layers must fit (the leased one, the next)
            device_budget = max(half, args.whole_device_budget)
        swap = Path(args.dir) / f"swap-{args.child}"
        shutil.rmtree(swap, ignore_errors=True)
        swap.mkdir(parents=True)
        model = st.load_model(
            path,
            device_budget=device_budget,
            host_budget=args.budget - half,
            experts="whole" if args.child == "strata_whole" else "leased",
            expert_prefetch=args.expert_prefetch,
            # "whole" builds each layer's fused experts once, homed on the host tier: its swap
            nvme_dir=swap,
        )
        handle = model.strata
    else:
        shutil.rmtree(offload, ignore_errors=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path,
            device_map="auto",
            max_memory={"cpu": args.budget},
            offload_folder=str(offload),
            dtype=torch.float32,
            experts_implementation="eager",
        )
    model.eval()
    reset_peak_rss()  # the passes' peak, not from_pretrained's transient copies
    loaded_rss = status_bytes("VmRSS")
    targets = files + [p for p in (offload, Path(args.dir) / f"swap-{args.child}") if p.exists()]

    def experts() -> dict:
        if handle is None or handle.experts is None:
            return {}
        s = handle.stats()["experts"]
        return {k: s[k] for k in ("hits", "host_hits", "misses", "routed", "guessed_right")} | {
            "routed_after_guess": s["routed_after_guess"]
        }

    def timed(fn, cold: bool) -> dict:
        if cold:
            drop_page_cache(targets)
            if handle is not None:
                handle.drop_caches()
        before, e_before = os_read_bytes(), experts()
        start = time.perf_counter()
        with torch.no_grad():
            fn()
        out = {"s": time.perf_counter() - start, "os_read_bytes": os_read_bytes() - before}
        e_after = experts()
        if e_after:
            out["experts"] = {k: e_after[k] - e_before[k] for k in e_after}
        return out

    state: dict = {}
    with torch.no_grad():
        model(ids[:, :8])  # warm-up (strata records its pipeline)

    def prefill() -> None:
        out = model(ids, use_cache=True)
        state["past"], state["next"] = out.past_key_values, out.logits[:, -1:].argmax(-1)
        state["logits"] = out.logits

    def decode() -> None:
        out = model(state["next"], past_key_values=state["past"], use_cache=True)
        state["past"], state["next"] = out.past_key_values, out.logits[:, -1:].argmax(-1)
        state["tokens"].append(int(state["next"]))

    result: dict = {"framework": args.child}
    result["prefill_cold"] = timed(prefill, True)
    result["logits_checksum"] = float(state["logits"].double().sum())
    state["tokens"] = []
    result["decode_cold"] = [timed(decode, True) for _ in range(args.cold_tokens)]
    result["decode_warm"] = [timed(decode, False) for _ in range(args.warm_tokens)]
    result["prefill_warm"] = timed(prefill, False)
    result["tokens"] = state["tokens"]
    result["peak_rss_bytes"] = status_bytes("VmHWM")
    result["rss_after_imports_bytes"] = import_rss
    result["rss_loaded_bytes"] = loaded_rss
    if handle is not None:
        result["dense_bytes"] = sum(b.nbytes for b in handle.blocks)
        if handle.experts is not None:
            result["expert_bytes"] = handle.experts.layers[0].experts[0].nbytes
            result["experts_stats"] = {
                k: v for k, v in handle.stats()["experts"].items() if k != "layers"
            }
    return result


def run_child(kind: str, args: argparse.Namespace, checkpoint: Path, limit: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--checkpoint", str(checkpoint)]
    for k in (
        "budget",
        "prefill",
        "cold_tokens",
        "warm_tokens",
        "vocab",
        "dir",
        "whole_device_budget",
        "expert_prefetch",
    ):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    result, _ = run_json_child(cmd, limit, kind)
    return {"framework": kind, "oom": True} if result is None else result


def _speedups(s: dict, a: dict) -> dict:
    """accelerate's time over strata's, per phase, from two figures() results."""
    return {
        "decode_cold": round(a["decode_cold_s_per_token"] / s["decode_cold_s_per_token"], 3),
        "decode_warm": round(a["decode_warm_s_per_token"] / s["decode_warm_s_per_token"], 3),
        "prefill_cold": round(a["prefill_cold_s"] / s["prefill_cold_s"], 3),
        "prefill_warm": round(a["prefill_warm_s"] / s["prefill_warm_s"], 3),
    }


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def figures(runs: list[dict], ref: dict, args: argparse.Namespace) -> dict:
    rs = [r for r in runs if not r.get("oom")]
    if not rs:
        return {"oom_kills": len(runs), "figures": "every run was killed for memory"}
    fig: dict = {"oom_kills": len(runs) - len(rs)}
    for phase in ("prefill_cold", "prefill_warm"):
        fig[f"{phase}_s"] = round(_med([r[phase]["s"] for r in rs]), 4)
        fig[f"{phase}_os_read_bytes"] = _med([r[phase]["os_read_bytes"] for r in rs])
    for phase in ("decode_cold", "decode_warm"):
        # the first warm token follows a cold one: the cache is still filling
        passes = [p for r in rs for p in r[phase][(1 if phase == "decode_warm" else 0) :]]
        fig[f"{phase}_s_per_token"] = round(_med([p["s"] for p in passes]), 4)
        fig[f"{phase}_os_read_bytes_per_token"] = _med([p["os_read_bytes"] for p in passes])
        with_experts = [p["experts"] for p in passes if "experts" in p]
        if with_experts:
            routed = sum(e["routed"] for e in with_experts)
            hits = sum(e["hits"] + e["host_hits"] for e in with_experts)
            guessed = sum(e["routed_after_guess"] for e in with_experts)
            right = sum(e["guessed_right"] for e in with_experts)
            fig[f"{phase}_expert_hit_rate"] = round(hits / routed, 3) if routed else None
            fig[f"{phase}_guess_accuracy"] = round(right / guessed, 3) if guessed else None
    # warm tokens in order: the bytes each read, falling as the cache fills
    fig["decode_warm_os_read_bytes_by_token"] = [
        int(_med([r["decode_warm"][i]["os_read_bytes"] for r in rs]))
        for i in range(args.warm_tokens)
    ]
    fig["peak_rss_bytes"] = _med([r["peak_rss_bytes"] for r in rs])
    fig["same_logits_as_reference"] = all(
        r["logits_checksum"] == ref["logits_checksum"] for r in rs
    )
    fig["same_tokens_as_reference"] = all(r["tokens"] == ref["tokens"] for r in rs)
    if "dense_bytes" in rs[0]:
        fig["dense_bytes"] = rs[0]["dense_bytes"]
    if "expert_bytes" in rs[0]:
        least = rs[0]["dense_bytes"] + args.layers * args.top_k * rs[0]["expert_bytes"]
        fig["least_bytes_per_token"] = least
        fig["decode_cold_read_over_least"] = round(
            fig["decode_cold_os_read_bytes_per_token"] / least, 3
        )
        fig["decode_warm_read_over_least"] = round(
            fig["decode_warm_os_read_bytes_per_token"] / least, 3
        )
        fig["experts_stats_last_run"] = rs[-1]["experts_stats"]
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp/strata-moe")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--expert-intermediate", type=int, default=256)
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--budget-fraction", type=float, default=0.25)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--cold-tokens", type=int, default=3)
    ap.add_argument("--warm-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help="which runs, comma-separated (strata_whole cannot run under the default limit)",
    )
    ap.add_argument(
        "--expert-prefetch",
        choices=["auto", "all", "off"],
        default="auto",
        help="which pre-gating guesses strata moves (Note [Pre-gating])",
    )
    ap.add_argument("--memory-limit", choices=["on", "off"], default="on")
    ap.add_argument("--child", choices=["reference", *KINDS, "checkpoint"])
    ap.add_argument("--checkpoint")
    ap.add_argument("--budget", type=int)
    ap.add_argument("--whole-device-budget", type=int, default=0)
    args = ap.parse_args()
    if args.child == "checkpoint":
        make_checkpoint(Path(args.checkpoint), args)
        return
    if args.child:
        print(json.dumps(child(args)))
        return
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    name = f"qwen3moe-{args.layers}x{args.hidden}-e{args.experts}k{args.top_k}-v{args.vocab}"
    checkpoint = root / name
    if not (checkpoint / "config.json").is_file():  # in a child: the parent stays small
        cmd = [sys.executable, __file__, "--child", "checkpoint", "--checkpoint", str(checkpoint)]
        for k in ("layers", "hidden", "expert_intermediate", "experts", "top_k", "vocab"):
            cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    model_bytes = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    args.budget = int(model_bytes * args.budget_fraction)
    # experts="whole" leases a layer with its 48 experts: two such layers and the head must fit
    # its device tier, more than half the budget; it gets that (more memory than strata's run).
    layer_bytes = _layer_bytes(checkpoint)
    args.whole_device_budget = int(2.2 * layer_bytes)
    rates = disk_gbps(checkpoint)
    ref = run_child("reference", args, checkpoint, None)
    limit = None
    if args.memory_limit == "on":
        # What a process needs beside its budget: the libraries (the reference's RSS after
        # importing torch and transformers) and the passes' own memory (activations, KV cache,
        # logits: its peak during the passes over its RSS once loaded), plus 64 MiB for the
        # model's skeleton. (The reference's RSS itself counts the checkpoint's mmapped pages
        # beside its copy of the weights, so its peak less the model is not the overhead.)
        passes = max(0, ref["peak_rss_bytes"] - ref["rss_loaded_bytes"])
        overhead = ref["rss_after_imports_bytes"] + passes + (64 << 20)
        try:
            MemoryLimit(args.budget + overhead, "probe").close()
            limit = args.budget + overhead
        except OSError as e:
            print(f"moe-vs-accelerate: no memory limit: {e}", file=sys.stderr)
    kinds = [k for k in KINDS if k in args.kinds.split(",")]
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    round_rates: list[float] = []
    for r in range(args.rounds):
        # This VM's disk drifts by up to 2x within minutes: its rate in each round, beside the
        # round's own ratios (Note [Ratios by round]).
        round_rates += [round(x, 3) for x in disk_gbps(checkpoint, runs=1)]
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            runs[kind].append(run_child(kind, args, checkpoint, limit))
            print(f"round {r}: {kind} done", file=sys.stderr)
    out: dict = {
        "checkpoint": str(checkpoint),
        "model_bytes": model_bytes,
        "budget_bytes": args.budget,
        "layer_bytes": layer_bytes,
        "strata_whole_device_budget_bytes": max(args.budget // 2, args.whole_device_budget),
        "memory_limit_bytes": limit,
        "memory_limit": "budget + the reference's libraries and passes + 64 MiB, page cache "
        "included (Note [Benchmarks under a memory limit] in bench/_pybench.py)"
        if limit
        else "off",
        "layers": args.layers,
        "experts": args.experts,
        "top_k": args.top_k,
        "expert_prefetch": args.expert_prefetch,
        "disk_read_gbps_fio": [round(x, 3) for x in rates],
        "disk_read_gbps_fio_by_round": round_rates,
        "rounds": args.rounds,
        "reference_in_memory": {
            "prefill_s": round(ref["prefill_warm"]["s"], 4),
            "decode_s_per_token": round(_med([p["s"] for p in ref["decode_warm"][1:]]), 4),
            "peak_rss_bytes": ref["peak_rss_bytes"],
        },
    }
    for kind in kinds:
        out[kind] = figures(runs[kind], ref, args)
    s, a, w = (out.get(k, {}) for k in ("strata", "accelerate", "strata_whole"))
    if "prefill_cold_s" in s and "prefill_cold_s" in a:
        out["speedup_strata_over_accelerate"] = _speedups(s, a)
        # Note [Ratios by round]: each round's two runs ran next to each other, on the disk
        # of that moment; the median of those ratios is the figure the drift moves least.
        by_round = [
            _speedups(figures([sr], ref, args), figures([ar], ref, args))
            for sr, ar in zip(runs["strata"], runs["accelerate"])
            if not sr.get("oom") and not ar.get("oom")
        ]
        out["speedup_by_round"] = by_round
        if by_round:
            out["speedup_median_of_rounds"] = {
                k: round(statistics.median(r[k] for r in by_round), 3) for k in by_round[0]
            }
    if "prefill_cold_s" in s and "prefill_cold_s" in w:
        out["strata_prefill_over_whole_layers"] = {
            "cold": round(s["prefill_cold_s"] / w["prefill_cold_s"], 3),
            "warm": round(s["prefill_warm_s"] / w["prefill_warm_s"], 3),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
