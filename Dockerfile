# dstrain on NVIDIA's NGC CUDA images: a build stage on the CUDA devel image (nvcc, cuBLAS,
# cuDNN, NCCL's headers) and a runtime stage on the matching runtime image holding the binary
# and the libraries it loads. README.md, "Run in Docker", has the run line.
#
#   docker build -t dstrain .
#   docker build -t dstrain --build-arg CUDA_VERSION=12.8.1 .   # another NGC tag
#
# What is true today: no Docker engine has built this file and no GPU has run the image.
# hadolint checks it (ctest: Dockerfile.Hadolint). Both stages were built once (2026-11-25, 16
# minutes on 2 cores) by podman 4.3 (`--format docker`: OCI images ignore SHELL) on a Debian 12
# base made with debootstrap, without CUDA: BUILD_IMAGE and RUNTIME_IMAGE=<that base>,
# DSTRAIN_CUDA=OFF, which skips the NCCL and cuBLAS steps below.
ARG CUDA_VERSION=12.6.3
ARG UBUNTU_VERSION=24.04
ARG BUILD_IMAGE=nvcr.io/nvidia/cuda:${CUDA_VERSION}-cudnn-devel-ubuntu${UBUNTU_VERSION}
ARG RUNTIME_IMAGE=nvcr.io/nvidia/cuda:${CUDA_VERSION}-cudnn-runtime-ubuntu${UBUNTU_VERSION}

FROM ${BUILD_IMAGE} AS build
# ON: the CUDA backend and NCCL, or the image fails. OFF: the CPU build (checking the steps on a
# base without CUDA).
ARG DSTRAIN_CUDA=ON
# sm_80 (A100), sm_86 (RTX 30xx, A40), sm_89 (RTX 4090, L40S), sm_90 (H100, H200).
ARG CUDA_ARCHITECTURES="80;86;89;90"
ENV DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The packages of scripts/install-deps.sh, from the distribution: unpinned, as the base image's
# tag fixes the release. The devel images carry NCCL's headers (libnccl-dev); a base without
# them gets them from the image's NVIDIA repository, at the version of its libnccl2 (which the
# images hold: another version would not install).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        cmake ninja-build g++ pkg-config libboost-program-options-dev libboost-context-dev \
        nlohmann-json3-dev libopenblas-dev libgtest-dev libpcre2-dev libutf8proc-dev libgloo-dev \
        zlib1g-dev \
    && if [ "${DSTRAIN_CUDA}" = ON ] && ! dpkg-query -W -f='${Status}\n' libnccl-dev 2>/dev/null \
            | grep -q "ok installed"; then \
        nccl_version="$(dpkg-query -W -f='${Version}' libnccl2 2>/dev/null || true)"; \
        apt-get install -y --no-install-recommends "libnccl-dev${nccl_version:+=${nccl_version}}"; \
    fi \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/dstrain
# The sources only (no build/ folders of a working tree).
COPY CMakeLists.txt ./
COPY configs configs
COPY kernels kernels
COPY src src
COPY topology topology
COPY tests tests
COPY benchmarks benchmarks
RUN cmake -S . -B /tmp/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSTRAIN_CUDA="${DSTRAIN_CUDA}" \
        -DDSTRAIN_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES}" \
    && cmake --build /tmp/build --target dstrain -j"$(nproc)" \
    && install -m 0755 /tmp/build/dstrain /usr/local/bin/dstrain \
    && rm -rf /tmp/build

# The image fails here unless the binary starts and, with CUDA, loads NCCL and cuBLAS: CMake
# builds without NCCL when it does not find it, and a run on several GPUs would then fall back
# to host copies. (ldd's output is kept in a variable: `ldd | grep -q` would end ldd early, and
# pipefail would count that as a failure.)
RUN dstrain --version \
    && libraries="$(ldd /usr/local/bin/dstrain)" \
    && if grep "not found" <<<"${libraries}"; then exit 1; fi \
    && if [ "${DSTRAIN_CUDA}" = ON ]; then \
        for library in libnccl.so libcublas.so libcublasLt.so libcudart.so; do \
            grep -q "${library}" <<<"${libraries}" \
                || { echo "dstrain is not linked against ${library}" >&2; exit 1; }; \
        done; \
    fi

# The packages owning the libraries the binary loads, with the versions it was built against,
# for the runtime stage: found by file name (the real file after symbolic links and
# alternatives, with its folder: usr-merged paths differ between ldd and dpkg). SC2016: the
# ${...} in single quotes are dpkg-query's fields.
# hadolint ignore=SC2016
RUN ldd /usr/local/bin/dstrain | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' \
        | while read -r library; do \
            real="$(realpath "${library}")"; \
            dpkg-query -S "*$(basename "$(dirname "${real}")")/$(basename "${real}")"; \
        done \
        | cut -d: -f1 | sort -u \
        | xargs dpkg-query -W -f='${Package}=${Version}\n' > /opt/dstrain/runtime-packages.txt \
    && cat /opt/dstrain/runtime-packages.txt

FROM ${RUNTIME_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY --from=build /opt/dstrain/runtime-packages.txt /tmp/runtime-packages.txt
# Pinned to the build stage's versions (the list above); the CUDA libraries among them
# (cudart, cuBLAS, NCCL's libnccl2) are in the runtime image already, at the same versions.
RUN apt-get update \
    && xargs -a /tmp/runtime-packages.txt apt-get install -y --no-install-recommends \
    && rm -rf /var/lib/apt/lists/* /tmp/runtime-packages.txt
COPY --from=build /usr/local/bin/dstrain /usr/local/bin/dstrain
# Every library found here too, and the binary starts.
RUN libraries="$(ldd /usr/local/bin/dstrain)" \
    && if grep "not found" <<<"${libraries}"; then exit 1; fi \
    && dstrain --version
WORKDIR /runs
CMD ["dstrain", "--help"]
