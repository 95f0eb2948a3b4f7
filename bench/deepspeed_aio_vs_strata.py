"""DeepSpeed's aio_handle against strata-bench io, sequential O_DIRECT, on the same file.

Run by bench/deepspeed-aio-vs-strata.sh (see there for usage). Installs nothing: without torch,
deepspeed or the libaio that DeepSpeed's async_io op builds against, it says what to install and
exits 2. DeepSpeed builds the op itself (JIT, into ~/.cache/torch_extensions) on its first load.

One data file, DIR/strata-bench-io-0.dat, is laid out by `strata-bench io --rw write` and left
there (strata-bench io keeps its data files, Note [Data files] in bench/io_bench.cpp). Each
round then reads the whole file with strata-bench io (1 MiB and 4 MiB blocks, 16 deep) and
with DeepSpeed's aio_handle.sync_pread into one tensor (1 MiB blocks, 16 deep, and the
ZeRO-Infinity `aio` config defaults), and writes it whole the same ways; DeepSpeed writes
back the bytes it read, so the file keeps strata-bench's data. The page cache of the file is
dropped (posix_fadvise DONTNEED) before each pass, as strata-bench io does. The order of the
two programs alternates from round to round; figures are medians over the rounds, ratios the
median of each round's ratio. MB = 1e6 bytes. The device's average request size for each pass
comes from /sys/dev/block/MAJ:MIN/stat of the device holding DIR (other traffic on that device
counts too).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

INSTALL = (
    "install them into the Python that runs this (not done by this script): "
    "`PYTHON -m pip install torch deepspeed` and `apt-get install libaio-dev`"
)
QD = 16
MIB = 1 << 20
STRATA_BLOCKS = (MIB, 4 * MIB)
STAMP_STRIDE = 4 * MIB  # every strata-bench block (1 or 4 MiB) written starts with its offset


def unavailable(what: str) -> None:
    print(f"deepspeed-aio-vs-strata: {what}; {INSTALL}", file=sys.stderr)
    sys.exit(2)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB)")
    return int(m.group(1)) << (10 * " KMGT".index(m.group(2).upper() or " "))


class Device:
    """The block device holding a directory, read through its sysfs stat counters."""

    def __init__(self, directory: str) -> None:
        st = os.stat(directory)
        path = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        self.stat = path + "/stat" if os.path.exists(path + "/stat") else None
        self.name = os.path.basename(os.path.realpath(path)) if self.stat else None

    def counters(self) -> list[int]:
        if self.stat is None:
            return [0] * 8
        with open(self.stat) as f:
            return [int(x) for x in f.read().split()[:8]]

    def measure(self, body, is_read: bool) -> tuple[object, float | None, int]:
        """Runs body(); returns its result, the device's average request and bytes moved."""
        before = self.counters()
        out = body()
        after = self.counters()
        ops, sectors = (0, 2) if is_read else (4, 6)
        n = after[ops] - before[ops]
        moved = (after[sectors] - before[sectors]) * 512
        return out, (moved / n if n and self.stat else None), moved


