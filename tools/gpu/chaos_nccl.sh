#!/usr/bin/env bash
# Chaos on the network edges of a 2-process NCCL job (one rank per GPU; needs 2 GPUs), the
# GPU counterpart of crates/moeflow-cli/tests/chaos.rs:
#   strangers    garbage, half-open and slow connections on rank 0's rendezvous port during
#                the rendezvous and the run: the job completes and its check passes
#   rendezvous   rank 1 killed before it joined: rank 0 fails at its deadline naming rank 1
#   nccl-init    rank 1 killed as soon as it joined (NCCL initialisation): rank 0 fails naming rank 1
#   mid-layer    rank 1 killed while the ranks run the layer: rank 0 fails naming rank 1
#   graph        rank 1 killed 0.5 s, 1.5 s and 3 s after joining a low-latency job (NCCL init,
#                layer build, CUDA graph capture, first replays): rank 0 fails naming rank 1
#   stop         rank 1 stopped (SIGSTOP) past the deadline, then resumed: both fail, naming the other
#   collide      two jobs on one port: the second's rank 0 cannot listen, its rank 1 is refused
#                (job mismatch), the first completes
#   duplicate    a second rank 1 started while the job runs is refused (rank taken); the job completes
# Every survivor must end within its deadline (plus slack); no process is left behind.
# Usage: tools/gpu/chaos_nccl.sh target/release/moeflow [case ...]
# (BACKEND=cpu runs the same cases on CPU ranks over TCP, without GPUs.)
set -u
BIN=$(realpath "${1:?usage: chaos_nccl.sh path/to/moeflow [case ...]}")
shift
CASES=${*:-strangers rendezvous nccl-init mid-layer graph stop collide duplicate}
BACKEND=${BACKEND:-cuda}
DEADLINE=10
SLACK=10
LOG=$(mktemp -d)
PIDS=()
RANKS=()
FAILS=0
SUMMARY=()
export MASTER_ADDR=127.0.0.1
LAYER=(--preset olmoe-1b-7b --experts 8 --tokens 64 --backend "$BACKEND" --ep 2 --timeout $DEADLINE)

# kill9 PID: kills a process this script started and reaps it quietly.
kill9() { { kill -9 "$1" && wait "$1"; } 2>/dev/null; }
cleanup() { for p in "${PIDS[@]}"; do kill9 "$p"; done; }
trap cleanup EXIT

port() { echo $((20000 + RANDOM % 12000)); }

# start NAME RANK WORLD PORT JOB COMMAND...: starts a rank in the background, its PID in $PID.
start() {
  local name=$1 rank=$2 world=$3 port=$4 job=$5
  shift 5
  : >"$LOG/$name"
  RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=$world MASTER_PORT=$port MOEFLOW_JOB=$job \
    "$BIN" --verbose "$@" >"$LOG/$name" 2>&1 &
  PID=$!
  PIDS+=("$PID")
  RANKS+=("$PID")
}

# wait_log NAME NEEDLE SECONDS: waits until the log of NAME contains NEEDLE.
wait_log() {
  local i
  for i in $(seq 1 $(($3 * 10))); do grep -q -- "$2" "$LOG/$1" && return 0; sleep 0.1; done
  echo "  $1 never printed '$2'"; return 1
}

# ends NAME PID SECONDS: waits up to SECONDS for PID to exit; sets CODE (124: still running,
# then killed) and ELAPSED.
ends() {
  local t0 i
  t0=$(date +%s.%N)
  CODE=124
  for i in $(seq 1 $(($3 * 10))); do
    if ! kill -0 "$2" 2>/dev/null; then wait "$2"; CODE=$?; break; fi
    sleep 0.1
  done
  [ "$CODE" = 124 ] && { kill9 "$2"; echo "  $1 still running after $3 s: killed"; }
  ELAPSED=$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")
}

# fails NAME PID SECONDS NEEDLE...: NAME must exit non-zero within SECONDS, its error
# containing every NEEDLE.
fails() {
  local name=$1 pid=$2 secs=$3 n ok=1
  shift 3
  ends "$name" "$pid" "$secs"
  [ "$CODE" != 0 ] && [ "$CODE" != 124 ] || ok=0
  for n in "$@"; do grep "^error:" "$LOG/$name" | grep -q -- "$n" || ok=0; done
  echo "  $name: exit $CODE after ${ELAPSED}s: $(grep "^error:" "$LOG/$name" | head -1)"
  [ $ok = 1 ] || { echo "  expected a failure naming: $*"; tail -n 20 "$LOG/$name"; return 1; }
}

# completes NAME PID SECONDS: NAME must exit 0 within SECONDS with its check passed.
completes() {
  ends "$1" "$2" "$3"
  echo "  $1: exit $CODE after ${ELAPSED}s"
  [ "$CODE" = 0 ] && grep -q "check           OK" "$LOG/$1" || { tail -n 20 "$LOG/$1"; return 1; }
}

# strangers PORT SECONDS: garbage, half-open and slow connections on PORT for SECONDS.
strangers() {
  python3 - "$1" "$2" <<'EOF' &
import socket, sys, threading, time
port, until = int(sys.argv[1]), time.time() + float(sys.argv[2])
held = []
def slow():
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=1)
        for b in b"fe" b"om" b"R\x01":
            s.send(bytes([b])); time.sleep(0.3)
    except OSError:
        pass
while time.time() < until:
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=1); s.send(b"GET / HTTP/1.1\r\n\r\n\xff"); s.close()
        if len(held) < 40: held.append(socket.create_connection(("127.0.0.1", port), timeout=1))
        threading.Thread(target=slow, daemon=True).start()
    except OSError:
        pass
    time.sleep(0.05)
