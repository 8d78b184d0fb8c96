#!/usr/bin/env bash
# The wheels bench/gpu.sh installs on a GPU machine without a network (CPython 3.12, x86-64 Linux):
# the project's dependencies that an image with torch, Lightning, numpy, scipy, matplotlib, pandas,
# safetensors, einops, pyyaml, requests, protobuf, click and packaging lacks, and theirs; ~26 MB.
#
#   bash bench/gpu_wheels.sh [DIR]        # default .whl (ignored: add /.whl/ to .git/info/exclude)
#
# The versions are this project's venv's on 2026-11-27. antlr4-python3-runtime 4.9.3 (omegaconf's
# pin) has no wheel on PyPI: it is built here from its sdist (pure Python).
set -eu
DIR=${1:-.whl}
PIP=${PIP:-python3 -m pip}
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"
WHEELS="
  hydra-core==1.3.8 omegaconf==2.3.1 ruptures==1.1.10
  wandb==0.31.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  platformdirs==4.14.8 xxhash==4.1.0 cwevals==0.0.1b1 anyio==4.16.0 distro==1.9.0 httpx==0.28.1
  httpcore==1.0.9 h11==0.16.0 sniffio==1.3.1 googleapis-common-protos==1.76.0
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-http-transport==0.66b2
  opentelemetry-exporter-otlp-common==0.66b2"
mkdir -p "$DIR"
# shellcheck disable=SC2086
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS -d "$DIR" $WHEELS
$PIP wheel -q --no-deps -w "$DIR" antlr4-python3-runtime==4.9.3
ls "$DIR" | wc -l
du -sh "$DIR"
