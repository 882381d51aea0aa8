#!/usr/bin/env bash
# Build .venv-ref: the official Qwen3-TTS implementation (PyPI qwen-tts 0.1.1) for the parity tests.
#   bash scripts/make_reference_env.sh        (called by scripts/setup.sh --test; idempotent)
# Why a venv of its own: qwen-tts pins transformers==4.57.3 / accelerate==1.12.0 and depends on torchaudio,
# sox, onnxruntime and gradio. Those are not needed on the 12 Hz path, and torchaudio would pull a CUDA torch;
# so qwen-tts goes in with --no-deps on top of the local CPU torch, with only what the 12 Hz path imports,
# and tests/parity/shims/ (put on the path by a .pth file) makes the unused module-level imports succeed.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
venv="$root/.venv-ref"
py="$venv/bin/python"

if [ -x "$py" ] && "$py" -c "import qwen_tts" 2>/dev/null; then
  echo "reference env ready: $venv"
  exit 0
fi
[ -x "$py" ] || python3 -m venv "$venv"
pip="$venv/bin/pip"
# torch first, from the local CPU wheel; the constraint keeps every later step from replacing it.
"$py" -c "import torch" 2>/dev/null || "$pip" install -q "torch==2.13.0"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" > "$constraints"
"$pip" install -q -c "$constraints" \
  "transformers==4.57.3" "accelerate==1.12.0" "librosa" "soundfile" "einops" "numpy" "safetensors"
"$pip" install -q --no-deps "qwen-tts==0.1.1"
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$root/tests/parity/shims" > "$site/ttsbench_parity_shims.pth"
"$py" -c "import qwen_tts, transformers, torch; print('reference env ready:', transformers.__version__, torch.__version__)"
