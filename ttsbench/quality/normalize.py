"""Text normalization and WER/CER scoring, following the Seed-TTS-eval protocol.

Seed-TTS-eval (the figures TTS papers report) removes all punctuation except the apostrophe, collapses
spaces, lowercases, and scores Chinese per character (so its Chinese "WER" is a CER). We extend the
per-character rule to every CJK script (Han, kana, Hangul) and keep words for everything else, so mixed
Chinese/English text is scored per Chinese character and per English word (a mixed error rate).
ASR output in traditional Chinese is converted to simplified first, as Seed-TTS-eval does for
paraformer output.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

# Characters scored one by one: CJK ideographs (with extensions and compatibility forms), kana, Hangul.
_CJK_RANGES = (
    (0x3040, 0x30FF),  # Hiragana, Katakana
    (0x31F0, 0x31FF),  # Katakana phonetic extensions
    (0x3400, 0x4DBF),  # CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xAC00, 0xD7AF),  # Hangul syllables
    (0x1100, 0x11FF),  # Hangul jamo
    (0x3130, 0x318F),  # Hangul compatibility jamo
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFF66, 0xFF9F),  # half-width Katakana
    (0x20000, 0x3134F),  # CJK extensions B-G
)
_APOSTROPHES = {"\u2019": "'", "\u2018": "'", "\u02bc": "'", "\uff07": "'"}


def is_cjk(ch: str) -> bool:
    code = ord(ch)
    return any(lo <= code <= hi for lo, hi in _CJK_RANGES)


def _is_punctuation(ch: str) -> bool:
    # Unicode P* (punctuation) and S* (symbols) cover ASCII string.punctuation and the Chinese
    # punctuation list (zhon.hanzi.punctuation) Seed-TTS-eval strips.
    return ch != "'" and unicodedata.category(ch)[0] in "PS"


def to_simplified(text: str) -> str:
    """Traditional -> simplified Chinese (zhconv, the converter Seed-TTS-eval uses); other text unchanged."""
    if not any(is_cjk(c) for c in text):
        return text
    import zhconv
    return zhconv.convert(text, "zh-cn")


def normalize(text: str) -> str:
    """Seed-TTS-eval normalization: NFKC, punctuation removed except the apostrophe, lowercase,
    spaces collapsed. Punctuation is deleted, not replaced by a space, as in Seed-TTS-eval."""
    text = unicodedata.normalize("NFKC", text)
    text = "".join(_APOSTROPHES.get(c, c) for c in text)
    text = "".join(c for c in text if not _is_punctuation(c))
    return " ".join(text.lower().split())


def tokens(normalized: str) -> list[str]:
    """Scoring units: each CJK character on its own, whitespace-separated words otherwise."""
    out: list[str] = []
    for word in normalized.split():
        run = ""
        for ch in word:
            if is_cjk(ch):
                if run:
                    out.append(run)
                    run = ""
                out.append(ch)
            else:
                run += ch
        if run:
            out.append(run)
    return out


def unit_of(ref_tokens: list[str]) -> str:
    """`char` when any reference unit is a CJK character (CER or mixed), else `word` (WER)."""
    return "char" if any(len(t) == 1 and is_cjk(t) for t in ref_tokens) else "word"


@dataclass(frozen=True)
class Score:
    """One utterance: error counts against the reference, in scoring units."""
    ref_norm: str
    hyp_norm: str
    unit: str
    ref_units: int
    substitutions: int
    deletions: int
    insertions: int

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions

    @property
    def wer(self) -> float | None:
        """(S + D + I) / N; None when the reference has no scoring units (nothing to compare)."""
        return self.errors / self.ref_units if self.ref_units else None


def score(reference: str, hypothesis: str) -> Score:
    """Score an ASR transcript against the input text (jiwer's alignment on our units)."""
    import jiwer

    ref_norm = normalize(reference)
    hyp_norm = normalize(to_simplified(hypothesis))
    ref_t, hyp_t = tokens(ref_norm), tokens(hyp_norm)
    unit = unit_of(ref_t)
    if not ref_t:
        return Score(ref_norm, hyp_norm, unit, 0, 0, 0, len(hyp_t))
    if not hyp_t:
        return Score(ref_norm, hyp_norm, unit, len(ref_t), 0, len(ref_t), 0)
    # jiwer splits on spaces: our units never contain one, so joining with spaces keeps them whole.
    out = jiwer.process_words(" ".join(ref_t), " ".join(hyp_t))
    return Score(ref_norm, hyp_norm, unit, len(ref_t), out.substitutions, out.deletions, out.insertions)


def corpus_wer(counts: list[tuple[int, int]]) -> float | None:
    """Total errors over total reference units, from (errors, reference units) per utterance: the
    corpus-level figure, weighted by length. Utterances without reference units count in neither."""
    scored = [(e, u) for e, u in counts if u]
    units = sum(u for _, u in scored)
    return sum(e for e, _ in scored) / units if units else None
