#!/usr/bin/env bash
# The streamed-inference table: stream_inference on generated 16-layer bf16 models (32 MiB and
# 8 MiB layers) at two device budgets each (one that holds two layers and one that does not),
# prefetch auto against none, one JSON line per run, then the rows as a markdown table.
#   bench/stream-inference-table.sh [build dir] [model dir]
# OPENBLAS_NUM_THREADS (default 2), OPENBLAS_THREAD_TIMEOUT (default 4: OpenBLAS's idle
# threads sleep at once instead of spinning on the cores strata's threads need) and PASSES
# (default 5) are passed through; OPENBLAS_THREAD_TIMEOUT= (empty) keeps OpenBLAS's own spin.
set -euo pipefail
build=${1:-build}
dir=${2:-/var/tmp}
bin="$build/examples/stream_inference"
[ -x "$bin" ] || { echo "no $bin: build first" >&2; exit 1; }
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-2}
export OPENBLAS_THREAD_TIMEOUT=${OPENBLAS_THREAD_TIMEOUT-4}
passes=${PASSES:-5}
rows=()
for spec in "4096 64MiB 128MiB" "4096 128MiB 128MiB" "2048 16MiB 64MiB" "2048 32MiB 64MiB"; do
  read -r hidden device host <<<"$spec"
  model="$dir/strata-si-$hidden.safetensors"
  [ -f "$model" ] || "$bin" --generate "$model" --layers 16 --hidden "$hidden" --dtype bf16 >&2
  for prefetch in auto none; do
    # A roofline above 1.02 (the machine's speed moved between the measuring passes) is refused
    # by stream_inference with exit 1: the row says so and the table goes on.
    if ! json=$("$bin" --model "$model" --batch 4 --device-budget "$device" --host-budget "$host" \
      --prefetch "$prefetch" --passes "$passes" --json); then
      rows+=("| $((hidden * hidden * 2 / 1048576)) MiB | $device | $prefetch | refused (see above) | | | | |")
      continue
    fi
    echo "$json"
    rows+=("$(python3 -c '
import json, sys
d = json.loads(sys.argv[1])
layer = d["model_bytes"] / d["layers"] / 2**20
print("| %.0f MiB | %s | %s | %.3f | %.3f | %.3f | %.2f | %.2f |" % (layer, sys.argv[2], d["prefetch"],
      d["compute_s"], d["transfer_s"], d["step_s"], d["roofline"], d["cpu_steal_s"]))
' "$json" "$device")")
  done
done
echo "| layer | device budget | prefetch | compute_s | transfer_s | step_s | roofline | cpu_steal_s |"
echo "|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
