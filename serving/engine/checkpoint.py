"""Where `--model` points: a local checkpoint directory, a Hugging Face id, or a tiny random test model.

Tiny models are written once (with serving.model.checkpoint's writer) into the cache directory, so anyone can
run the whole stack without downloading weights. Hugging Face ids come from the local hub cache; where the
network allows they are downloaded, and offline the error says how to get the files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

TINY_MODELS = {
    "tiny-random": "custom_voice",
    "tiny-random-custom": "custom_voice",
    "tiny-random-design": "voice_design",
    "tiny-random-clone": "base",
}


def cache_root() -> Path:
    return Path(os.environ.get("TTSBENCH_CACHE", Path.home() / ".cache" / "ttsbench"))


def resolve_model(model: str) -> Path:
    """The checkpoint directory for `model`; raises ValueError with what to do when there is none."""
    if model in TINY_MODELS:
        return tiny_checkpoint(model)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json: not a Qwen3-TTS checkpoint directory")
        return path.resolve()
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ValueError(f"--model {model!r}: no such checkpoint directory, and not a Hugging Face id "
                         f"(org/name) or one of {', '.join(TINY_MODELS)}")
    return _hub_snapshot(model)


def tiny_checkpoint(name: str) -> Path:
    """Write the tiny random checkpoint once (atomically: a half-written one is never used)."""
    target = cache_root() / "checkpoints" / name
    if (target / "config.json").is_file() and (target / "speech_tokenizer" / "model.safetensors").is_file():
        return target
    from serving.model.checkpoint import write_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        write_checkpoint(tmp, size="tiny", model_type=TINY_MODELS[name], seed=0)
        try:
            tmp.rename(target)
        except OSError:  # another process wrote it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _hub_snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise ValueError(f"--model {repo_id!r} looks like a Hugging Face id, but huggingface_hub is not installed; "
                         "pass a local checkpoint directory instead") from None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    except Exception as exc:  # a broken cache entry
        raise ValueError(f"the local Hugging Face cache entry of {repo_id!r} is unusable: {exc}") from None
    try:
        return Path(snapshot_download(repo_id))
    except Exception as exc:
        raise ValueError(
            f"{repo_id!r} is not in the local Hugging Face cache and could not be downloaded "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). On a machine with access run "
            f"`huggingface-cli download {repo_id}` (or copy the checkpoint directory here) and pass "
            "--model with that id or directory") from None
