"""Content checks for the built-in data under datasets/.

Deliberately independent of ttsbench.datasets (the loader): these tests pin down the data files
themselves (schema, counts, character ranges, scripts per language, reference clips), so a broken
file is caught here even if the loader is lenient, and the loader's own tests can trust the data.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import unicodedata
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

DATA = Path(__file__).resolve().parent.parent / "datasets"
VOICES = DATA / "voices"

LANGUAGES = {"Chinese", "English", "Japanese", "Korean", "German", "French", "Russian",
             "Portuguese", "Spanish", "Italian"}
GROUP_LANGUAGE = {"zh": "Chinese", "en": "English", "zh-en": "Chinese", "ja": "Japanese",
                  "ko": "Korean", "de": "German", "fr": "French", "ru": "Russian",
                  "pt": "Portuguese", "es": "Spanish", "it": "Italian"}
SPEAKER_LANGUAGE = {"vivian": "Chinese", "serena": "Chinese", "uncle_fu": "Chinese",
                    "dylan": "Chinese", "eric": "Chinese", "ryan": "English", "aiden": "English",
                    "ono_anna": "Japanese", "sohee": "Korean"}

# (set name, minimum items, shortest, longest): lengths in characters (Unicode code points).
TEXT_SETS = [
    ("short", 64, 1, 49),
    ("medium", 64, 50, 200),
    ("long", 32, 201, 1000),
]


def read_jsonl(path: Path) -> list[dict]:
    """Every line a JSON object: no blank lines, UTF-8, newline-terminated (diff- and append-friendly)."""
    raw = path.read_bytes()
    assert raw.endswith(b"\n"), f"{path.name}: last line must end with a newline"
    rows = []
    for lineno, line in enumerate(raw.decode("utf-8").split("\n")[:-1], 1):
        assert line.strip(), f"{path.name}:{lineno}: blank line"
        obj = json.loads(line)
        assert isinstance(obj, dict), f"{path.name}:{lineno}: not a JSON object"
        rows.append(obj)
    return rows


def assert_clean_text(where: str, text: object) -> None:
    """One line of speakable text: no control characters, no stray whitespace, NFC-normalised."""
    assert isinstance(text, str) and text, f"{where}: text must be a non-empty string"
    assert text == text.strip(), f"{where}: leading/trailing whitespace"
    assert "  " not in text, f"{where}: double space"
    assert not any(unicodedata.category(c) == "Cc" for c in text), f"{where}: control character"
    assert unicodedata.normalize("NFC", text) == text, f"{where}: not NFC-normalised"


def script_counts(text: str) -> Counter:
    """Letters of text by script, from their Unicode names (stdlib only)."""
    counts: Counter = Counter()
    for c in text:
        if not c.isalpha():
            continue
        name = unicodedata.name(c, "")
        if name.startswith("CJK UNIFIED IDEOGRAPH"):
            counts["han"] += 1
        elif name.startswith(("HIRAGANA", "KATAKANA")):
            counts["kana"] += 1
        elif name.startswith("HANGUL"):
            counts["hangul"] += 1
        elif name.startswith("CYRILLIC"):
            counts["cyrillic"] += 1
        elif name.startswith("LATIN"):
            counts["latin"] += 1
        else:
            counts["other:" + name.split()[0]] += 1
    return counts


def assert_script(where: str, text: str, language: str, mixed: bool = False) -> None:
    """The letters of a text belong to the scripts its language is written in."""
    s = script_counts(text)
    allowed = {"Chinese": {"han"}, "Japanese": {"han", "kana"}, "Korean": {"hangul"},
               "Russian": {"cyrillic"}}.get(language, {"latin"})
    if mixed:
        allowed = allowed | {"latin"}
        assert s["han"] and s["latin"], f"{where}: mixed Chinese-English needs both scripts: {text!r}"
    foreign = {k: v for k, v in s.items() if k not in allowed}
    assert not foreign, f"{where}: letters outside {sorted(allowed)} for {language}: {foreign} in {text!r}"
    assert sum(s.values()), f"{where}: no letters"
    if language == "Japanese":
        assert s["kana"], f"{where}: Japanese text without kana: {text!r}"


@pytest.mark.parametrize("name,minimum,lo,hi", TEXT_SETS)
def test_text_set(name, minimum, lo, hi):
    rows = read_jsonl(DATA / f"{name}.jsonl")
    assert len(rows) >= minimum, f"{name}: {len(rows)} items, need >= {minimum} (a c=32 level without repeats)"
    for i, row in enumerate(rows, 1):
        where = f"{name}.jsonl:{i}"
        assert set(row) == {"id", "text", "language"}, f"{where}: keys {sorted(row)}"
        assert row["id"] == f"{name}-{i:03d}", f"{where}: id {row['id']!r}, expected {name}-{i:03d}"
        assert row["language"] == "English", f"{where}: benchmark sets are English"
        assert_clean_text(where, row["text"])
        assert lo <= len(row["text"]) <= hi, f"{where}: {len(row['text'])} characters, want {lo}-{hi}"
        assert_script(where, row["text"], "English")
    lengths = [len(r["text"]) for r in rows]
    if name == "long":
        # Most long items stay under ~600 characters so a realistic TTS run (minutes of audio) stays sane.
        assert sum(n <= 600 for n in lengths) >= 0.9 * len(lengths)
    # Lengths spread over the set's range rather than bunching at one size.
    span = min(hi, 600) - lo
    assert max(lengths) - min(lengths) >= span / 2, f"{name}: lengths {min(lengths)}-{max(lengths)} too uniform"


def test_texts_unique_across_sets():
    texts = Counter()
    for name in ("short", "medium", "long", "multilingual"):
        texts.update(r["text"] for r in read_jsonl(DATA / f"{name}.jsonl"))
    dupes = [t for t, n in texts.items() if n > 1]
    assert not dupes, f"texts used more than once: {dupes}"


def test_multilingual():
    rows = read_jsonl(DATA / "multilingual.jsonl")
    ids = Counter(r.get("id") for r in rows)
    assert all(n == 1 for n in ids.values()), f"duplicate ids: {[i for i, n in ids.items() if n > 1]}"
    per_group = Counter()
    for i, row in enumerate(rows, 1):
        where = f"multilingual.jsonl:{i}"
        assert set(row) == {"id", "text", "language", "group"}, f"{where}: keys {sorted(row)}"
        group = row["group"]
        assert group in GROUP_LANGUAGE, f"{where}: unknown group {group!r}"
        assert row["language"] == GROUP_LANGUAGE[group], f"{where}: language {row['language']!r} for {group}"
        assert re.fullmatch(rf"ml-{re.escape(group)}-\d{{3}}", row["id"]), f"{where}: id {row['id']!r}"
        assert_clean_text(where, row["text"])
        assert 15 <= len(row["text"]) <= 170, f"{where}: {len(row['text'])} characters"
        assert_script(where, row["text"], row["language"], mixed=(group == "zh-en"))
        per_group[group] += 1
    assert set(per_group) == set(GROUP_LANGUAGE)
    assert min(per_group.values()) >= 8, f"each group needs >= 8 items: {dict(per_group)}"
    # Mixed lengths within every group: at least one short sentence and one long one.
    for group in GROUP_LANGUAGE:
        lengths = [len(r["text"]) for r in rows if r["group"] == group]
        assert max(lengths) >= 2 * min(lengths), f"{group}: lengths {min(lengths)}-{max(lengths)} too uniform"


def test_speakers():
    rows = read_jsonl(DATA / "speakers.jsonl")
    assert [r["name"] for r in rows] == list(SPEAKER_LANGUAGE)
    for row in rows:
        assert set(row) == {"name", "language", "description"}
        assert row["language"] == SPEAKER_LANGUAGE[row["name"]], row
        assert_clean_text(f"speakers.jsonl {row['name']}", row["description"])
    by_name = {r["name"]: r["description"] for r in rows}
    assert "Beijing" in by_name["dylan"] and "Sichuan" in by_name["eric"]


def _prompt_rows(filename: str, prefix: str, keys: set, longest: int) -> list[dict]:
    rows = read_jsonl(DATA / filename)
    for i, row in enumerate(rows, 1):
        where = f"{filename}:{i}"
        assert set(row) == keys, f"{where}: keys {sorted(row)}"
        assert row["id"] == f"{prefix}-{i:03d}", f"{where}: id {row['id']!r}"
        assert_clean_text(where, row["text"])
        assert len(row["text"]) <= longest, f"{where}: {len(row['text'])} characters > {longest}"
    assert len({r["text"] for r in rows}) == len(rows), f"{filename}: duplicate texts"
    return rows


def test_instructions():
    rows = _prompt_rows("instructions.jsonl", "instruct", {"id", "text"}, 200)
    assert len(rows) >= 16
    chinese = [r for r in rows if script_counts(r["text"])["han"]]
    english = [r for r in rows if not script_counts(r["text"])["han"]]
    for row in english:
        assert_script(row["id"], row["text"], "English")
    for row in chinese:
        assert_script(row["id"], row["text"], "Chinese")
    assert len(chinese) >= 6 and len(english) >= 6


def test_designs():
    rows = _prompt_rows("designs.jsonl", "design", {"id", "text", "language"}, 300)
    assert len(rows) >= 32
    for row in rows:
        assert row["language"] in {"English", "Chinese"}, row
        assert_script(row["id"], row["text"], row["language"])
    counts = Counter(r["language"] for r in rows)
    assert counts["English"] >= 12 and counts["Chinese"] >= 12, counts


def _voice_rows() -> list[dict]:
    return read_jsonl(VOICES / "voices.jsonl")


def test_voices_manifest():
    rows = _voice_rows()
    assert len(rows) >= 6
    assert len({r["name"] for r in rows}) == len(rows), "duplicate voice names"
    for row in rows:
        assert set(row) == {"name", "file", "ref_text", "language", "command"}, row
        assert re.fullmatch(r"[a-z0-9_]+", row["name"]), row["name"]
        assert row["file"] == f"{row['name']}.wav"
        assert row["language"] in LANGUAGES
        assert_clean_text(row["name"], row["ref_text"])
        assert_script(row["name"], row["ref_text"], row["language"])
        # The recorded command is the one that made the clip: it speaks ref_text and writes the file.
        assert row["command"].startswith("espeak-ng "), row["command"]
        assert f'"{row["ref_text"]}"' in row["command"]
        assert f" {row['file']} " in row["command"]
    assert len({r["language"] for r in rows}) >= 4, "voices should cover several languages"
    listed = {r["file"] for r in rows}
    on_disk = {p.name for p in VOICES.glob("*.wav")}
    assert listed == on_disk, f"unlisted clips {on_disk - listed}, missing clips {listed - on_disk}"
    total = sum((VOICES / f).stat().st_size for f in listed)
    assert total < 2_000_000, f"reference clips take {total} bytes"


@pytest.mark.parametrize("row", _voice_rows(), ids=lambda r: r["name"])
def test_voice_clip(row):
    path = VOICES / row["file"]
    info = sf.info(str(path))
    assert (info.format, info.subtype, info.samplerate, info.channels) == ("WAV", "PCM_16", 24000, 1), info
    # 3-8 s as made; the API accepts 1-30 s of reference audio.
    assert 3.0 <= info.duration <= 8.0, f"{path.name}: {info.duration:.2f} s"
    audio, _ = sf.read(str(path), dtype="float32")
    peak = float(np.max(np.abs(audio)))
    assert 0.5 <= peak < 1.0, f"{path.name}: peak {peak:.3f} (normalised to -3 dBFS when made)"
    # Speech, not silence or a constant: a real share of 20 ms frames carries energy.
    frames = audio[: len(audio) // 480 * 480].reshape(-1, 480)
    rms = np.sqrt(np.mean(frames**2, axis=1))
    assert np.mean(rms > 0.02) > 0.5, f"{path.name}: mostly silent"


@pytest.mark.parametrize("row", _voice_rows()[:2], ids=lambda r: r["name"])
def test_voice_command_reproduces_clip(row, tmp_path):
    """The recorded command really makes such a clip (same format, about the same length).
    Byte equality is not required: other espeak-ng/sox versions synthesise slightly differently."""
    for tool in ("espeak-ng", "sox"):
        assert shutil.which(tool), f"{tool} missing: run scripts/setup.sh --test"
    subprocess.run(["bash", "-o", "pipefail", "-c", row["command"]], cwd=tmp_path, check=True)
    made, committed = sf.info(str(tmp_path / row["file"])), sf.info(str(VOICES / row["file"]))
    assert (made.samplerate, made.channels, made.subtype) == (committed.samplerate, committed.channels,
                                                                committed.subtype)
    assert abs(made.duration - committed.duration) <= 0.15 * committed.duration


def test_make_voices_script_lists_every_voice():
    script = (VOICES / "make_voices.sh").read_text(encoding="utf-8")
    for row in _voice_rows():
        assert re.search(rf"^voice {row['name']} +{row['language']} ", script, re.M), row["name"]
        assert row["ref_text"] in script


def test_readme_counts_match_files():
    """datasets/README.md states each file's item count; keep it truthful."""
    readme = (DATA / "README.md").read_text(encoding="utf-8")
    files = {"short.jsonl": DATA / "short.jsonl", "medium.jsonl": DATA / "medium.jsonl",
             "long.jsonl": DATA / "long.jsonl", "multilingual.jsonl": DATA / "multilingual.jsonl",
             "speakers.jsonl": DATA / "speakers.jsonl", "instructions.jsonl": DATA / "instructions.jsonl",
             "designs.jsonl": DATA / "designs.jsonl", "voices/voices.jsonl": VOICES / "voices.jsonl"}
    for label, path in files.items():
        n = len(read_jsonl(path))
        assert re.search(rf"\|\s*`{re.escape(label)}`\s*\|\s*{n}\s*\|", readme), \
            f"README.md has no table row '| `{label}` | {n} |'"
