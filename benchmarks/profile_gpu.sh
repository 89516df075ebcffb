#!/usr/bin/env bash
# One device call: time the kernel variants, dump the compiled fp8 kernels'
# SASS and instruction mix, and (where ncu can read counters) profile cases.
#   OUT=dir bash benchmarks/profile_gpu.sh [case ...]   (cases to profile with ncu)
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1
OUT=${OUT:-/tmp/profile}; mkdir -p "$OUT"
python3 benchmarks/profile_paged_attention.py --out "$OUT" 2>&1 | tee "$OUT/variants.txt"
# Compiler dump of decode/verify, bf16 and fp8, row-major and transposed V.
DUMP=/tmp/xla_dump; rm -rf $DUMP
XLA_FLAGS="--xla_dump_to=$DUMP" python3 benchmarks/profile_paged_attention.py --calls 1 \
  --case bf16_q1 fp8_q1 fp8_q8 fp8_q1_vt fp8_q8_vt > /dev/null 2>&1
mkdir -p /tmp/sass
for ptx in $(grep -l "paged_attention" $DUMP/*.ptx 2>/dev/null); do
  base=$(basename "$ptx" .ptx)
  ptxas -arch=sm_90a "$ptx" -o /tmp/sass/$base.cubin 2>/dev/null && \
    cuobjdump --dump-sass /tmp/sass/$base.cubin > /tmp/sass/$base.sass
done
python3 - <<'PY' | tee "$OUT/sass_mix.txt"
import collections, glob, re
for f in sorted(glob.glob("/tmp/sass/*.sass")):
    text = open(f).read()
    for fn in re.split(r"\n\s*Function : ", text)[1:]:
        name = fn.split("\n", 1)[0]
        if "paged" not in name: continue
        ops = collections.Counter(m.group(1).split(".")[0] for m in
                                  re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", fn))
        full = collections.Counter(m.group(1) for m in
                                   re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", fn))
        print(f"== {name} total {sum(ops.values())}")
        print("  ", dict(ops.most_common(30)))
        print("   LDS/F2FP/HMMA variants:", {k: v for k, v in full.items()
              if k.startswith(("LDS", "LDSM", "F2FP", "HMMA", "LDG", "LDGSTS", "F2F", "I2F", "PRMT"))})
PY
tar czf "$OUT/sass.tgz" -C /tmp sass 2>/dev/null
for c in "$@"; do
  timeout 240 ncu --clock-control none -k regex:paged --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
    --section InstructionStats --section Occupancy --section LaunchStats \
    python3 benchmarks/profile_paged_attention.py --calls 2 --case "$c" > "$OUT/ncu_$c.txt" 2>&1
  tail -3 "$OUT/ncu_$c.txt"
done
