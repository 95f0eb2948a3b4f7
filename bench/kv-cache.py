"""Long generation whose KV cache is larger than memory: strata.torch.KVCache (host budget smaller
than the KV, NVMe holding the rest) against transformers' DynamicCache in memory and
DynamicCache(offloading=True), alternating, in one run; decode tokens/s and peak RSS per context.

    .venv/bin/python bench/kv-cache.py                   # contexts 2k, 8k, 32k on a Llama-like model
    .venv/bin/python bench/kv-cache.py --device cuda     # on a GPU, with the offloaded cache too

Each configuration runs in a child process of its own (its peak RSS is its VmHWM), all of them
inside one memory cgroup of the same limit: strata's budgets, plus the fixed overhead a process
needs (the libraries and the model: the RSS of a child that builds the model and stops), plus one
layer's keys and values at the context's length twice over (the tensors attention reads, which
DynamicCache's concatenation also makes), plus 64 MiB. A child the limit kills is reported
"oom": it could not run in that memory; where DynamicCache is, it runs again without the limit
("dynamic_without_limit": what the in-memory cache does with all the memory it needs).

The context is filled with the same random keys and values for every cache (Cache.update with the
whole context, layer by layer: what a prefill leaves, without a prefill's compute, which on two
CPU cores would take minutes at 32k tokens); then `--tokens` greedy decode steps run through the
model. int8 pages: the bytes read from NVMe per token against bfloat16 pages, and the greedy
tokens' match rate against full width over a fixed prompt set (real prefills of `--prompt`
tokens, `--match-tokens` generated).

transformers' DynamicCache(offloading=True) needs CUDA (its update waits on
torch.cuda.default_stream): on the host it is reported unavailable, not run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

from _pybench import MemoryLimit, reset_peak_rss, run_json_child, status_bytes

KINDS = ["strata", "dynamic", "dynamic_offloaded"]


def build_model(args: argparse.Namespace):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.contexts) + 1024,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval().to(args.device)


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    head_dim = args.hidden // args.heads
    return 2 * args.layers * args.kv_heads * head_dim * 2  # keys and values, bfloat16


def make_cache(kind: str, model, args: argparse.Namespace, nvme: str):
    import strata.torch as st
    import transformers

    if kind in ("strata", "strata_int8"):
        return st.KVCache(
            model,
            device_budget=args.device_budget,
            host_budget=args.host_budget,
            nvme_dir=nvme,
            nvme_capacity=args.nvme_capacity,
            page_tokens=args.page_tokens,
            compress="int8" if kind == "strata_int8" else None,
        )
    if kind == "dynamic":
        return transformers.DynamicCache()
    return transformers.DynamicCache(offloading=True)


def child(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    kind = args.child
    model = build_model(args)
    if kind == "probe":
        return {"rss_bytes": status_bytes("VmRSS")}
    if kind == "match":
        return match(model, args)
    with tempfile.TemporaryDirectory(dir=args.dir) as nvme:
        cache = make_cache(kind, model, args, nvme)
        cfg = model.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        g = torch.Generator().manual_seed(1)
        reset_peak_rss()
        t0 = time.perf_counter()
        with torch.no_grad():
            for layer in range(cfg.num_hidden_layers):  # chunks of 1024 tokens, as a prefill
                for at in range(0, args.context, 1024):
                    n = min(1024, args.context - at)
                    shape = (1, cfg.num_key_value_heads, n, head_dim)
                    k = torch.randn(shape, generator=g, dtype=torch.bfloat16).to(args.device)
                    v = torch.randn(shape, generator=g, dtype=torch.bfloat16).to(args.device)
                    cache.update(k, v, layer)
                    del k, v
            fill_s = time.perf_counter() - t0
            token = torch.tensor([[7]], device=args.device)
            before = cache.stats() if hasattr(cache, "stats") else None
            last = before["nvme_bytes_read"] if before else 0
            steps, reads = [], []
            for _ in range(args.tokens):
                t = time.perf_counter()
                pos = torch.tensor([[cache.get_seq_length()]], device=args.device)
                logits = model(token, cache=cache, use_cache=True, position_ids=pos).logits
                token = logits[:, -1:].argmax(-1)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                steps.append(time.perf_counter() - t)
                if before is not None:  # the NVMe bytes of this step (outside its time)
                    now = cache.stats()["nvme_bytes_read"]
                    reads.append(now - last)
                    last = now
        out = {
            "kind": kind,
            "context": args.context,
            "fill_s": round(fill_s, 3),
            "decode_s": [round(s, 5) for s in steps],
            "peak_rss_bytes": status_bytes("VmHWM"),
        }
        if hasattr(cache, "stats"):
            s = cache.stats()
            out["cache"] = {k: s[k] for k in ("pages", "page_bytes", "bytes", "stored_bytes")}
            out["nvme_bytes_written"] = s["nvme_bytes_written"]  # the fill's and decode's
            out["nvme_bytes_read_per_token"] = int(statistics.median(reads[2:] or reads))
            out["nvme_bytes_read_first_tokens"] = reads[:2]
            out["prefetch_hit_rate"] = round(s["prefetch_hits"] / max(1, s["pages_moved"]), 3)
        return out


def match(model, args: argparse.Namespace) -> dict:
    """Greedy tokens of int8 pages against full-width pages over a fixed prompt set."""
    import torch

    with tempfile.TemporaryDirectory(dir=args.dir) as nvme:
        equal = total = same_prefix = 0
        for p in range(args.prompts):
            g = torch.Generator().manual_seed(100 + p)
            ids = torch.randint(3, args.vocab, (1, args.prompt), generator=g).to(args.device)
            runs = []
            for kind in ("strata", "strata_int8"):
                cache = make_cache(kind, model, args, nvme)
                with torch.no_grad():
                    out = model.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        cache=cache,
                        max_new_tokens=args.match_tokens,
                        do_sample=False,
                        pad_token_id=0,
                    )
                runs.append(out[0, args.prompt :])
                cache.close()
            eq = runs[0] == runs[1]
            equal += int(eq.sum())
            total += eq.numel()
            same_prefix += int(eq.cumprod(0).sum())
    return {
        "prompts": args.prompts,
        "prompt_tokens": args.prompt,
        "generated_tokens": args.match_tokens,
        "token_match_rate": round(equal / total, 4),
        "identical_prefix_rate": round(same_prefix / total, 4),
    }


def run_child(kind: str, context: int, args: argparse.Namespace, limit: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--context", str(context)]
    for k in (
        "device",
        "layers",
        "hidden",
        "heads",
        "kv_heads",
        "vocab",
        "tokens",
        "page_tokens",
        "device_budget",
        "host_budget",
        "nvme_capacity",
        "dir",
        "threads",
        "prompts",
        "prompt",
        "match_tokens",
    ):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    cmd += ["--contexts", *map(str, args.contexts)]
    result, _ = run_json_child(cmd, limit, f"{kind} at {context}")
    return {"kind": kind, "context": context, "oom": True} if result is None else result


def _bytes(text: str) -> int:
    import strata

    return strata._core.parse_bytes(text, "budget")


def summary(runs: list[dict], args: argparse.Namespace) -> dict:
    if any(r.get("oom") for r in runs):
        return {"oom": True}
    # The first decode steps bring the pages the upper tiers keep; the rest is the steady rate.
    steady = [s for r in runs for s in r["decode_s"][2:]]
    s_per_token = statistics.median(steady)
    out = {
        "decode_s_per_token": round(s_per_token, 5),
        "tokens_per_s": round(1 / s_per_token, 3),
        "fill_s": round(statistics.median(r["fill_s"] for r in runs), 3),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs),
    }
    for k in ("nvme_bytes_read_per_token", "nvme_bytes_written", "prefetch_hit_rate", "cache"):
        if k in runs[-1]:
            out[k] = runs[-1][k]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=10)
    ap.add_argument("--page-tokens", type=int, default=256)
    ap.add_argument("--device-budget", default="32MiB")
    ap.add_argument("--host-budget", default="128MiB")
    ap.add_argument("--nvme-capacity", default="2GiB")
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--match-tokens", type=int, default=32)
    ap.add_argument("--memory-limit", choices=["on", "off"], default="on")
    ap.add_argument("--kinds", nargs="+", default=[*KINDS, "strata_int8"])
    ap.add_argument("--child")
    ap.add_argument("--context", type=int, default=0)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    kinds = KINDS if args.device == "cuda" else [k for k in KINDS if k != "dynamic_offloaded"]
    kinds = [k for k in [*kinds, "strata_int8"] if k in args.kinds]
    probe = run_child("probe", 0, args, None)
    per_token = kv_bytes_per_token(args)
    layer_kv = per_token // args.layers
    budgets = _bytes(args.device_budget) + _bytes(args.host_budget)
    out: dict = {
        "device": args.device,
        "model": f"Llama-like, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
        f"{args.kv_heads} KV heads, bfloat16",
        "kv_bytes_per_token": per_token,
        "page_tokens": args.page_tokens,
        "device_budget": args.device_budget,
        "host_budget": args.host_budget,
        "fixed_overhead_bytes": probe["rss_bytes"] + (64 << 20),
        "contexts": {},
    }
    if args.device != "cuda":
        out["dynamic_offloaded"] = (
            "unavailable: DynamicCache(offloading=True) needs CUDA (its update waits on "
            "torch.cuda.default_stream); on the host its offload is a no-op"
        )
    for context in args.contexts:
        transient = 2 * layer_kv * (context + args.tokens)  # one layer's keys and values, twice
        limit = None
        if args.memory_limit == "on":
            limit = budgets + out["fixed_overhead_bytes"] + transient
            try:
                MemoryLimit(limit, "probe").close()
            except OSError as e:
                print(f"kv-cache: no memory limit: {e}", file=sys.stderr)
                limit = None
        runs: dict[str, list[dict]] = {k: [] for k in kinds}
        for r in range(args.rounds):
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                runs[kind].append(run_child(kind, context, args, limit))
                if kind == "dynamic" and runs[kind][-1].get("oom"):
                    # What the in-memory cache does with the memory it needs: the reference the
                    # goal "within 1.3x of the in-memory cache" is measured against.
                    unlimited = runs.setdefault("dynamic_without_limit", [])
                    unlimited.append(run_child(kind, context, args, None))
                print(f"context {context} round {r}: {kind} done", file=sys.stderr)
        row: dict = {
            "kv_bytes": per_token * context,
            "memory_limit_bytes": limit,
            "transient_bytes": transient,
        }
        for kind, kind_runs in runs.items():
            row[kind] = summary(kind_runs, args)
        u = row.get("dynamic_without_limit")
        if u and not row.get("strata", {"oom": True}).get("oom"):
            row["strata_over_dynamic_without_limit_s_per_token"] = round(
                row["strata"]["decode_s_per_token"] / u["decode_s_per_token"], 3
            )
        s, d = row.get("strata", {"oom": True}), row.get("dynamic", {"oom": True})
        if not s.get("oom") and not d.get("oom"):
            row["strata_over_dynamic_s_per_token"] = round(
                s["decode_s_per_token"] / d["decode_s_per_token"], 3
            )
        o = row.get("dynamic_offloaded")
        if o and not o.get("oom") and not s.get("oom"):
            row["strata_over_offloaded_tokens_per_s"] = round(
                s["tokens_per_s"] / o["tokens_per_s"], 3
            )
        q = row.get("strata_int8", {"oom": True})
        if not q.get("oom") and not s.get("oom") and s.get("nvme_bytes_read_per_token"):
            row["int8_over_bf16_nvme_bytes_per_token"] = round(
                q["nvme_bytes_read_per_token"] / s["nvme_bytes_read_per_token"], 3
            )
        out["contexts"][str(context)] = row
    out["int8_match"] = run_child("match", 0, args, None)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