EOF
  PIDS+=("$!")
  disown "$!"
}

case_strangers() {
  local p; p=$(port)
  strangers "$p" 60
  start r0 0 2 "$p" chaos-s demo "${LAYER[@]}" --runs 20; local p0=$PID
  sleep 3
  start r1 1 2 "$p" chaos-s demo "${LAYER[@]}" --runs 20; local p1=$PID
  completes r0 $p0 180 && completes r1 $p1 $SLACK && grep -q "rendezvous port $p: closed a connection" "$LOG/r0"
}

case_rendezvous() {
  local p; p=$(port)
  start r1 1 2 "$p" chaos-r demo "${LAYER[@]}" --runs 1; local p1=$PID
  sleep 1; kill9 $p1
  start r0 0 2 "$p" chaos-r demo "${LAYER[@]}" --runs 1; local p0=$PID
  fails r0 $p0 $((120 + DEADLINE + SLACK)) "rank 0 during rendezvous" "ranks \[1\] never joined"
}

case_nccl_init() {
  local p; p=$(port)
  start r0 0 2 "$p" chaos-i demo "${LAYER[@]}" --runs 1; local p0=$PID
  start r1 1 2 "$p" chaos-i demo "${LAYER[@]}" --runs 1; local p1=$PID
  wait_log r1 "rank 1: joined job" 120 && kill9 $p1
  fails r0 $p0 $((DEADLINE + SLACK)) "rank 1"
}

case_mid_layer() {
  local p; p=$(port)
  local args=(bench "${LAYER[@]}" --min-seconds 600 --min-runs 100000)
  start r0 0 2 "$p" chaos-m "${args[@]}"; local p0=$PID
  start r1 1 2 "$p" chaos-m "${args[@]}"; local p1=$PID
  wait_log r0 "moeflow bench" 180 && sleep 5 && kill9 $p1
  fails r0 $p0 $((DEADLINE + SLACK)) "rank 1"
}

case_graph() {
  local d ok=0
  for d in 0.5 1.5 3; do
    local p; p=$(port)
    start r0 0 2 "$p" chaos-g demo "${LAYER[@]}" --strategy lowlatency --runs 100000; local p0=$PID
    start r1 1 2 "$p" chaos-g demo "${LAYER[@]}" --strategy lowlatency --runs 100000; local p1=$PID
    echo "  killing rank 1 ${d}s after it joined"
    wait_log r1 "rank 1: joined job" 120 && sleep "$d" && kill9 $p1
    fails r0 $p0 $((DEADLINE + SLACK)) "rank 1" || ok=1
  done
  return $ok
}

case_stop() {
  local p; p=$(port)
  local args=(bench "${LAYER[@]}" --min-seconds 600 --min-runs 100000)
  start r0 0 2 "$p" chaos-t "${args[@]}"; local p0=$PID
  start r1 1 2 "$p" chaos-t "${args[@]}"; local p1=$PID
  wait_log r0 "moeflow bench" 180 || return 1
  sleep 3
  kill -STOP $p1
  fails r0 $p0 $((DEADLINE + SLACK)) "rank 1" || { kill -CONT $p1; kill9 $p1; return 1; }
  sleep 2
  kill -CONT $p1
  fails r1 $p1 $SLACK "rank 0"
}

case_collide() {
  local p; p=$(port)
  start a0 0 2 "$p" job-a demo "${LAYER[@]}" --runs 5; local a0=$PID
  wait_log a0 "rendezvous of 2 ranks listening" 120 || return 1
  start b0 0 2 "$p" job-b demo "${LAYER[@]}" --runs 5; local b0=$PID
  start b1 1 2 "$p" job-b demo "${LAYER[@]}" --runs 5; local b1=$PID
  fails b0 $b0 120 "listening on 127.0.0.1:$p" && fails b1 $b1 120 "job mismatch" || return 1
  start a1 1 2 "$p" job-a demo "${LAYER[@]}" --runs 5; local a1=$PID
  completes a0 $a0 180 && completes a1 $a1 $SLACK
}

case_duplicate() {
  local p; p=$(port)
  local args=(bench "${LAYER[@]}" --min-seconds 30 --min-runs 10)
  start r0 0 2 "$p" chaos-d "${args[@]}"; local p0=$PID
  start r1 1 2 "$p" chaos-d "${args[@]}"; local p1=$PID
  wait_log r0 "moeflow bench" 180 || return 1
  start dup 1 2 "$p" chaos-d demo "${LAYER[@]}" --runs 1; local pd=$PID
  fails dup $pd 120 "rank 1 is already taken" || return 1
  ends r0 $p0 180; local c0=$CODE
  ends r1 $p1 $SLACK; local c1=$CODE
  echo "  the job's ranks exited with $c0 and $c1"
  [ "$c0" = 0 ] && [ "$c1" = 0 ]
}

for c in $CASES; do
  echo "== $c"
  rm -f "$LOG"/*
  PIDS=()
  RANKS=()
  if "case_${c//-/_}"; then r=PASS; else r=FAIL; FAILS=$((FAILS + 1)); fi
  for p in "${RANKS[@]}"; do
    if kill -0 "$p" 2>/dev/null; then echo "  rank process $p left behind"; r=FAIL; FAILS=$((FAILS + 1)); fi
  done
  cleanup
  SUMMARY+=("$r $c")
  echo "$r $c"
done
echo "== summary ($BACKEND)"
printf '%s\n' "${SUMMARY[@]}"
[ $FAILS = 0 ] && echo "all cases passed" || { echo "$FAILS case(s) failed; logs in $LOG"; exit 1; }
