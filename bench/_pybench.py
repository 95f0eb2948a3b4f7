"""What the Python benchmarks share: the package as the README's build leaves it on the path,
a process's memory from /proc, and the dropout-free GPT-2 the training benchmarks run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# The package as the README's build leaves it, unless strata is installed (pip install .).
sys.path.append(str(Path(__file__).resolve().parent.parent / "build" / "python"))


def status_bytes(field: str) -> int:
    """A size from /proc/self/status: "VmRSS" (now) or "VmHWM" (the peak; per address space,
    so, unlike getrusage's ru_maxrss, not inherited across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def gpt2(vocab: int, seq: int, hidden: int, layers: int) -> Any:
    """A random GPT-2 LM with no dropout (the same function in every run), seeded."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=seq,
        n_embd=hidden,
        n_layer=layers,
        n_head=8,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)
