# The image launch/kubernetes/jobset.yaml runs (REGISTRY/axtorch-tpu:TAG): axtorch with the xla
# extra (torch 2.9.0 and torch_xla 2.9.0, the pair torch_xla pins) and libtpu, with the checkout at
# /workspace/axtorch, the manifest's workingDir. Build from the repository root:
#
#   docker build -f launch/docker/tpu.Dockerfile -t REGISTRY/axtorch-tpu:TAG .
#
# torch_xla's tpu extra brings libtpu, the TPU runtime; the TPU VM's host provides the chips.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PJRT_DEVICE=TPU

WORKDIR /workspace/axtorch
COPY pyproject.toml README.md ./
COPY axtorch ./axtorch
COPY conf ./conf
COPY launch ./launch
# axtorch from this checkout, its dependencies within pyproject.toml's ranges (hence DL3013);
# xla: torch 2.9.0 and torch_xla; hf: HF checkpoints and datasets.
# hadolint ignore=DL3013
RUN pip install ".[xla,hf]" "torch_xla[tpu]==2.9.0"
