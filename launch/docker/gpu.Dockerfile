# The image launch/kubernetes/pytorchjob.yaml runs (REGISTRY/axtorch:TAG): CUDA PyTorch and
# axtorch, with the checkout at /workspace/axtorch, the manifest's workingDir, from where its
# command runs launch/preemptible.sh. Build from the repository root:
#
#   docker build -f launch/docker/gpu.Dockerfile -t REGISTRY/axtorch:TAG .
#
# torch's Linux wheels on the package index carry their CUDA libraries; the GPU driver comes from
# the node (NVIDIA's container toolkit or device plugin). TORCH_VERSION: any torch in axtorch's
# supported range (pyproject.toml: 2.9 to 2.13), e.g. the one your cluster pins; with 2.9, pin
# torchao==0.14.0 beside it as the xla extra does (a newer torchao breaks `import transformers` there).
FROM python:3.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /workspace/axtorch
COPY pyproject.toml README.md ./
COPY axtorch ./axtorch
COPY conf ./conf
COPY launch ./launch
# axtorch from this checkout, its dependencies within pyproject.toml's ranges (hence DL3013);
# hf: HF checkpoints and datasets; float8: torchao's float8 linears.
# hadolint ignore=DL3013
RUN pip install "torch==${TORCH_VERSION}" ".[hf,float8]"
