"""What the Python benchmarks share: the package as the README's build leaves it on the path,
a process's memory and storage reads from /proc, dropping files from the page cache, the disk's
read rate by fio, a memory cgroup to run a child process under a limit, and the dropout-free
GPT-2 the training benchmarks run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
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


def os_read_bytes() -> int:
    """What the kernel read from storage for this process (all its threads): /proc/self/io
    read_bytes, O_DIRECT and page-cache reads alike."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def drop_page_cache(paths: list[Path]) -> str:
    """Drops the files' pages from the page cache: drop_caches when writable (root), and
    posix_fadvise(DONTNEED) on each file either way. Returns how."""
    how = "fadvise"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        how = "drop_caches+fadvise"
    except OSError:
        pass
    for p in paths:
        for f in [p] if p.is_file() else [x for x in p.rglob("*") if x.is_file()]:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return how


def disk_gbps(path: Path, runs: int = 3) -> list[float]:
    """The disk's read rate on the checkpoint's own files: fio, O_DIRECT, io_uring, 1 MiB
    blocks, queue depth 16, 3 seconds, `runs` times (this VM's disk varies by 2x from one run to
    the next). Empty when fio is missing."""
    fio = shutil.which("fio")
    if fio is None:
        return []
    files = ":".join(str(f) for f in sorted(path.glob("*.safetensors")))
    rates = []
    for _ in range(runs):
        out = subprocess.run(
            [
                fio,
                "--name=read",
                f"--filename={files}",
                "--rw=read",
                "--bs=1M",
                "--direct=1",
                "--ioengine=io_uring",
                "--iodepth=16",
                "--time_based",
                "--runtime=3",
                "--output-format=json",
                "--readonly",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        rates.append(json.loads(out.stdout)["jobs"][0]["read"]["bw_bytes"] / 1e9)
    return rates


def reset_peak_rss() -> None:
    """Resets this process's VmHWM to its RSS now (clear_refs 5, Linux 4.0 on), so a later
    status_bytes("VmHWM") is the peak since this call."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5\n")


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


# Note [Benchmarks under a memory limit]
# Offload is for the user who has no memory to spare, so a comparison where one side's weights sit
# in the page cache (memory outside its budget: accelerate's offload folder is read through
# mmap, and the VM has 24 GiB for a model of 1) flatters that side. Under a memory cgroup the
# page cache a process fills is charged to it (v1 and v2 alike), so with a limit of budget +
# fixed overhead the kernel must drop those pages and read them again when they are next used.
# MemoryLimit makes such a cgroup for child processes: v2's memory.max where the memory
# controller is in the unified hierarchy, else v1's memory.limit_in_bytes (this VM), swap off
# where the files allow it. It needs root (or a delegated cgroup); without one it says why and
# the benchmark reports the limited runs as not run.


def _mounts() -> list[tuple[str, str, str]]:
    with open("/proc/mounts") as f:
        return [tuple(line.split()[1:4]) for line in f]  # (mount point, type, options)


class MemoryLimit:
    """A memory cgroup of `limit_bytes` that child processes join (`preexec` as their
    preexec_fn); `peak_bytes()` is its peak use (page cache included), `close()` removes it."""

    def __init__(self, limit_bytes: int, name: str) -> None:
        self.limit_bytes = limit_bytes
        self.dir, self.version = self._make(name)
        if self.version == 2:
            self._write("memory.max", str(limit_bytes))
            self._write("memory.swap.max", "0", optional=True)
        else:
            self._write("memory.limit_in_bytes", str(limit_bytes))
            self._write("memory.memsw.limit_in_bytes", str(limit_bytes), optional=True)

    @staticmethod
    def _own(controller_line: str) -> str:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, names, path = line.rstrip("\n").split(":", 2)
                if names == controller_line:
                    return path
        raise OSError(f"no {controller_line or 'unified'} line in /proc/self/cgroup")

    def _make(self, name: str) -> tuple[str, int]:
        leaf = f"strata-bench-{os.getpid()}-{name}"
        for mount, kind, _ in _mounts():
            if kind != "cgroup2":
                continue
            parent = mount + self._own("")
            try:
                with open(os.path.join(parent, "cgroup.controllers")) as f:
                    if "memory" not in f.read().split():
                        continue
                with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                    f.write("+memory")
                d = os.path.join(parent, leaf)
                os.makedirs(d, exist_ok=True)
                return d, 2
            except OSError:
                continue
        for mount, kind, options in _mounts():
            if kind == "cgroup" and "memory" in options.split(","):
                d = mount + self._own("memory") + "/" + leaf
                os.makedirs(d, exist_ok=True)
                return d, 1
        raise OSError(
            "no memory cgroup to make a child of (cgroup v2 without the memory "
            "controller and no v1 memory hierarchy)"
        )

    def _write(self, name: str, value: str, optional: bool = False) -> None:
        try:
            with open(os.path.join(self.dir, name), "w") as f:
                f.write(value)
        except OSError:
            if not optional:
                raise

    def describe(self) -> str:
        knob = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        return f"cgroup v{self.version} {knob} = {self.limit_bytes} ({self.dir})"

    def preexec(self) -> None:
        """Run in the child between fork and exec: the child joins the cgroup."""
        with open(os.path.join(self.dir, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def peak_bytes(self) -> int:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            with open(os.path.join(self.dir, name)) as f:
                return int(f.read())
        except OSError:
            return 0

    def reset_peak(self) -> None:
        if self.version == 1:
            self._write("memory.max_usage_in_bytes", "0", optional=True)
        else:
            self._write("memory.peak", "0", optional=True)  # kernels >= 6.12

    def close(self) -> None:
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


def run_json_child(cmd: list[str], limit: int | None, name: str) -> tuple[dict | None, int | None]:
    """Runs `cmd` (a child printing its result as JSON on its last line), inside a memory cgroup
    of `limit` bytes when one is given. Returns its result (None when the limit killed it) and
    the cgroup's peak use, page cache included (None without a limit). Another failure exits
    naming `name` with the child's stderr."""
    lim = MemoryLimit(limit, name) if limit else None
    try:
        out = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            check=False,
            preexec_fn=lim.preexec if lim else None,
        )
        peak = lim.peak_bytes() if lim else None
    finally:
        if lim:
            lim.close()
    if lim and out.returncode == -9:
        return None, peak
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1]), peak
