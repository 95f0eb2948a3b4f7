#!/bin/bash
# Side-by-side: strata-bench io with the POSIX engine (T threads of pread/pwrite) against
# fio --ioengine=psync --numjobs=T on the same directory, each job on its own 1/T of the file,
# in alternating runs; prints each pair and the median ratio. Both work on laid-out files, as
# strata-bench io does: fio --overwrite=1 writes its file in full before a write job when it is
# missing or too small (by default fio would only fallocate it, and its first write run would pay
# for converting unwritten extents), and fio's default invalidate=1 drops the file's page cache
# with POSIX_FADV_DONTNEED before the job, as strata-bench io does.
# usage: posix-vs-fio.sh STRATA_BENCH DIR [RW=read] [BS=1M] [THREADS=4] [SIZE=2G] [RUNS=3]
set -u
bench=${1:?strata-bench path}; dir=${2:?directory on the disk to test}
rw=${3:-read}; bs=${4:-1M}; threads=${5:-4}; size=${6:-2G}; runs=${7:-3}
command -v fio >/dev/null || { echo "fio is not installed (apt-get install fio)"; exit 2; }
mkdir -p "$dir"
bytes=$(numfmt --from=iec "$size")
part=$((bytes / threads))
ratios=()
for i in $(seq "$runs"); do
  s=$("$bench" io --rw "$rw" --bs "$bs" --qd "$threads" --threads "$threads" --size "$size" \
        --path "$dir" --engine posix --direct 1 --json |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["mb_per_s"])') || exit 1
  f=$(fio --name=x --directory="$dir" --filename=fio.dat --size="$part" --offset_increment="$part" \
        --numjobs="$threads" --group_reporting --rw="$rw" --bs="$bs" --ioengine=psync --direct=1 \
        --overwrite=1 --minimal 2>/dev/null | awk -F';' -v rw="$rw" '{print (rw ~ /read/) ? $7*1.024/1000 : $48*1.024/1000}')
  r=$(python3 -c "print(round(float('$s')/float('$f'), 3))")
  echo "run $i: strata posix $s MB/s, fio psync x$threads $f MB/s, ratio $r"
  ratios+=("$r")
done
rm -f "$dir/fio.dat"
echo "median ratio: $(printf '%s\n' "${ratios[@]}" | sort -g | sed -n "$(( (runs + 1) / 2 ))p")"
