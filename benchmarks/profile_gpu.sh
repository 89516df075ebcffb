#!/usr/bin/env bash
# One device call: time the kernel variants, then profile the named cases with
# ncu (needs a machine where ncu reads counters): occupancy, issue rate, and the
# executed-instruction mix per SASS opcode.
#   OUT=dir bash benchmarks/profile_gpu.sh [case ...]
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1
OUT=${OUT:-/tmp/profile}; mkdir -p "$OUT"
python3 benchmarks/profile_paged_attention.py --out "$OUT" 2>&1 | tee "$OUT/variants.txt"
for c in "$@"; do
  timeout 200 ncu --clock-control none -k regex:paged --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section InstructionStats \
    --section Occupancy --section LaunchStats --section SourceCounters -o "/tmp/rep_$c" -f \
    python3 benchmarks/profile_paged_attention.py --calls 2 --case "$c" > "/tmp/ncu_$c.log" 2>&1
  ncu -i "/tmp/rep_$c.ncu-rep" --print-summary none > "$OUT/ncu_$c.txt" 2>&1
  ncu -i "/tmp/rep_$c.ncu-rep" --page source --csv --print-source sass > "/tmp/sass_$c.csv" 2>&1
  python3 - "$c" <<'PY' | tee "$OUT/opcodes_$c.txt"
import collections, csv, sys
case = sys.argv[1]
rows = list(csv.reader(open(f"/tmp/sass_{case}.csv")))
top = next(i for i, r in enumerate(rows) if "Source" in r)
src, ex = rows[top].index("Source"), rows[top].index("Instructions Executed")
count = collections.Counter()
for r in rows[top + 1:]:
    words = r[src].split() if len(r) > max(src, ex) else []
    if words:
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        count[op.split(".")[0]] += int(float(r[ex].replace(",", "") or 0))
total = sum(count.values())
print(f"{case}: {total:,d} warp instructions executed")
for op, n in count.most_common(24):
    print(f"  {op:10s} {n:>13,d} {n / total:6.1%}")
PY
done
