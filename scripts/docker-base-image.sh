#!/usr/bin/env bash
# Build a local Debian bookworm + Python 3.11 base image with debootstrap, for machines whose
# docker cannot pull from a container registry (then: --build-arg BASE_IMAGE=<this tag>).
#
#   scripts/docker-base-image.sh [TAG]        default TAG: phalanx-base:bookworm
#
# Needs root, a running dockerd and debootstrap (apt-get install -y debootstrap docker.io).
# The image trusts this machine's CA bundle and tells pip to use it, so `pip install` inside
# `docker build --network host` reaches the package index the same way this machine does.
set -euo pipefail
TAG="${1:-phalanx-base:bookworm}"
if docker image inspect "$TAG" >/dev/null 2>&1; then echo "$TAG already present"; exit 0; fi
ROOTFS="$(mktemp -d -t phalanx-rootfs.XXXXXX)"
LOG="$(mktemp -t phalanx-debootstrap.XXXXXX)"
trap 'rm -rf "$ROOTFS" "$LOG"' EXIT
# the Debian mirror apt already uses (classic sources.list or deb822 .sources)
MIRROR="$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)"
if [ -z "$MIRROR" ]; then
  MIRROR="$(grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | awk '{print $2}')"
fi
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
  bookworm "$ROOTFS" "$MIRROR" >"$LOG" 2>&1 || { tail -20 "$LOG"; exit 1; }
cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" -c . | docker import \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
  --change 'CMD ["python3"]' - "$TAG" >/dev/null
echo "built $TAG"
