"""How long a request's audio is when end-of-speech is ignored (`--ignore-eos`, for random-weight benchmarks).

Random weights practically never sample end-of-speech, so every request would run to its max_new_tokens and
a benchmark would time minutes of audio for a five-word sentence. With --ignore-eos the engine instead stops
each request at the length a person would take to say its text: characters over a speaking rate, CJK
characters (one syllable each) at 4.5 per second, everything else (letters, digits, spaces, punctuation) at
15 characters per second (about 150 English words per minute), plus a short lead-in and tail. A short
sentence then yields ~2-3 s of audio and a paragraph 15-25 s, as from a real checkpoint, so runs of
different engines over the same text sets compare like with like.
"""

from __future__ import annotations

import math

FRAMES_PER_SECOND = 12.5
CJK_CHARS_PER_SECOND = 4.5
OTHER_CHARS_PER_SECOND = 15.0
PADDING_SECONDS = 0.4  # lead-in and tail silence of natural speech
POLICIES = ("text", "max-new-tokens")


def _is_cjk(ch: str) -> bool:
    code = ord(ch)
    return (0x4E00 <= code <= 0x9FFF or 0x3400 <= code <= 0x4DBF or 0x3040 <= code <= 0x30FF
            or 0xAC00 <= code <= 0xD7AF or 0xF900 <= code <= 0xFAFF)


def speech_seconds(text: str) -> float:
    """Seconds a person takes to say `text` at the rates above."""
    text = " ".join(text.split())
    cjk = sum(_is_cjk(ch) for ch in text)
    return cjk / CJK_CHARS_PER_SECOND + (len(text) - cjk) / OTHER_CHARS_PER_SECOND + PADDING_SECONDS


def text_frames(text: str) -> int:
    """Codec frames (12.5 per second) of speech_seconds(text), at least 2 (the official minimum)."""
    return max(2, math.ceil(speech_seconds(text) * FRAMES_PER_SECOND))


def frame_limit(policy: str, text: str, max_new_tokens: int) -> int:
    """Frames a request runs for when end-of-speech is ignored: `text` (its spoken length, at most
    max_new_tokens) or `max-new-tokens` (always the cap)."""
    if policy == "text":
        return min(max_new_tokens, text_frames(text))
    if policy == "max-new-tokens":
        return max_new_tokens
    raise ValueError(f"unknown length policy {policy!r}; use one of {', '.join(POLICIES)}")
