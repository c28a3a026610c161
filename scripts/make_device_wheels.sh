#!/usr/bin/env bash
# Download, here, the wheels the GPU machine lacks for the HTTP service into .device-wheels/
# (ignored by git; 12 wheels, 3.4 MiB measured). The lent nvidia-h200 machine runs CPython 3.12
# and has torch, triton, numpy, nvidia-ml-py, httpx, anyio, h11, click, prometheus-client and
# annotated-doc, but not fastapi, starlette, pydantic, pydantic-core, uvicorn, python-multipart,
# nor annotated-types and typing-inspection (pydantic needs them) or opentelemetry-api (fastapi
# imports it), nor orjson and zlib-ng (not in H200.md's package list): the service imports
# orjson; the npz reader uses zlib-ng's faster CRC-32 when it is there (zlib's otherwise, same
# values: the learner needs none of these). It has no network, so they travel with the call:
#
#     bash scripts/make_device_wheels.sh            # once, here (needs PyPI)
#     run(command="bash scripts/gpu_device_run.sh", carry=[".device-wheels"], timeout_s=480)
#
# scripts/gpu_device_run.sh installs them with `pip install --no-index --no-deps --target` into a
# folder on PYTHONPATH. The versions are the ones the test suite runs with here, one of each (two
# versions of one package stop the install there); typing-extensions is carried because pydantic
# needs >= 4.16. Limits of a call: the working tree that travels, these wheels included, at most
# 64 MiB (the repository is ~12 MB); `carry` takes at most 8 paths (this is one).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.device-wheels}
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
PACKAGES=(
  fastapi==0.165.0
  starlette==1.10.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  uvicorn==0.54.0
  python-multipart==0.0.34
  opentelemetry-api==1.45.2
  orjson==3.13.0
  zlib-ng==1.1.0
)
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$DEST" "${PACKAGES[@]}"
count=$(ls "$DEST"/*.whl | wc -l)
if [ "$count" -ne "${#PACKAGES[@]}" ]; then
  echo "expected ${#PACKAGES[@]} wheels, got $count" >&2
  exit 1
fi
ls -1 "$DEST"
du -sh "$DEST"
