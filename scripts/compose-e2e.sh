#!/usr/bin/env bash
# End-to-end test of docker-compose hosting, as a user would run it: build the image, bring up a
# bootstrap peer, TRAINERS trainers and the monitor, wait until every container is healthy and the
# trainers report completed rounds through the health API, check `phalanx health` against the
# swarm, then tear everything down (containers, network, volumes, the copied wheel).
#
#   scripts/compose-e2e.sh                  TRAINERS=2, a local Debian base image, torch's CPU wheel
#   BASE_IMAGE=python:3.11-slim scripts/compose-e2e.sh     when a registry is reachable
#
# Starts dockerd itself (and stops it again) when none is running and it runs as root. Without
# BASE_IMAGE it builds a Debian bookworm base with debootstrap (../shared/tools/docker-base-image.sh
# when present, else scripts/docker-base-image.sh). torch's CPU wheel is taken from pip's
# configured find-links when there (TORCH_WHEEL=path to choose one), so the image never pulls CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
PROJECT=${COMPOSE_PROJECT:-phalanx-e2e}
IMAGE=${PHALANX_IMAGE:-phalanx:e2e}
TRAINERS=${TRAINERS:-2}
WAIT_S=${WAIT_S:-300}
PYTHON=${PYTHON:-python3}
log() { echo "[compose-e2e +$(($(date +%s) - T0))s] $*" >&2; }

DOCKERD_PID="" DOCKERD_LOG="" COPIED_WHEEL="" COMPOSE_UP=""
cleanup() {
  local rc=$?
  if [ -n "$COMPOSE_UP" ]; then
    if [ "$rc" -ne 0 ]; then "${COMPOSE[@]}" ps || true; "${COMPOSE[@]}" logs --tail 30 || true; fi
    log "tearing down"
    "${COMPOSE[@]}" down -v --remove-orphans -t 20 >/dev/null 2>&1 || true
  fi
  if [ -n "$COPIED_WHEEL" ]; then rm -f "$COPIED_WHEEL"; fi
  if [ -n "$DOCKERD_PID" ]; then
    kill "$DOCKERD_PID" 2>/dev/null || true
    wait "$DOCKERD_PID" 2>/dev/null || true
    rm -f "$DOCKERD_LOG"
  fi
  log "exit $rc"
  exit "$rc"
}
trap cleanup EXIT

# ---- docker and compose ---------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
  command -v dockerd >/dev/null || { echo "needs docker: apt-get install -y docker.io docker-compose" >&2; exit 1; }
  [ "$(id -u)" = 0 ] || { echo "no docker daemon is running, and starting one needs root" >&2; exit 1; }
  DOCKERD_LOG=$(mktemp -t phalanx-dockerd.XXXXXX)
  log "starting dockerd"
  dockerd >"$DOCKERD_LOG" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -20 "$DOCKERD_LOG" >&2; exit 1; }
fi
if docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null; then
  COMPOSE=(docker-compose)
else
  echo "needs docker compose (the plugin) or docker-compose" >&2; exit 1
fi
COMPOSE+=(-p "$PROJECT" -f docker-compose.yml)

# ---- the image --------------------------------------------------------------------------------
if [ -z "${BASE_IMAGE:-}" ]; then
  BASE_IMAGE=phalanx-base:bookworm
  helper=../shared/tools/docker-base-image.sh
  [ -f "$helper" ] || helper=scripts/docker-base-image.sh
  log "base image $BASE_IMAGE (via $helper)"
  bash "$helper" "$BASE_IMAGE" >&2
