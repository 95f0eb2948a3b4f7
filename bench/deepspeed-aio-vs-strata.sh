#!/bin/bash
# Side-by-side: strata-bench io against DeepSpeed's aio_handle (the libaio engine ZeRO-Infinity
# swaps tensors with), sequential O_DIRECT reads and writes of one whole file, in alternating
# rounds. The file is strata-bench io's own data file, DIR/strata-bench-io-0.dat, laid out by
# `strata-bench io --rw write` and left there. strata-bench reads and writes it with 1 MiB and
# 4 MiB blocks, 16 deep; DeepSpeed with sync_pread / sync_pwrite of one tensor from its own
# new_cpu_locked_tensor (page-aligned, mlock'd: what DeepSpeed treats as pinned, with no bounce
# copy), under two configs: 1 MiB blocks 16 deep, and the ZeRO-Infinity `aio` config defaults
# (1 MiB blocks 8 deep, overlap_events, one thread). Before each pass the file's page cache is
# dropped (posix_fadvise DONTNEED). Prints each round, the medians and the median ratio
# strata/DeepSpeed, then one JSON line (strata_read_mb_per_s, deepspeed_read_mb_per_s,
# read_ratio, the same for writes, and each one's average request at the device, from the sysfs
# counters of the disk holding DIR). MB = 1e6 bytes. The work is in deepspeed_aio_vs_strata.py.
#
# Installs nothing: PYTHON needs torch and deepspeed (`PYTHON -m pip install torch deepspeed`)
# and the machine libaio (`apt-get install libaio-dev`), else this says so and exits 2.
# DeepSpeed builds its async_io op itself on first use (minutes, cached in ~/.cache).
# usage: deepspeed-aio-vs-strata.sh STRATA_BENCH DIR [SIZE=2GiB] [RUNS=3] [PYTHON=.venv/bin/python]
set -u
bench=${1:?strata-bench path}; dir=${2:?directory on the disk to test}
size=${3:-2GiB}; runs=${4:-3}
here=$(cd "$(dirname "$0")" && pwd)
python=${5:-$here/../.venv/bin/python}
[ -x "$bench" ] || { echo "not an executable: $bench"; exit 2; }
[ -x "$python" ] || command -v "$python" >/dev/null ||
  { echo "no Python at $python (give one with torch and deepspeed as the 5th argument)"; exit 2; }
mkdir -p "$dir" || exit 1
exec "$python" "$here/deepspeed_aio_vs_strata.py" "$bench" "$dir" --size "$size" --runs "$runs"
