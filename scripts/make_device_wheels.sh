#!/usr/bin/env bash
# Download, here, the wheels the GPU machine lacks for the HTTP service into .device-wheels/
# (ignored by git; 15 wheels, 4.7 MiB measured). The lent nvidia-h200 machine runs CPython 3.12
# with the packages of scripts/gpu_image_packages.txt (torch, triton, numpy, nvidia-ml-py, httpx,
# anyio, h11, click, prometheus-client, jinja2, uvloop, annotated-doc, ...), but not fastapi,
# starlette, pydantic, pydantic-core, uvicorn, httptools (the body protocol's parser),
# python-multipart, nor annotated-types and typing-inspection (pydantic needs them) or
# opentelemetry-api (fastapi imports it), nor orjson and zlib-ng: the service imports orjson; the
# npz reader uses zlib-ng's faster CRC-32 when it is there (zlib's otherwise, same values); nor
# standardwebhooks, which signs the webhooks (app/webhooks/signing.py; no dependencies of its own).
# tests/test_device_packages.py measures what the service imports and fails when the image plus
# scripts/device_wheels.txt lack one. It has no network, so they travel with the call:
#
#     bash scripts/gpu_prepare.sh                   # once, here (needs PyPI): calls this, then checks
#     run(command="bash scripts/gpu_device_run.sh", carry=[".device-wheels"], timeout_s=480)
#
# scripts/gpu_device_run.sh installs them with `pip install --no-index --no-deps --target` into a
# folder on PYTHONPATH. The versions are the ones the test suite runs with here, one of each (two
# versions of one package stop the install there); typing-extensions is carried because pydantic
# needs >= 4.16 (the image's may be older). Limits of a call: the working tree that travels, these wheels included, at most
# 64 MiB (the repository is ~14 MB; scripts/gpu_prepare.sh sums it); `carry` takes at most 8
# paths (this is one).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.device-wheels}
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
# the pins: scripts/device_wheels.txt (also read by scripts/gpu_carried.py, which checks the folder)
PACKAGES=()
while read -r line || [ -n "$line" ]; do
  line=${line%%#*}
  line=${line//[[:space:]]/}
  [ -n "$line" ] && PACKAGES+=("$line")
done <scripts/device_wheels.txt
if [ "${#PACKAGES[@]}" -eq 0 ]; then
  echo "make_device_wheels: scripts/device_wheels.txt names no wheels" >&2
  exit 1
fi
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$DEST" "${PACKAGES[@]}"
count=$(ls "$DEST"/*.whl | wc -l)
if [ "$count" -ne "${#PACKAGES[@]}" ]; then
  echo "make_device_wheels: expected ${#PACKAGES[@]} wheels (scripts/device_wheels.txt), got $count in $DEST" >&2
  exit 1
fi
ls -1 "$DEST"
du -sh "$DEST"
