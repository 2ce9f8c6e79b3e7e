#!/usr/bin/env bash
# Kills one rank of a 2-process NCCL job mid-run and checks that the other rank exits with an
# error naming the dead rank within the collective deadline. Run on a machine with 2 GPUs:
#   tools/gpu/kill_rank_test.sh path/to/moeflow
set -u
BIN=${1:-moeflow}
DEADLINE=10
LOG=$(mktemp -d)
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + RANDOM % 10000)) WORLD_SIZE=2
ARGS=(bench --backend cuda --ep 2 --preset olmoe-1b-7b --tokens 64 --min-seconds 600 --min-runs 100000 --timeout $DEADLINE)
RANK=0 LOCAL_RANK=0 "$BIN" "${ARGS[@]}" >"$LOG/r0" 2>&1 &
P0=$!
RANK=1 LOCAL_RANK=1 "$BIN" "${ARGS[@]}" >"$LOG/r1" 2>&1 &
P1=$!
# Wait until rank 0 is in its timing loop (the header line is printed after setup).
for _ in $(seq 1 240); do grep -q "moeflow bench" "$LOG/r0" && break; sleep 0.5; done
sleep 3
kill -9 $P1
KILLED=$(date +%s.%N)
wait $P0
CODE=$?
ELAPSED=$(python3 -c "import time; print(f'{time.time() - $KILLED:.2f}')")
echo "rank 1 killed; rank 0 exited with code $CODE after ${ELAPSED}s (deadline ${DEADLINE}s)"
tail -n 2 "$LOG/r0"
if [ "$CODE" -ne 0 ] && grep -q "rank 1" "$LOG/r0" && python3 -c "import sys; sys.exit(0 if $ELAPSED < $DEADLINE + 5 else 1)"; then
  echo "PASS: the surviving rank failed with an error naming rank 1 within the deadline"
else
  echo "FAIL"; cat "$LOG/r0"; exit 1
fi
