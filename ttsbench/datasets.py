"""Built-in and user text sets, speakers, instructions, voice designs and reference voices.

This module is the one place that knows where the data files live: a source checkout's `datasets/`
folder, or, for a non-editable install, the copy that setuptools installs under
`<prefix>/share/ttsbench/datasets` (see `[tool.setuptools.data-files]` in pyproject.toml; the
user base instead of the prefix for `pip install --user`).
`TTSBENCH_DATASETS` overrides both.
"""

from __future__ import annotations

import json
import os
import site
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

BUILTIN_SETS = ("short", "medium", "long", "multilingual")

# The API's language names (vllm-omni / Qwen3-TTS); "Auto" lets the server detect it.
LANGUAGES = (
    "Auto", "Chinese", "English", "Japanese", "Korean", "German",
    "French", "Russian", "Portuguese", "Spanish", "Italian",
)
_LANGUAGE_BY_LOWER = {name.lower(): name for name in LANGUAGES}


class DatasetError(ValueError):
    """A data file is missing or malformed; the message names the file and line."""


@dataclass(frozen=True)
class Item:
    id: str
    text: str
    language: str
    group: str | None = None


@dataclass(frozen=True)
class Speaker:
    name: str
    language: str
    description: str


@dataclass(frozen=True)
class Prompt:
    """A CustomVoice style instruction or a VoiceDesign voice description."""
    id: str
    text: str
    language: str | None = None


@dataclass(frozen=True)
class Voice:
    """A reference clip for voice cloning; `path` is absolute, `file` as written in voices.jsonl."""
    name: str
    path: Path
    ref_text: str
    language: str
    command: str | None = None


def datasets_dir() -> Path:
    """Where the data files are: $TTSBENCH_DATASETS, the source checkout, or the installed copy."""
    env = os.environ.get("TTSBENCH_DATASETS")
    if env:
        return Path(env)
    checkout = Path(__file__).resolve().parent.parent / "datasets"
    installed = Path(sys.prefix) / "share" / "ttsbench" / "datasets"
    user_installed = Path(site.getuserbase()) / "share" / "ttsbench" / "datasets"  # pip install --user
    for candidate in (checkout, installed, user_installed):
        if (candidate / "short.jsonl").is_file():
            return candidate
    return checkout if checkout.is_dir() else installed


def normalize_language(value: str) -> str | None:
    """The API's spelling of a language name, or None if it is not one of LANGUAGES."""
    return _LANGUAGE_BY_LOWER.get(value.strip().lower()) if isinstance(value, str) else None


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DatasetError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            rows.append((lineno, obj))
    if not rows:
        raise DatasetError(f"{path}: no items")
    return rows


def _text_field(path: Path, lineno: int, obj: dict, key: str, required: bool = True) -> str | None:
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{path}:{lineno}: field {key!r} must be a non-empty string")
    return value


def _language_field(path: Path, lineno: int, obj: dict, default: str | None) -> str:
    value = obj.get("language", default)
    if value is None:
        raise DatasetError(f"{path}:{lineno}: field 'language' is missing")
    language = normalize_language(value)
    if language is None:
        raise DatasetError(
            f"{path}:{lineno}: unknown language {value!r}; expected one of {', '.join(LANGUAGES)}")
    return language


def _check_unique(path: Path, lineno: int, seen: set, key: str, value: str) -> None:
    if value in seen:
        raise DatasetError(f"{path}:{lineno}: duplicate {key} {value!r}")
    seen.add(value)


def load_items(path: Path, strict: bool = True) -> list[Item]:
    """Text items of a JSONL file. strict (built-in sets) requires id and language on every line;
    a user file may leave them out (id becomes `<stem>-<line>`, language `Auto`)."""
    path = Path(path)
    items, seen = [], set()
    for lineno, obj in _read_jsonl(path):
        text = _text_field(path, lineno, obj, "text")
        raw_id = obj.get("id", None if strict else f"{path.stem}-{lineno}")
        if isinstance(raw_id, int) and not isinstance(raw_id, bool):
            raw_id = str(raw_id)
        if not isinstance(raw_id, str) or not raw_id.strip():
            raise DatasetError(f"{path}:{lineno}: field 'id' must be a non-empty string")
        _check_unique(path, lineno, seen, "id", raw_id)
        language = _language_field(path, lineno, obj, None if strict else "Auto")
        group = obj.get("group")
        if group is not None and not isinstance(group, str):
            raise DatasetError(f"{path}:{lineno}: field 'group' must be a string")
        items.append(Item(id=raw_id, text=text, language=language, group=group))
    return items


def load_set(name: str) -> list[Item]:
    """A built-in set by name."""
    if name not in BUILTIN_SETS:
        raise DatasetError(f"unknown set {name!r}; built-in sets: {', '.join(BUILTIN_SETS)}")
    return load_items(datasets_dir() / f"{name}.jsonl")


def load_speakers() -> list[Speaker]:
    path = datasets_dir() / "speakers.jsonl"
    speakers, seen = [], set()
    for lineno, obj in _read_jsonl(path):
        name = _text_field(path, lineno, obj, "name")
        _check_unique(path, lineno, seen, "name", name)
        speakers.append(Speaker(name=name, language=_language_field(path, lineno, obj, None),
                                description=_text_field(path, lineno, obj, "description", required=False) or ""))
    return speakers


def _load_prompts(filename: str, with_language: bool) -> list[Prompt]:
    path = datasets_dir() / filename
    prompts, seen = [], set()
    for lineno, obj in _read_jsonl(path):
        prompt_id = _text_field(path, lineno, obj, "id")
        _check_unique(path, lineno, seen, "id", prompt_id)
        language = _language_field(path, lineno, obj, "Auto") if with_language else None
        prompts.append(Prompt(id=prompt_id, text=_text_field(path, lineno, obj, "text"), language=language))
    return prompts


def load_instructions() -> list[Prompt]:
    """CustomVoice style instructions."""
    return _load_prompts("instructions.jsonl", with_language=False)


def load_designs() -> list[Prompt]:
    """VoiceDesign voice descriptions."""
    return _load_prompts("designs.jsonl", with_language=True)


def load_voices() -> list[Voice]:
    """Reference clips for voice cloning; each file must exist next to voices.jsonl."""
    path = datasets_dir() / "voices" / "voices.jsonl"
    voices, seen = [], set()
    for lineno, obj in _read_jsonl(path):
        name = _text_field(path, lineno, obj, "name")
        _check_unique(path, lineno, seen, "name", name)
        clip = path.parent / _text_field(path, lineno, obj, "file")
        if not clip.is_file():
            raise DatasetError(f"{path}:{lineno}: reference clip {clip} does not exist")
        voices.append(Voice(name=name, path=clip, ref_text=_text_field(path, lineno, obj, "ref_text"),
                            language=_language_field(path, lineno, obj, None),
                            command=obj.get("command")))
    return voices


def text_stats(items: list[Item]) -> dict:
    """Character counts of a set, for `ttsbench datasets`."""
    lengths = [len(item.text) for item in items]
    languages: dict[str, int] = {}
    for item in items:
        key = item.group or item.language
        languages[key] = languages.get(key, 0) + 1
    return {
        "items": len(items),
        "chars_min": min(lengths),
        "chars_median": statistics.median(lengths),
        "chars_mean": round(statistics.fmean(lengths), 1),
        "chars_max": max(lengths),
        "total_chars": sum(lengths),
        "languages": languages,
    }
