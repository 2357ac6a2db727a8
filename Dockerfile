# dstrain on an NGC CUDA image. First draft: the CUDA backend arrives with its issue; today the
# image builds the CPU backend and the CUDA probes (device detection) against the toolkit.
#
#   docker build -t dstrain .
#   docker run --gpus all --rm dstrain dstrain --help
ARG BASE=nvcr.io/nvidia/cuda:12.6.3-cudnn-devel-ubuntu24.04
FROM ${BASE}

ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends \
        cmake ninja-build g++ pkg-config git \
        libboost-program-options-dev libboost-context-dev nlohmann-json3-dev libopenblas-dev \
        libgtest-dev libpcre2-dev libutf8proc-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/dstrain
COPY . .
# sm_80 (A100), sm_86 (RTX 30xx), sm_89 (RTX 4090), sm_90 (H100/H200).
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSTRAIN_CUDA=AUTO \
          -DCMAKE_CUDA_ARCHITECTURES="80;86;89;90" \
    && cmake --build build -j"$(nproc)" \
    && install -m 0755 build/dstrain /usr/local/bin/dstrain

CMD ["dstrain", "--help"]
