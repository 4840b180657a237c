#!/usr/bin/env bash
# Run compose.yaml on a Debian 12 host that has no container engine and cannot pull images from a registry (the
# development machines: a Firecracker VM, root, Debian's package mirror and PyPI reachable). What it does, once:
#   1. installs podman, runc and debootstrap from Debian, and podman-compose from PyPI into .compose-venv/;
#   2. configures podman for this VM: runc with cgroupfs (crun refuses the VM's hybrid cgroups), no default ulimits
#      (setting RLIMIT_NPROC is denied here), the vfs storage driver;
#   3. builds the base image from Debian packages (debootstrap: bookworm + python3), the Conveyor image from the
#      Dockerfile on it (pip uses this host's config and wheel folder), and a Prometheus image from Debian's package.
# Then `up` starts the stack (Grafana has no Debian package: left out here), `check` runs scripts/compose_check.py,
# `down` removes it.
#   bash scripts/compose_local.sh setup|up|check|down
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '[compose-local] %s\n' "$*" >&2; }
PROJECT=${CONVEYOR_COMPOSE_PROJECT:-conveyor}
COMPOSE=(.compose-venv/bin/podman-compose -p "$PROJECT")
export CONVEYOR_PROMETHEUS_IMAGE=localhost/prometheus:debian
SERVICES=(nats processor decode gateway prometheus)

setup() {
    say "installing podman, runc, debootstrap (Debian) and podman-compose (PyPI)"
    apt-get install -y -q podman runc debootstrap >/dev/null
    [ -x .compose-venv/bin/podman-compose ] || { python3 -m venv .compose-venv && .compose-venv/bin/pip install -q podman-compose; }
    mkdir -p /etc/containers
    printf '[containers]\ndefault_ulimits = []\n[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\n' \
        > /etc/containers/containers.conf
    printf '[storage]\ndriver = "vfs"\nrunroot = "/run/containers/storage"\ngraphroot = "/var/lib/containers/storage"\n' \
        > /etc/containers/storage.conf
    if ! podman image exists localhost/debian-python:bookworm; then
        say "building the base image from Debian packages (debootstrap, ~3 minutes)"
        local rootfs; rootfs=$(mktemp -d)
        debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates,bash \
            bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
        chroot "$rootfs" apt-get clean && rm -rf "$rootfs"/var/lib/apt/lists/*
        tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - localhost/debian-python:bookworm >/dev/null
        rm -rf "$rootfs"
    fi
    say "building conveyor:local from the Dockerfile (~5 minutes)"
    local pip_mounts=()
    for path in /opt/wheels /etc/xdg/pip /etc/ssl/certs/ca-certificates.crt; do
        [ -e "$path" ] && pip_mounts+=(-v "$path:$path:ro")
    done
    podman build --network host "${pip_mounts[@]}" --build-arg BASE=localhost/debian-python:bookworm -t conveyor:local . >/dev/null
    if ! podman image exists "$CONVEYOR_PROMETHEUS_IMAGE"; then
        say "building a Prometheus image from Debian's package"
        local work; work=$(mktemp -d)
        (cd "$work" && apt-get download -q prometheus >/dev/null 2>&1 && dpkg -x prometheus_*.deb x)
        printf 'FROM localhost/debian-python:bookworm\nCOPY x/usr/bin/prometheus /bin/prometheus\nENTRYPOINT ["/bin/prometheus"]\n' \
            > "$work/Containerfile"
        podman build -q -t "$CONVEYOR_PROMETHEUS_IMAGE" "$work" >/dev/null
        rm -rf "$work"
    fi
    say "ready: bash scripts/compose_local.sh up"
}

down() {
    "${COMPOSE[@]}" down -v >/dev/null 2>&1 || true
    # podman-compose leaves scaled replicas (and containers others depended on) behind: remove what the project has.
    local left
    for _ in 1 2; do
        left=$(podman ps -aq --filter "label=io.podman.compose.project=$PROJECT")
        [ -z "$left" ] || podman rm -f $left >/dev/null 2>&1 || true
    done
    podman volume rm -f "${PROJECT}_nats-data" >/dev/null 2>&1 || true
}

case "${1:-}" in
    setup) setup ;;
    up) "${COMPOSE[@]}" up -d "${SERVICES[@]}" && say "gateway on http://localhost:8000/v1, Prometheus on :9090" ;;
    scale) "${COMPOSE[@]}" up -d --scale "decode=${2:-2}" decode ;;
    check) python3 scripts/compose_check.py "${@:2}" ;;
    down) down ;;
    *) echo "usage: $0 setup|up|scale [N]|check|down" >&2; exit 2 ;;
esac
