#!/usr/bin/env bash
# Builds the Dockerfile's two stages with podman on a local Debian 12 base made with debootstrap,
# without CUDA (DSTRAIN_CUDA=OFF: the same packages, CMake steps, library checks and runtime
# package list, less the NCCL/cuBLAS checks), so that a broken package name or build step is
# caught on a machine with no Docker engine and no GPU. Installs podman and debootstrap (root).
# About 20 minutes on 2 cores, so not part of scripts/test.sh (CI's 40-minute budget):
# run it by hand, or in CI with DSTRAIN_DOCKER_CHECK=1.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${DSTRAIN_PODMAN_WORK:-/tmp/dstrain-podman}
scripts/install-deps.sh podman buildah debootstrap
# vfs storage and chroot isolation: what works inside this sandbox (no overlay, no user namespaces).
storage=(--root "$work/storage" --runroot "$work/run" --storage-driver vfs)
mkdir -p "$work"
if ! podman "${storage[@]}" image exists localhost/dstrain-debian-base; then
  rm -rf "$work/rootfs"
  debootstrap --variant=minbase bookworm "$work/rootfs" http://deb.debian.org/debian >/dev/null
  tar -C "$work/rootfs" -c . | podman "${storage[@]}" import - localhost/dstrain-debian-base
fi
# --format docker: the OCI format ignores the Dockerfile's SHELL (bash with pipefail).
podman "${storage[@]}" build --format docker --isolation chroot \
  --build-arg BUILD_IMAGE=localhost/dstrain-debian-base \
  --build-arg RUNTIME_IMAGE=localhost/dstrain-debian-base \
  --build-arg DSTRAIN_CUDA=OFF -t localhost/dstrain-cpu-check .
# The runtime stage's last step ran `dstrain --version` with only its packages installed.
echo "check-dockerfile-podman: both stages built; the runtime stage ran dstrain --version"
