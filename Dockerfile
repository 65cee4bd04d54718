# One image for every pdserve service; compose.yaml picks the command per service.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PDSERVE_LOG_FORMAT=json

WORKDIR /app
# torch first, pinned: its wheel is the big layer and changes least.
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install "${TORCH_SPEC}"

COPY pyproject.toml README.md ./
COPY protos ./protos
COPY src ./src
COPY services ./services
RUN pip install '.[engine,ucx]' \
    && pip install ./services/router ./services/prefill ./services/decode ./services/kvstore

# Model checkpoints are mounted at /model (see compose.yaml); none is baked in.
VOLUME ["/model"]
CMD ["pdserve", "--help"]
