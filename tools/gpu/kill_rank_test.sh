#!/usr/bin/env bash
# Kills one rank of a 2-process NCCL job mid-run and checks that the other rank exits with an
# error naming the dead rank within the collective deadline. Run on a machine with 2 GPUs:
#   tools/gpu/kill_rank_test.sh path/to/moeflow
set -u
BIN=${1:-moeflow}
DEADLINE=10
LOG=$(mktemp -d)
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + RANDOM % 10000)) WORLD_SIZE=2
ARGS=(bench --backend cuda --ep 2 --preset olmoe-1b-7b --tokens 64 --min-seconds 600 --min-runs 100000 --timeout $DEADLINE -v)
RANK=0 LOCAL_RANK=0 "$BIN" "${ARGS[@]}" >"$LOG/r0" 2>&1 &
P0=$!
RANK=1 LOCAL_RANK=1 "$BIN" "${ARGS[@]}" >"$LOG/r1" 2>&1 &
P1=$!
# Wait until both ranks have joined (rank 0 logs it with -v; its header line comes before the
# rendezvous), then give the layers time to be built and the timing loop to start.
for _ in $(seq 1 240); do grep -q "all 2 ranks joined" "$LOG/r0" && break; sleep 0.5; done
sleep 5
kill -9 $P1
KILLED=$(date +%s.%N)
wait $P0
CODE=$?
ELAPSED=$(python3 -c "import time; print(f'{time.time() - $KILLED:.2f}')")
echo "rank 1 killed; rank 0 exited with code $CODE after ${ELAPSED}s (deadline ${DEADLINE}s)"
# The error lines alone: the debug log names rank 1 anyway.
ERRORS=$(grep "^error" "$LOG/r0")
echo "$ERRORS"
if [ "$CODE" -ne 0 ] && echo "$ERRORS" | grep -q "rank 1" && python3 -c "import sys; sys.exit(0 if $ELAPSED < $DEADLINE + 5 else 1)"; then
  echo "PASS: the surviving rank failed with an error naming rank 1 within the deadline"
else
  echo "FAIL"; tail -n 20 "$LOG/r0"; exit 1
fi
