#!/usr/bin/env bash
# Prints the SM cycles and the time of each of COUNT launches of the kernels whose names match
# REGEX, after SKIP of them, in a command run under Nsight Compute (clocks left alone). A kernel
# bound by its SMs takes about the same cycles whatever clock the power cap gives it, so two
# builds compare to within a few tenths of a percent where their times move by several percent
# from run to run. Kernels run one at a time under ncu: read each alone, not the layer.
#   tools/gpu/kernel_cycles.sh REGEX SKIP COUNT -- COMMAND...
# e.g. the W8A8 layer's four fp8 GEMMs (shared expert up and down, routed up and down) of its
# second call:
#   tools/gpu/kernel_cycles.sh 'grouped_gemm_fp8_sm90$' 4 4 -- moeflow bench --backend cuda \
#       --preset deepseek-v3 --experts 64 --dtype f8e4m3 --quant fp8-block --tokens 4096 \
#       --min-runs 2 --min-seconds 0
# A kernel variant compiled in with a macro runs through MOEFLOW_NVRTC_OPTIONS='-DNAME' on the
# same binary.
set -euo pipefail
if [ $# -lt 5 ] || [ "$4" != "--" ]; then
    sed -n '2,14p' "$0" >&2
    exit 2
fi
regex=$1 skip=$2 count=$3
shift 4
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)
if [ -z "$ncu" ]; then
    echo "kernel_cycles.sh: ncu (Nsight Compute) not found" >&2
    exit 1
fi
"$ncu" --clock-control none -k "regex:$regex" --launch-skip "$skip" --launch-count "$count" \
    --metrics gpc__cycles_elapsed.max,gpu__time_duration.sum --csv "$@" 2>/dev/null | python3 -c '
import csv, sys
rows = [r for r in csv.reader(sys.stdin) if len(r) > 10]
if not rows:
    sys.exit("kernel_cycles.sh: no launch profiled (is the regex right, and the GPU readable by ncu?)")
head = rows[0]
launch, name, metric, value = (head.index(c) for c in ("ID", "Kernel Name", "Metric Name", "Metric Value"))
got = {}
for r in rows[1:]:
    got.setdefault(int(r[launch]), [r[name], {}])[1][r[metric]] = float(r[value].replace(",", ""))
for i, (kernel, m) in sorted(got.items()):
    cycles, ns = m["gpc__cycles_elapsed.max"], m["gpu__time_duration.sum"]
    print(f"{i:3} {kernel[:40]:40} {cycles / 1e3:10.0f} k cycles {ns / 1e3:9.1f} us")
'
