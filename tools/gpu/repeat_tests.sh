#!/usr/bin/env bash
# Runs a test binary many times and counts the runs that fail, for crashes that come once in
# tens of runs. Every run is under the
# SIGSEGV backtrace shim (`tools/segv_backtrace.c`, built here unless SHIM names a built one);
# the output of each failed run is kept.
#   tools/gpu/repeat_tests.sh RUNS OUT_DIR TEST_BINARY [TEST ARGS...]
# e.g. tools/gpu/repeat_tests.sh 40 /tmp/fails target/release/deps/cuda-<hash>
set -u
RUNS=$1 OUT=$2
shift 2
HERE=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
if [ -z "${SHIM:-}" ]; then
    SHIM="$OUT/segv_backtrace.so"
    gcc -O1 -shared -fPIC -o "$SHIM" "$HERE/segv_backtrace.c" -ldl || exit 1
fi
bad=0
for i in $(seq 1 "$RUNS"); do
    if ! LD_PRELOAD="$SHIM" timeout 300 "$@" >"$OUT/run.txt" 2>&1; then
        bad=$((bad + 1))
        mv "$OUT/run.txt" "$OUT/failed-$i.txt"
        grep -E "SIGSEGV|panicked" "$OUT/failed-$i.txt" | head -2
    fi
done
rm -f "$OUT/run.txt"
echo "$bad of $RUNS runs failed ($*)"
[ "$bad" -eq 0 ]
