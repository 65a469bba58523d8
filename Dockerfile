# One image for every Inferno service; the command picks the service (inferno gateway|scheduler|worker).
# GPU hosts: the default torch wheel from PyPI (CUDA). CPU-only: --build-arg TORCH_SPEC="torch==2.13.0"
# with a CPU wheel source, as in the README.
FROM python:3.11-slim
ARG TORCH_SPEC=torch
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 TRITON_CACHE_DIR=/cache/triton
WORKDIR /app
RUN pip install "$TORCH_SPEC"
COPY pyproject.toml README.md ./
COPY services ./services
COPY shared ./shared
COPY inferno ./inferno
# ucx: the kvstore and the prefill/decode hand-off move KV pages over UCXX.
RUN pip install ".[gpu,ucx]"
ENTRYPOINT ["inferno"]