def drop_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def huge_page_bytes(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0


def load_deepspeed():
    try:
        import torch
    except ImportError:
        unavailable("torch is not installed")
    try:
        import deepspeed
        from deepspeed.ops.op_builder import AsyncIOBuilder
        from deepspeed.runtime.swap_tensor import constants
    except ImportError as e:
        unavailable(f"deepspeed is not installed or does not import ({e})")
    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        unavailable("DeepSpeed's async_io op cannot be built here (libaio headers missing)")
    print(
        "loading DeepSpeed's async_io op (DeepSpeed builds it on first use: minutes)...",
        file=sys.stderr,
        flush=True,
    )
    try:
        aio = builder.load(verbose=False)
    except Exception as e:  # noqa: BLE001 - any build or load failure means "not available"
        unavailable(f"DeepSpeed's async_io op failed to build or load: {e}")
    return torch, deepspeed, aio, constants


def deepspeed_configs(constants) -> dict[str, dict]:
    """The ZeRO-Infinity `aio` config defaults, and the same with 1 MiB blocks 16 deep."""
    zero = {
        "block_size": constants.AIO_BLOCK_SIZE_DEFAULT,
        "queue_depth": constants.AIO_QUEUE_DEPTH_DEFAULT,
        "single_submit": constants.AIO_SINGLE_SUBMIT_DEFAULT,
        "overlap_events": constants.AIO_OVERLAP_EVENTS_DEFAULT,
        "intra_op_parallelism": getattr(
            constants,
            "AIO_INTRA_OP_PARALLELISM_DEFAULT",
            getattr(constants, "AIO_THREAD_COUNT_DEFAULT", 1),
        ),
    }
    return {"1MiB_qd16": {**zero, "block_size": MIB, "queue_depth": QD}, "zero_default": zero}


def strata_pass(bench: str, rw: str, bs: int, size: int, directory: str) -> dict:
    cmd = [
        bench,
        "io",
        "--rw",
        rw,
        "--bs",
        str(bs),
        "--qd",
        str(QD),
        "--size",
        str(size),
        "--path",
        directory,
        "--json",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result = json.loads(out)
    if not result["direct"]:
        sys.exit(f"strata-bench io did not get O_DIRECT on {directory}")
    return result


def check_stamps(torch, buf, size: int) -> None:
    """Every 4 MiB of strata-bench's file starts with its own offset (Note [Written data])."""
    words = buf[: size - size % STAMP_STRIDE].view(torch.int64)[:: STAMP_STRIDE // 8]
    want = torch.arange(words.numel(), dtype=torch.int64) * STAMP_STRIDE
    if not torch.equal(words, want):
        sys.exit("DeepSpeed read other bytes than strata-bench io wrote: the comparison is void")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("bench", help="strata-bench executable")
    p.add_argument("dir", help="directory on the disk to test")
    p.add_argument("--size", type=parse_size, default=parse_size("2GiB"))
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    size = a.size - a.size % (4 * MIB)
    if size == 0:
        sys.exit("--size: at least 4 MiB")
    torch, deepspeed, aio, constants = load_deepspeed()
    data = os.path.join(a.dir, "strata-bench-io-0.dat")
    device = Device(a.dir)

    # Lays out the file (when missing or of another size), then reads it once into DeepSpeed's
    # buffer: the bytes DeepSpeed writes back are strata-bench's, stamps included.
    strata_pass(a.bench, "write", MIB, size, a.dir)
    configs = deepspeed_configs(constants)
    handles = {
        name: aio.aio_handle(
            c["block_size"],
            c["queue_depth"],
            c["single_submit"],
            c["overlap_events"],
            c["intra_op_parallelism"],
        )
        for name, c in configs.items()
    }
    first = handles["1MiB_qd16"]
    if hasattr(first, "new_cpu_locked_tensor"):
        buf = first.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
        buffer_kind = "DeepSpeed's new_cpu_locked_tensor (posix_memalign to a page, mlock)"
    else:
        raw = torch.empty(size + 4096, dtype=torch.uint8)
        skip = -raw.data_ptr() % 4096
        buf = raw[skip : skip + size]
        buffer_kind = "a page-aligned torch tensor (not pinned: DeepSpeed bounces through its own)"
    for h in handles.values():
        if hasattr(h, "is_pinned") and not h.is_pinned(buf):
            buffer_kind += "; DeepSpeed says it is not pinned (a bounce buffer is used)"
            break
    buf_huge = huge_page_bytes(buf.data_ptr())
    if first.sync_pread(buf, data) < 0:
        sys.exit(f"DeepSpeed sync_pread of {data} failed")
    check_stamps(torch, buf, size)

    def deepspeed_pass(name: str, is_read: bool) -> float:
        drop_page_cache(data)
        op = handles[name].sync_pread if is_read else handles[name].sync_pwrite
        start = time.perf_counter()
        rc = op(buf, data)
        seconds = time.perf_counter() - start
        if rc < 0:
            sys.exit(f"DeepSpeed {'sync_pread' if is_read else 'sync_pwrite'} failed ({name})")
        return size / seconds / 1e6

    print(
        f"deepspeed {deepspeed.__version__} (torch {torch.__version__}), file {data}, "
        f"{size / 2**30:g} GiB, device {device.name or 'unknown'}, {a.runs} rounds"
    )
    print(f"  deepspeed buffer: {buffer_kind}; {buf_huge >> 20} MiB of it in huge pages")
    for name, c in configs.items():
        print(f"  deepspeed {name}: " + ", ".join(f"{k} {v}" for k, v in c.items()))

    # samples[(program, config, rw)] = [(mb_per_s, device_request_bytes, device_bytes), ...]
    samples: dict[tuple[str, str, str], list[tuple[float, float | None, int]]] = {}
    for run in range(1, a.runs + 1):
        for rw in ("read", "write"):
            is_read = rw == "read"
            jobs = [
                (
                    "strata",
                    f"{bs // MIB}MiB_qd{QD}",
                    lambda bs=bs, rw=rw: strata_pass(a.bench, rw, bs, size, a.dir)["mb_per_s"],
                )
                for bs in STRATA_BLOCKS
            ]
            jobs_ds = [
                ("deepspeed", name, lambda name=name, r=is_read: deepspeed_pass(name, r))
                for name in configs
            ]
            jobs = jobs + jobs_ds if run % 2 else jobs_ds + jobs
            line = []
            for program, config, body in jobs:
                mb, request, moved = device.measure(body, is_read)
                if device.stat and moved < 0.9 * size:
                    sys.exit(
                        f"{program} {config} {rw}: the device moved {moved} of {size} "
                        "bytes (page cache?): the figure would be void"
                    )
                samples.setdefault((program, config, rw), []).append((mb, request, moved))
                req = f"{request / 1024:.0f} KiB" if request else "?"
                line.append(f"{program} {config} {mb:.0f} MB/s (req {req})")
            s = samples[("strata", "1MiB_qd16", rw)][-1][0]
            d = samples[("deepspeed", "1MiB_qd16", rw)][-1][0]
            print(f"round {run} {rw}: " + " | ".join(line) + f" | 1MiB_qd16 ratio {s / d:.3f}")
    check_stamps(torch, buf, size)

    def med(program: str, config: str, rw: str, i: int = 0) -> float | None:
        values = [x[i] for x in samples[(program, config, rw)] if x[i] is not None]
        return statistics.median(values) if values else None

    def ratio(sconf: str, dconf: str, rw: str) -> float:
        pairs = zip(samples[("strata", sconf, rw)], samples[("deepspeed", dconf, rw)], strict=True)
        return statistics.median(s[0] / d[0] for s, d in pairs)

    summary: dict[str, object] = {
        "bench": "deepspeed-aio-vs-strata",
        "bytes": size,
        "runs": a.runs,
        "device": device.name,
        "deepspeed": deepspeed.__version__,
        "deepspeed_configs": configs,
        "deepspeed_buffer": buffer_kind,
        "deepspeed_buffer_huge_page_bytes": buf_huge,
    }
    for rw in ("read", "write"):
        summary[f"strata_{rw}_mb_per_s"] = med("strata", "1MiB_qd16", rw)
        summary[f"deepspeed_{rw}_mb_per_s"] = med("deepspeed", "1MiB_qd16", rw)
        summary[f"{rw}_ratio"] = ratio("1MiB_qd16", "1MiB_qd16", rw)
        summary[f"strata_{rw}_device_request_bytes"] = med("strata", "1MiB_qd16", rw, 1)
        summary[f"deepspeed_{rw}_device_request_bytes"] = med("deepspeed", "1MiB_qd16", rw, 1)
        summary[f"strata_4MiB_{rw}_mb_per_s"] = med("strata", "4MiB_qd16", rw)
        summary[f"strata_4MiB_{rw}_device_request_bytes"] = med("strata", "4MiB_qd16", rw, 1)
        summary[f"deepspeed_zero_default_{rw}_mb_per_s"] = med("deepspeed", "zero_default", rw)
        summary[f"deepspeed_zero_default_{rw}_device_request_bytes"] = med(
            "deepspeed", "zero_default", rw, 1
        )
        summary[f"{rw}_ratio_vs_zero_default"] = ratio("1MiB_qd16", "zero_default", rw)
        summary[f"{rw}_ratio_4MiB_vs_zero_default"] = ratio("4MiB_qd16", "zero_default", rw)
        print(
            f"median {rw}: strata 1MiB_qd16 {summary[f'strata_{rw}_mb_per_s']:.0f} MB/s, "
            f"deepspeed 1MiB_qd16 {summary[f'deepspeed_{rw}_mb_per_s']:.0f} MB/s, "
            f"ratio {summary[f'{rw}_ratio']:.3f} (strata 1MiB_qd16 / deepspeed zero_default "
            f"{summary[f'{rw}_ratio_vs_zero_default']:.3f}, strata 4MiB_qd16 / deepspeed "
            f"zero_default {summary[f'{rw}_ratio_4MiB_vs_zero_default']:.3f})"
        )
    print(json.dumps(summary, separators=(",", ":")))


if __name__ == "__main__":
    main()
