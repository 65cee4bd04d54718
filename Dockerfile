# One image for every pdserve service; compose.yaml picks the command per service.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PDSERVE_LOG_FORMAT=json

WORKDIR /app
# g++: the C++ kernels (`pdserve kernels build`, below); without a compiler a worker runs
# their torch / oneDNN fallbacks, slower and (bf16 on a CPU with AMX) not batch-invariant.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
# torch first, pinned: its wheel is the big layer and changes least.
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install "${TORCH_SPEC}"

COPY pyproject.toml README.md ./
COPY protos ./protos
COPY src ./src
COPY services ./services
RUN pip install '.[engine,ucx]' \
    && pip install ./services/router ./services/prefill ./services/decode ./services/kvstore
# the kernels are built into the image for the build machine's CPU (a worker only loads
# prebuilt kernels, never compiles); build the image on the kind of CPU it serves on
# (`pdserve kernels` in a container says what loads there and what falls back, and why)
ENV TORCH_EXTENSIONS_DIR=/opt/pdserve/torch_extensions
RUN pdserve kernels build

# Model checkpoints are mounted at /model (see compose.yaml); none is baked in.
VOLUME ["/model"]
CMD ["pdserve", "--help"]
