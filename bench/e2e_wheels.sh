#!/usr/bin/env bash
# Builds .whl/ (ignored by git): the wheels bench/bench_e2e.py needs on the GPU machine beyond what its image
# holds (Python 3.12; torch 2.11, triton 3.6, numpy, grpcio, protobuf, tokenizers, safetensors, requests and
# the like are there: docs/DEMO.md gives the device command, which installs these with --no-deps: the image's
# tokenizers pins an older huggingface-hub). About 30 MB: the machine takes 64 MiB a call.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform linux_x86_64 -d .whl \
    transformers==5.25.0 'pydantic>=2.7,<3' 'opentelemetry-sdk~=1.45.2' 'opentelemetry-proto~=1.45.2' \
    'opentelemetry-exporter-otlp-proto-http~=1.45.2'
# The large binaries the image already has at versions these accept (numpy 2.5, tokenizers 0.23.2, safetensors
# 0.8, grpcio); the small ones stay, in case the image's are older than these need.
for name in numpy grpcio tokenizers safetensors; do
    rm -f .whl/"$name"-[0-9]*.whl
done
du -sh .whl