fi
if [ -z "${TORCH_WHEEL:-}" ]; then
  links=$("$PYTHON" -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" || true)
  for dir in $links ${PIP_FIND_LINKS:-}; do
    dir=${dir#file://}
    for whl in "$dir"/torch-2.13.0+cpu-cp311-cp311-manylinux*_x86_64.whl; do
      [ -f "$whl" ] && TORCH_WHEEL=$whl && break 2
    done
  done
fi
if [ -n "${TORCH_WHEEL:-}" ]; then
  COPIED_WHEEL=scripts/docker-wheels/$(basename "$TORCH_WHEEL")
  cp "$TORCH_WHEEL" "$COPIED_WHEEL"
  log "torch from $(basename "$TORCH_WHEEL")"
else
  log "no local torch CPU wheel: the build downloads torch from the CPU index"
fi
log "docker build $IMAGE (BASE_IMAGE=$BASE_IMAGE)"
docker build --network host --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$IMAGE" . >&2
T_BUILD=$(($(date +%s) - T0))

# ---- up -----------------------------------------------------------------------------------------
MONITOR_PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
P2P_PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
export PHALANX_IMAGE=$IMAGE PHALANX_MONITOR_PORT=$MONITOR_PORT PHALANX_P2P_PORT=$P2P_PORT BASE_IMAGE
log "docker compose up: bootstrap, $TRAINERS trainers, monitor (dashboard on 127.0.0.1:$MONITOR_PORT)"
COMPOSE_UP=1
"${COMPOSE[@]}" up -d --no-build --scale trainer="$TRAINERS" >&2
T_UP=$(date +%s)

# ---- wait: every container healthy, every trainer with completed rounds in the monitor's API -----
check_swarm() {
  "$PYTHON" - "$MONITOR_PORT" "$TRAINERS" <<'PY'
import json, sys, urllib.request
port, trainers = sys.argv[1], int(sys.argv[2])
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/peers", timeout=5) as r:
        peers = json.load(r)["peers"]
except Exception as e:
    print(f"monitor not answering yet ({e.__class__.__name__})"); sys.exit(1)
done = [p for p in peers if p["role"] == "trainer" and p["state"] == "online" and p["rounds"]["ok"] > 0]
boots = [p for p in peers if p["role"] == "bootstrap" and p["state"] == "online"]
print(f"{len(done)}/{trainers} trainers online with completed rounds, {len(boots)} bootstrap; steps "
      + ",".join(str(p["step"]) for p in done))
sys.exit(0 if len(done) >= trainers and boots else 1)
PY
}
all_healthy() {
  local ids states
  ids=$("${COMPOSE[@]}" ps -q)
  [ "$(echo "$ids" | wc -w)" -eq $((TRAINERS + 2)) ] || return 1
  # shellcheck disable=SC2086
  states=$(docker inspect -f '{{.State.Health.Status}}' $ids | sort | uniq -c | xargs)
  echo "containers: $states"
  [ "$states" = "$((TRAINERS + 2)) healthy" ]
}
deadline=$(($(date +%s) + WAIT_S))
until all_healthy >&2 && check_swarm >&2; do
  if [ "$(date +%s)" -gt "$deadline" ]; then log "gave up after ${WAIT_S}s"; exit 1; fi
  sleep 3
done
T_READY=$(($(date +%s) - T_UP))
log "swarm healthy and training ${T_READY}s after up"

# ---- phalanx health, as a user runs it against the swarm ---------------------------------------
"${COMPOSE[@]}" run --rm -T health >&2
report=$("${COMPOSE[@]}" run --rm -T health --json --expect $((TRAINERS + 1)) --timeout-s 120)
echo "$report" | "$PYTHON" -c '
import json, sys
report, trainers = json.load(sys.stdin), int(sys.argv[1])
peers = report["peers"]
roles = sorted(p["role"] for p in peers)
assert roles == ["bootstrap"] + ["trainer"] * trainers, roles
bad = {p["short_id"]: p["problems"] for p in peers if p["problems"] or p["state"] != "online"}
assert not bad, bad
assert all(p["rounds"]["ok"] > 0 for p in peers if p["role"] == "trainer")
print(f"phalanx health: {len(peers)} peers online, no problems")
' "$TRAINERS" >&2

log "OK: build ${T_BUILD}s, healthy+training ${T_READY}s after up, total $(($(date +%s) - T0))s"
