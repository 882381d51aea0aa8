#!/bin/bash
# The wheels gpu_bench.sh installs on a lent GPU machine (which reaches no package index), downloaded here into one
# folder to carry there as WHEELS: soundfile, soxr, cffi, pycparser and orjson (the server's, missing from the
# device's image), dashscope (its qwen.tiktoken: the checkpoints' real text vocabulary) and py-spy (PYSPY
# profiles). Built for the device's Python (3.12 in its image, 2026-11; PY overrides), not this machine's.
#
#   bash benchmarks/device_wheels.sh [DEST]        default DEST: .ab/whl (git-ignored; carry .ab)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.ab/whl}
PY=${PY:-3.12}
mkdir -p "$DEST"
# one platform tag per manylinux generation the wheels above are published under
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any -d "$DEST" soundfile soxr cffi pycparser orjson py-spy
python3 -m pip download -q --no-deps -d "$DEST" dashscope  # pure Python
ls "$DEST"
