#!/usr/bin/env bash
# Smoke test of the compose deployment (docs/deploy.md, "Smoke test"): builds what is missing,
# brings the cpu profile up, and checks inference over HTTP and gRPC, a 4 MiB tensor through
# shared memory, three frontends on one port pair, a killed worker host, a restarted scheduler,
# and a clean `down -v`. One line per check:
#     ok   <check> (<seconds>s) <detail>
#     FAIL <check>: <why>
# and a non-zero exit status when any check failed.
#
# Environment (all optional):
#   SMOKE_VENV          virtualenv with tritonclient[all] and numpy (default: the repo's .venv)
#   SMOKE_PROJECT       compose project name (default trireme-smoke; never your deployment's)
#   SMOKE_HTTP_PORT, SMOKE_GRPC_PORT, SMOKE_METRICS_PORT   host ports (18000, 18001, 18002)
#   BASE_IMAGE          base of the image build (default trireme-base:bookworm, built by
#                       deploy/docker/build-base.sh when missing; python:3.11-slim-bookworm works
#                       where a registry is reachable)
#   TRIREME_BASE_ROOTFS an existing debootstrap rootfs for build-base.sh
#   BUILD_CA_BUNDLE     CA bundle pip trusts while building (default: the host's
#                       /etc/ssl/certs/ca-certificates.crt; empty: none). Copied to
#                       deploy/docker/build-ca.pem (git-ignored), used by the builder stage only.
#   SMOKE_SKIP_BUILD=1  use trireme:cpu as it is (default: docker build, cached layers reused)
#   SMOKE_KEEP=1        leave the deployment running on failure, to look at it
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${SMOKE_VENV:-$repo/.venv}"
py="$venv/bin/python"
project="${SMOKE_PROJECT:-trireme-smoke}"
image="${TRIREME_IMAGE:-trireme:cpu}"
base_image="${BASE_IMAGE:-trireme-base:bookworm}"
ca_bundle="${BUILD_CA_BUNDLE-/etc/ssl/certs/ca-certificates.crt}"
http_port="${SMOKE_HTTP_PORT:-18000}"
grpc_port="${SMOKE_GRPC_PORT:-18001}"
metrics_port="${SMOKE_METRICS_PORT:-18002}"
http="127.0.0.1:$http_port"
grpc="127.0.0.1:$grpc_port"
metrics="127.0.0.1:$metrics_port"
logdir="$(mktemp -d "${TMPDIR:-/tmp}/trireme-smoke.XXXXXX")"

# What the compose file reads (these override deploy/compose/.env)
export COMPOSE_PROJECT_NAME="$project" HTTP_PORT="$http_port" GRPC_PORT="$grpc_port" \
    METRICS_PORT="$metrics_port" TRIREME_IMAGE="$image" MODEL_REPOSITORY="$here/smoke-models"

failures=0
if command -v docker-compose >/dev/null; then compose_cmd=(docker-compose); else compose_cmd=(docker compose); fi
compose() { "${compose_cmd[@]}" --project-directory "$here" -f "$here/docker-compose.yml" --profile cpu "$@"; }
# the (first) container of a service, by compose's labels (v1 and v2 name containers differently)
cid() {
    docker ps -aq --filter "label=com.docker.compose.project=$project" \
        --filter "label=com.docker.compose.service=$1" | head -n 1
}
now() { echo "$EPOCHREALTIME"; }
secs() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }

# check NAME COMMAND...: runs COMMAND, prints ok/FAIL with its duration; its last output line
# is the detail (ok) or the reason (FAIL). `must` stops the run after a failure.
check() {
    local name="$1"; shift
    local t0 out rc
    t0="$(now)"
    set +e
    out="$("$@" 2>&1)"
    rc=$?
    set -e
    local dt
    dt="$(secs "$t0")"
    local last
    last="$(printf '%s\n' "$out" | grep -v '^[[:space:]]*$' | tail -n 1)"
    if [[ $rc -eq 0 ]]; then
        printf 'ok   %s (%ss)%s\n' "$name" "$dt" "${last:+ $last}"
    else
        printf 'FAIL %s: %s (after %ss)\n' "$name" "${last:-exit status $rc}" "$dt"
        printf '%s\n' "$out" > "$logdir/$(echo "$name" | tr -c 'A-Za-z0-9' '_').log"
        failures=$((failures + 1))
    fi
    return $rc
}
must() { check "$@" || finish; }

