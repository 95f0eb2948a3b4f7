#!/usr/bin/env bash
# What the model's compute costs on this machine while the disk is being read, measured with a
# reader that is not strata (fio: huge-page buffers, O_DIRECT, io_uring, 4 MiB blocks, qd 8),
# next to the arithmetic limit of what prefetch can gain. Perfect overlap reads the whole model
# while the compute runs: a machine whose compute slows down under that reading cannot reach
# roofline 1 whatever the scheduler does. Prints one JSON line.
#   bench/compute-under-io.sh [build dir] [model] [device budget] [host budget]
# It runs stream_inference twice (prefetch auto): alone, then with fio reading the same file in
# the background (at the device's limit, or at RATE, fio's syntax: RATE=1000m), and reports
#   compute_s, transfer_s, step_s, roofline   stream_inference alone
#   compute_under_io_s, compute_slowdown      compute_s while fio reads, and its ratio to alone
#   fio_read_gbps, fio_cpu_percent            what fio read meanwhile, and fio's own CPU
#   speedup_limit = (compute_s + transfer_s) / max(compute_s, transfer_s)
#       the most prefetch can gain over an on-demand pass that costs compute plus transfer,
#       reached only at roofline 1
#   roofline_for_1_6x = 1.6 * max(compute_s, transfer_s) / (compute_s + transfer_s)
#       the roofline a 1.6x gain over such an on-demand pass needs
# OPENBLAS_NUM_THREADS (default 2), OPENBLAS_THREAD_TIMEOUT (default 4) and PASSES (default 5)
# are passed through, as in bench/stream-inference-table.sh. Huge pages for fio are reserved
# through vm.nr_hugepages and the old value is restored on exit (root needed); exit 2 names what
# is missing.
set -euo pipefail
build=${1:-build}
model=${2:-/var/tmp/strata-si-4096.safetensors}
device=${3:-128MiB}
host=${4:-128MiB}
bin="$build/examples/stream_inference"
[ -x "$bin" ] || { echo "no $bin: build first" >&2; exit 2; }
command -v fio >/dev/null || { echo "fio is not installed (apt-get install fio)" >&2; exit 2; }
[ -f "$model" ] || "$bin" --generate "$model" --layers 16 --hidden 4096 --dtype bf16 >&2
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-2}
export OPENBLAS_THREAD_TIMEOUT=${OPENBLAS_THREAD_TIMEOUT-4}
passes=${PASSES:-5}
run() {
  "$bin" --model "$model" --batch 4 --device-budget "$device" --host-budget "$host" \
    --prefetch auto --passes "$passes" --json
}

hp=/proc/sys/vm/nr_hugepages
old_hp=$(cat "$hp")
fio_pid=
cleanup() {
  [ -z "$fio_pid" ] || kill "$fio_pid" 2>/dev/null || true
  echo "$old_hp" >"$hp" 2>/dev/null || true
}
trap cleanup EXIT
# fio's buffers: 8 blocks of 4 MiB in 2 MiB pages, and some slack.
echo $((old_hp + 24)) >"$hp" 2>/dev/null || { echo "cannot raise $hp (not root?)" >&2; exit 2; }

alone=$(run)
rate=()
[ -z "${RATE:-}" ] || rate=(--rate="$RATE")

fio_out=$(mktemp)
fio --name=reader --filename="$model" --rw=read --direct=1 --bs=4M --iodepth=8 \
  --ioengine=io_uring --iomem=shmhuge --time_based --runtime=600 "${rate[@]}" \
  --output-format=json --output="$fio_out" &
fio_pid=$!
sleep 1
# A roofline this run refuses (its passes saw different machines) still names compute_s.
under=$(run 2>&1 || true)
kill -INT "$fio_pid"
wait "$fio_pid" || true
fio_pid=

python3 - "$alone" "$under" "$fio_out" <<'EOF'
import json, re, sys
alone = json.loads(sys.argv[1])
text = sys.argv[2]
try:
    under_c = json.loads(text)["compute_s"]
except ValueError:
    under_c = float(re.search(r"compute_s[ =:]+([0-9.]+)", text).group(1))
raw = open(sys.argv[3]).read()  # fio writes "terminating on signal" ahead of the JSON
job = json.loads(raw[raw.index("{"):])["jobs"][0]
runtime_s = max(job["read"]["runtime"], 1) / 1000.0
c, t = alone["compute_s"], alone["transfer_s"]
print(json.dumps({
    "model_bytes": alone["model_bytes"], "device_budget": alone["device_budget"],
    "blas_threads": alone["blas_threads"], "passes": alone["passes"],
    "compute_s": c, "transfer_s": t, "step_s": alone["step_s"], "roofline": alone["roofline"],
    "compute_under_io_s": under_c, "compute_slowdown": under_c / c,
    "fio_read_gbps": job["read"]["io_bytes"] / runtime_s / 1e9,
    "fio_cpu_percent": job["usr_cpu"] + job["sys_cpu"],
    "speedup_limit": (c + t) / max(c, t),
    "roofline_for_1_6x": 1.6 * max(c, t) / (c + t),
}, sort_keys=True))
EOF
rm -f "$fio_out"
