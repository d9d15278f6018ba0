#!/usr/bin/env bash
# Run the kvmapd image's sidecar as the kubelet would, and probe it. Started by
# build-and-check.sh inside `unshare --mount --net --pid --fork`: the mounts and
# the network (loopback plus the pod IP) are this namespace's only.
#   pod-check.sh SETUP serve   kvmapd serve with the manifest's args; the gRPC
#                              probes as the kubelet runs them, /metrics, the
#                              Unix socket as vLLM's uid, SIGTERM -> exit 0
#   pod-check.sh SETUP demo    kvmapd demo in the same sandbox; its stand-in
#                              workers import torch from $HARNESS, mounted
#                              read-only at /mnt (the image has no torch)
# SETUP is the output of `python -m kvmap.tools.image_check pod-script`.
set -euo pipefail
SETUP=$1 MODE=$2
HERE=$(dirname "$SETUP")
GRPCURL=$HERE/grpcurl
# shellcheck source=/dev/null
source "$SETUP"

fail() { echo "pod-check: FAIL: $*" >&2; [ -f "$HERE/kvmapd.log" ] && tail -20 "$HERE/kvmapd.log" >&2; exit 1; }

health() {  # health PORT SERVICE -> prints the status (SERVING, NOT_SERVING, or an error)
  "$GRPCURL" -plaintext -connect-timeout 2 -max-time 2 -d "{\"service\":\"$2\"}" \
    "$POD_IP:$1" grpc.health.v1.Health/Check 2>&1 | tr -d '\n' || true
}

probe() {  # probe "NAME PORT PERIOD FAILURES SERVICE": as the kubelet, up to FAILURES periods
  local name port period failures service out n
  read -r name port period failures service <<<"$1"
  for ((n = 1; n <= failures; n++)); do
    out=$(health "$port" "${service:-}")
    if [[ $out == *'"SERVING"'* ]]; then
      echo "pod-check: $name grpc :$port service '${service:-}' SERVING (attempt $n)"; return 0
    fi
    kill -0 "$PID" 2>/dev/null || fail "kvmapd exited before $name passed"
    sleep "$period"
  done
  fail "$name on :$port service '${service:-}' never SERVING: $out"
}

serve() {
  pod_exec "${ENTRY[@]}" >"$HERE/kvmapd.log" 2>&1 &  # a subshell that execs kvmapd
  PID=$!
  echo "pod-check: ${ENTRY[*]} as $(grep -o 'userspec=[0-9:]*' "$SETUP") (pid $PID)"
  for p in "${PROBES[@]}"; do probe "$p"; done
  # To a file first: `curl | grep -q` fails under pipefail when grep stops reading early.
  curl -sf -o "$HERE/metrics.txt" "http://$POD_IP:$METRICS_PORT/metrics" \
    || fail "http://$POD_IP:$METRICS_PORT/metrics does not answer"
  grep -q '^kvmap_' "$HERE/metrics.txt" || fail "no kvmap_ series on :$METRICS_PORT/metrics"
  echo "pod-check: /metrics on $POD_IP:$METRICS_PORT serves kvmap_ series"
  local mode
  mode=$(stat -c '%a %g' "$SOCKET_HOST") || fail "no socket at $SOCKET_HOST"
  echo "pod-check: socket $(basename "$SOCKET_HOST") mode/group $mode"
  # vLLM's uid reaches the socket through the pod's fsGroup, and only through it.
  setpriv --reuid="$PEER_UID" --regid="$PEER_GID" --groups="$PEER_GROUPS" \
    "$GRPCURL" -plaintext -unix "$SOCKET_HOST" list >"$HERE/peer.txt" 2>&1 \
    || fail "uid $PEER_UID (groups $PEER_GROUPS) cannot use the socket: $(cat "$HERE/peer.txt")"
  if setpriv --reuid="$PEER_UID" --regid="$PEER_GID" --clear-groups \
    "$GRPCURL" -plaintext -unix "$SOCKET_HOST" list >/dev/null 2>&1; then
    fail "uid $PEER_UID without the fsGroup can use the socket (mode $mode)"
  fi
  echo "pod-check: uid $PEER_UID with groups $PEER_GROUPS lists $(wc -l <"$HERE/peer.txt") services on the socket; without them it is refused"
  [ -n "$(ls -A "$STATE_HOST")" ] || fail "nothing in state_dir ($STATE_HOST)"
  echo "pod-check: state_dir holds $(ls "$STATE_HOST" | tr '\n' ' ')"
  kill -TERM "$PID"
  local rc=0
  timeout "$GRACE_S" tail --pid="$PID" -f /dev/null || fail "no exit within ${GRACE_S}s of SIGTERM"
  wait "$PID" || rc=$?
  [ "$rc" = 0 ] || fail "exit status $rc after SIGTERM"
  grep -q kvmapd_stopped "$HERE/kvmapd.log" || fail "no kvmapd_stopped log line"
  echo "pod-check: SIGTERM -> kvmapd_stopped, exit 0"
  if grep -qiE 'read-only file system|permission denied' "$HERE/kvmapd.log"; then
    fail "the daemon hit a read-only or forbidden path"
  fi
}

demo() {
  [ -d "$ROOT/mnt" ] && [ -d "${HARNESS:-}" ] || fail "no /mnt in the image or no \$HARNESS"
  mount --bind "$HARNESS" "$ROOT/mnt"; mount -o remount,bind,ro "$ROOT/mnt"
  (pod_exec env PYTHONPATH=/mnt "${ENTRY[0]}" demo) >"$HERE/demo.log" 2>&1 \
    || { cat "$HERE/demo.log"; fail "kvmapd demo failed"; }
  tail -5 "$HERE/demo.log"
  echo "pod-check: kvmapd demo passed as $(grep -o 'userspec=[0-9:]*' "$SETUP")"
}

"$MODE"