finish() {
    if [[ $failures -gt 0 && "${SMOKE_KEEP:-0}" == 1 ]]; then
        echo "kept running (SMOKE_KEEP=1): COMPOSE_PROJECT_NAME=$project ${compose_cmd[*]} -f $here/docker-compose.yml --profile cpu logs"
    else
        compose logs --no-color --timestamps > "$logdir/compose.log" 2>&1 || true
        compose down -v --remove-orphans > /dev/null 2>&1 || true
    fi
    if [[ $failures -gt 0 ]]; then
        echo "$failures check(s) failed; logs in $logdir"
        exit 1
    fi
    rm -rf "$logdir"
    exit 0
}
trap 'echo "FAIL interrupted"; failures=$((failures + 1)); finish' INT TERM

# ---- the checks' bodies ---------------------------------------------------------------------
client() { "$py" "$here/smoke_client.py" "$@"; }

tools() {
    "${compose_cmd[@]}" version >/dev/null 2>&1 || { echo "neither docker-compose nor docker compose"; return 1; }
    docker info >/dev/null 2>&1 || { echo "docker daemon not reachable"; return 1; }
    "$py" -c 'import tritonclient.http, tritonclient.grpc, numpy' 2>/dev/null \
        || { echo "no tritonclient[all] in $venv (set SMOKE_VENV)"; return 1; }
    echo "${compose_cmd[*]} $("${compose_cmd[@]}" version --short), docker $(docker version -f '{{.Server.Version}}'), python $("$py" -c 'import sys; print(sys.version.split()[0])')"
}

base() {
    if docker image inspect "$base_image" >/dev/null 2>&1; then
        echo "$base_image present"
    elif [[ "$base_image" == trireme-base:* ]]; then
        TRIREME_BASE_IMAGE="$base_image" "$repo/deploy/docker/build-base.sh" > "$logdir/build-base.log" 2>&1 \
            || { tail -n 5 "$logdir/build-base.log"; return 1; }
        tail -n 1 "$logdir/build-base.log"
    else
        echo "$base_image: not present; pull it or set BASE_IMAGE"; return 1
    fi
}

build() {
    if [[ "${SMOKE_SKIP_BUILD:-0}" == 1 ]]; then
        docker image inspect "$image" >/dev/null 2>&1 || { echo "$image missing (SMOKE_SKIP_BUILD=1)"; return 1; }
        echo "$image reused (SMOKE_SKIP_BUILD=1)"; return 0
    fi
    local ca="$repo/deploy/docker/build-ca.pem"
    if [[ -n "$ca_bundle" ]]; then
        [[ -s "$ca_bundle" ]] || { echo "BUILD_CA_BUNDLE $ca_bundle: no such file"; return 1; }
        cmp -s "$ca_bundle" "$ca" || cp "$ca_bundle" "$ca"   # unchanged file: cached layers
    fi
    docker build -f "$repo/deploy/docker/Dockerfile" --build-arg BASE_IMAGE="$base_image" \
        -t "$image" "$repo" > "$logdir/build.log" 2>&1 || { tail -n 5 "$logdir/build.log"; return 1; }
    local size
    size="$(docker image inspect -f '{{.Size}}' "$image")"
    echo "$image $(awk -v s="$size" 'BEGIN { printf "%.0f MB", s / 1e6 }'), $(grep -c 'Using cache' "$logdir/build.log") cached steps"
}

image_clean() {
    if [[ -z "$ca_bundle" ]]; then echo "no build CA bundle given: nothing to look for"; return 0; fi
    client image-clean --image "$image" --bundle "$ca_bundle"
}

up() {
    compose down -v --remove-orphans >/dev/null 2>&1 || true
    local t0
    t0="$(now)"
    compose up -d > "$logdir/up.log" 2>&1 || { tail -n 5 "$logdir/up.log"; return 1; }
    client ready --http "$http" --timeout 120 || return 1
    echo "first successful inference $(secs "$t0")s after \`up -d\` began"
}

shm_shared() {
    # segments of the frontend ("in") and of a worker ("out") side by side in the pod's /dev/shm
    local list
    local pod
    pod="$(cid pod)"
    list="$(docker exec "$pod" ls /dev/shm)"
    grep -q -- '-in-' <<<"$list" && grep -q -- '-out-' <<<"$list" \
        || { echo "no frontend and worker arenas in the shared /dev/shm: $(echo $list)"; return 1; }
    echo "shared /dev/shm ($(docker exec "$pod" df -h /dev/shm | awk 'NR==2 { print $2 }')) holds $(grep -c '^trireme-' <<<"$list") arena segment(s) of frontends and workers"
}

