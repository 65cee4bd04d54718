# One image for every pdserve service; compose.yaml picks the command per service.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PDSERVE_LOG_FORMAT=json

WORKDIR /app
# g++: the batch-invariant attention kernel (pdserve.model.attention.fixed_kernel) is a C++
# torch extension built on first use; without a compiler the engine falls back to its slower
# torch path.
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
# build the kernel into the image (a worker then loads it in well under a second instead of
# compiling for ~35 s of CPU at start-up); a CPU without AVX-512 builds its scalar variant on
# first use
ENV TORCH_EXTENSIONS_DIR=/opt/pdserve/torch_extensions
RUN python -c "from pdserve.model.attention import fixed_kernel as k; k.available()"

# Model checkpoints are mounted at /model (see compose.yaml); none is baked in.
VOLUME ["/model"]
CMD ["pdserve", "--help"]
