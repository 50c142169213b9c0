#!/usr/bin/env bash
# Fills .whl (git-ignored) with what benchmarks/one_gpu.sh installs on a GPU machine that reaches
# no registry: axtorch's own wheel, and the packages its image (Python 3.12, torch, transformers,
# peft) lacks, for Python 3.12 on x86-64.
set -eu
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl \
  hydra-core==1.3.2 omegaconf==2.3.0 gguf==0.19.0 datasets==4.4.1 dill==0.4.0 multiprocess==0.70.18 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0 torchao==0.16.0
# antlr4's runtime (omegaconf's parser) is published as a source distribution only.
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
python3 -m pip wheel -q --no-deps -w .whl .
