#!/usr/bin/env bash
# One device call: time the kernel variants, then profile the named cases with
# ncu (needs a machine where ncu reads counters): occupancy, issue rate, each
# pipe's utilisation (tensor, ALU, FMA, LSU, ...), and the executed-instruction
# mix and warp-stall samples per SASS opcode, the most stalled instructions,
# and the SASS table itself (sass_CASE.csv.gz).
#   OUT=dir [VARIANTS=0] bash benchmarks/profile_gpu.sh [case ...]
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1
OUT=${OUT:-/tmp/profile}; mkdir -p "$OUT"
if [ "${VARIANTS:-1}" = 1 ]; then
  python3 benchmarks/profile_paged_attention.py --out "$OUT" 2>&1 | tee "$OUT/variants.txt"
fi
for c in "$@"; do
  timeout 200 ncu --clock-control none -k regex:paged --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section InstructionStats \
    --section Occupancy --section LaunchStats --section SourceCounters \
    --section ComputeWorkloadAnalysis -o "/tmp/rep_$c" -f \
    python3 benchmarks/profile_paged_attention.py --calls 2 --case "$c" > "/tmp/ncu_$c.log" 2>&1
  ncu -i "/tmp/rep_$c.ncu-rep" --print-summary none > "$OUT/ncu_$c.txt" 2>&1
  ncu -i "/tmp/rep_$c.ncu-rep" --print-summary none --print-details all \
    --section WarpStateStats > "$OUT/ncu_stalls_$c.txt" 2>&1
  ncu -i "/tmp/rep_$c.ncu-rep" --print-summary none --print-details all \
    --section ComputeWorkloadAnalysis > "$OUT/ncu_pipes_$c.txt" 2>&1
  ncu -i "/tmp/rep_$c.ncu-rep" --page source --csv --print-source sass > "/tmp/sass_$c.csv" 2>&1
  python3 - "$c" <<'PY' | tee "$OUT/opcodes_$c.txt"
import collections, csv, sys
case = sys.argv[1]
rows = list(csv.reader(open(f"/tmp/sass_{case}.csv")))
top = next(i for i, r in enumerate(rows) if "Source" in r)
head = rows[top]
src, ex = head.index("Source"), head.index("Instructions Executed")
stall = next((i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All")), None)
count, stalls, lines = collections.Counter(), collections.Counter(), []


def num(text):
    return int(float(text.replace(",", "") or 0))


for r in rows[top + 1:]:
    words = r[src].split() if len(r) > max(src, ex) else []
    if words:
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        op = op.split(".")[0]
        count[op] += num(r[ex])
        if stall is not None:
            stalls[op] += num(r[stall])
            lines.append((num(r[stall]), num(r[ex]), r[src].strip()))
total = sum(count.values())
print(f"{case}: {total:,d} warp instructions executed")
for op, n in count.most_common(24):
    print(f"  {op:10s} {n:>13,d} {n / total:6.1%}")
if stall is not None:
    samples = sum(stalls.values()) or 1
    print(f"{case}: {samples:,d} warp-stall samples, by opcode")
    for op, n in stalls.most_common(16):
        print(f"  {op:10s} {n:>10,d} {n / samples:6.1%}")
    print(f"{case}: the 30 SASS instructions with the most stall samples")
    for n, executed, text in sorted(lines, reverse=True)[:30]:
        print(f"  {n / samples:6.1%} {executed:>11,d}  {text}")
PY
  gzip -c "/tmp/sass_$c.csv" > "$OUT/sass_$c.csv.gz"
done
