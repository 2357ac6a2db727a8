#!/usr/bin/env bash
# Installs, best effort, the references one test uses beyond dstrain's own build: Debian's
# python3-torch and Hugging Face transformers 4.41 for the system Python (the check that
# transformers loads a checkpoint dstrain wrote, tests/reference/check_in_transformers.py).
# dstrain never needs them; without them that test reports itself skipped.
set -uo pipefail
if /usr/bin/python3 -c "import torch, transformers" 2>/dev/null; then
  exit 0
fi
echo "installing the test references: python3-torch, transformers 4.41 (best effort)"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
{ $SUDO apt-get update -qq &&
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-torch python3-pip >/dev/null &&
  $SUDO /usr/bin/python3 -m pip install -q --break-system-packages "transformers==4.41.2" \
    >/dev/null 2>&1; } ||
  echo "could not install them: the transformers check will be skipped"
exit 0
