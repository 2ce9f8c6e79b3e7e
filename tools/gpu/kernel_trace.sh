#!/usr/bin/env bash
# Runs a command with every kernel and copy of its process recorded (tools/gpu/kernel_trace.c),
# then prints the kernels of two late layer calls on each GPU (tools/gpu/kernel_timeline.py).
#   tools/gpu/kernel_trace.sh TRACE_FILE [ANCHOR_KERNEL] -- COMMAND...
# e.g. tools/gpu/kernel_trace.sh /tmp/ep2.trace -- target/release/moeflow bench --backend cuda \
#        --ep 2 --preset deepseek-v3 --tokens 4096
# The trace adds launch overhead: read kernel durations and overlaps from it, not layer times.
set -euo pipefail
trace=$1; shift
anchor=router_partials_tf32_sm90
if [ "$1" != "--" ]; then anchor=$1; shift; fi
shift
here=$(cd "$(dirname "$0")" && pwd)
cuda=${CUDA_HOME:-/usr/local/cuda-13.0}
# CUPTI's headers and library: in the toolkit (extras/CUPTI, or beside the other headers), or
# in PyTorch's CUDA wheels; symbolic links followed, since toolkit folders often are links.
roots=("$cuda" /usr/local/cuda /usr/include /usr/lib/x86_64-linux-gnu "$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null || true)")
find_first() { { find -L "${roots[@]}" -name "$1" 2>/dev/null || true; } | head -1; }
header=$(find_first cupti_activity.h)
library=$(find_first 'libcupti.so*')
if [ -z "$header" ] || [ -z "$library" ]; then
    echo "kernel_trace.sh: CUPTI not found (cupti_activity.h: '${header}', libcupti.so: '${library}') under ${roots[*]}" >&2
    exit 1
fi
inc=$(dirname "$header")
lib=$(dirname "$library")
newest() { grep -o "$1[0-9]*;" "$inc/cupti_activity.h" | tr -d ';' | sort -V | tail -1; }
gcc -O2 -shared -fPIC -DKERNEL_RECORD="$(newest CUpti_ActivityKernel)" -DMEMCPY_RECORD="$(newest CUpti_ActivityMemcpy)" \
    -I"$inc" -I"$cuda/include" "$here/kernel_trace.c" -o /tmp/kernel_trace.so -L"$lib" -lcupti -Wl,-rpath,"$lib"
CUDA_INJECTION64_PATH=/tmp/kernel_trace.so KTRACE_OUT="$trace" "$@"
python3 "$here/kernel_timeline.py" "$trace" "$anchor"
