#!/usr/bin/env bash
# Installs what dstrain builds with, from Debian packages (run as root; skips what is there);
# ccache makes rebuilds, and CI's builds of a fresh clone, compile from its cache.
set -euo pipefail
# Arguments: other packages to install the same way instead (scripts/check-dockerfile-podman.sh).
packages=(cmake ninja-build g++ pkg-config libboost-program-options-dev libboost-context-dev
          nlohmann-json3-dev libopenblas-dev libgtest-dev libpcre2-dev libutf8proc-dev
          libgloo-dev zlib1g-dev ccache)
if (($#)); then packages=("$@"); fi
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$package")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
