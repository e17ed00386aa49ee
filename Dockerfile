# One image for target, draft, gateway and the one-shot model preparation (docker-compose.yml).
#
# CPU (default):   docker build -t dflash-serving .
# GPU (CUDA):      docker build -t dflash-serving:cuda \
#                    --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                    --build-arg EXTRAS=gpu .
#   EXTRAS=gpu adds triton and flashinfer (pyproject's `gpu` extra); the CUDA wheels of torch
#   bring their own CUDA runtime, the host needs only the NVIDIA driver and container toolkit.
#   docker-compose: deploy/docker-compose.gpu.yml (docs/monitoring.md, "GPU").
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DFLASH_HOME=/dflash

WORKDIR /app

# torch first, from the chosen index (a plain `pip install torch` would pull the CUDA build)
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

COPY pyproject.toml README.md Makefile ./
COPY proto proto
COPY dflash dflash
COPY runtime runtime
COPY services services
COPY gateway gateway
# the trained DFlash drafter for SmolLM2-135M-Instruct (the stack's default drafter)
COPY models models

# the project (+ grpcio-tools for the generated code), then dflash/v1/*_pb2*.py
RUN pip install -e ".[dev${EXTRAS:+,${EXTRAS}}]" \
 && python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. \
        proto/dflash/v1/*.proto

# an unprivileged user; /dflash (the models volume) owned by it, so a fresh named volume is too
RUN useradd --create-home --uid 10001 dflash && mkdir -p /dflash && chown dflash /dflash
USER dflash

# every service is `python -m ...` (docker-compose.yml sets the command)
CMD ["python", "-m", "gateway", "--help"]