scale() {
    compose up -d --scale frontend=3 > "$logdir/scale.log" 2>&1 || { tail -n 5 "$logdir/scale.log"; return 1; }
    local running
    running="$(docker ps -q --filter "label=com.docker.compose.project=$project" \
        --filter label=com.docker.compose.service=frontend --filter status=running | wc -l)"
    [[ $running -eq 3 ]] || { echo "$running frontend containers running, expected 3"; return 1; }
    # the new frontends answer once they are connected to the scheduler
    client ready --http "$http" --timeout 60 >/dev/null
    client spread --http "$http" --metrics "$metrics" --frontends 3 --requests 90
}

worker_crash() {
    # The worker host's main process dies (SIGKILL, as a crash or the OOM killer would): tini
    # exits with it, the restart policy starts the container again.
    local c pid t0
    c="$(cid workers-cpu)"
    # tini is PID 1 in the container; its child is `trireme workers` (found through /proc:
    # the image has no ps). Killed from inside, as its own user: no root needed on the host.
    pid="$(docker exec "$c" sh -c 'for d in /proc/[0-9]*; do
        [ "$(sed -n "s/^PPid:[[:space:]]*//p" "$d/status" 2>/dev/null)" = 1 ] && echo "${d#/proc/}"; done' | head -n 1)"
    [[ -n "$pid" ]] || { echo "no worker host process found"; return 1; }
    t0="$(now)"
    docker exec "$c" sh -c "kill -KILL $pid"
    client not-ready --http "$http" --models simple,identity_fp32 --timeout 10 >/dev/null
    client models-ready --http "$http" --models simple,identity_fp32 --timeout 30 >/dev/null || return 1
    local took
    took="$(secs "$t0")"
    echo "READY again ${took}s after the kill (restart count $(docker inspect -f '{{.RestartCount}}' "$c"))"
    awk -v t="$took" 'BEGIN { exit !(t <= 10) }' || { echo "took ${took}s (target 10s)"; return 1; }
}

worker_kill() {
    # `docker kill` counts as a manual stop: the restart policy leaves the container down, so
    # here the operator (this script) starts it again, as soon as the scheduler noticed the loss.
    local c t0 noticed
    c="$(cid workers-cpu)"
    t0="$(now)"
    docker kill "$c" >/dev/null
    client not-ready --http "$http" --models simple,identity_fp32 --timeout 10 >/dev/null \
        || { echo "the models stayed READY after the worker host was killed"; return 1; }
    noticed="$(secs "$t0")"
    docker start "$c" >/dev/null
    client models-ready --http "$http" --models simple,identity_fp32 --timeout 30 >/dev/null || return 1
    local took
    took="$(secs "$t0")"
    echo "loss seen after ${noticed}s, READY again ${took}s after \`docker kill\` (docker start included)"
    awk -v t="$took" 'BEGIN { exit !(t <= 10) }' || { echo "took ${took}s (target 10s)"; return 1; }
}

scheduler_restart() {
    client under-restart --http "$http" --grpc "$grpc" --clients 6 --timeout 60 --target 10 \
        -- docker restart -t 35 "$(cid scheduler)"
}

after_restart() {
    client infer --http "$http" --grpc "$grpc" >/dev/null
    client big --http "$http" --grpc "$grpc" --mib 4
}

down() {
    compose down -v --remove-orphans > "$logdir/down.log" 2>&1 || { tail -n 5 "$logdir/down.log"; return 1; }
    local left vols
    left="$(docker ps -aq --filter "label=com.docker.compose.project=$project" | wc -l)"
    vols="$(docker volume ls -q --filter "label=com.docker.compose.project=$project" | wc -l)"
    [[ $left -eq 0 && $vols -eq 0 ]] || { echo "$left container(s), $vols volume(s) left"; return 1; }
    echo "no container, volume or network of project $project left"
}

# ---- the run ----------------------------------------------------------------------------------
t_all="$(now)"
must "tools" tools
must "base image $base_image" base
must "build $image" build
check "final image holds no build CA" image_clean || true
must "compose up (profile cpu) to first inference" up
check "infer simple over HTTP and gRPC (tritonclient)" client infer --http "$http" --grpc "$grpc" || true
check "4 MiB tensor through shared memory (HTTP, gRPC)" client big --http "$http" --grpc "$grpc" --mib 4 || true
check "frontend and worker share /dev/shm" shm_shared || true
check "scale frontend=3, requests spread" scale || true
check "worker host crash (SIGKILL), restart policy" worker_crash || true
check "worker host docker kill + start" worker_kill || true
check "scheduler restart under load, no client hangs" scheduler_restart || true
check "infer after the restarts (simple, 4 MiB)" after_restart || true
check "compose down -v" down || true
echo "total $(secs "$t_all")s, $failures failure(s)"
finish
