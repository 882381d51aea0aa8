"""Seed-TTS-eval normalization and WER/CER against figures computed by hand."""

from __future__ import annotations

import pytest

from ttsbench.quality import normalize as n
from ttsbench.quality.asr import language_code


@pytest.mark.parametrize("raw, expected", [
    ("Hello, World! It's a test.", "hello world it's a test"),            # apostrophe kept
    ("It\u2019s   fine...  really?!", "it's fine really"),                 # curly apostrophe, spaces collapsed
    ("\u201cQuoted\u201d (parenthesised) - dashed; semi: colon", "quoted parenthesised dashed semi colon"),
    ("\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002", "\u4eca\u5929\u5929\u6c14\u5f88\u597d"),  # 今天天气很好。
    ("\u300c\u4f60\u597d\u300d\u3001\u300a\u4e16\u754c\u300b\u2026\u2014\uff01", "\u4f60\u597d\u4e16\u754c"),
    ("\uff21\uff22\uff23 \uff11\uff12\uff13", "abc 123"),                   # full-width forms (NFKC)
    ("$5 & 10% off @home", "5 10 off home"),                             # symbols go like punctuation
])
def test_normalize(raw, expected):
    assert n.normalize(raw) == expected


def test_tokens_split_cjk_per_character_and_keep_words():
    assert n.tokens("\u6211\u7528iphone\u62cd\u7167 very nice") == [
        "\u6211", "\u7528", "iphone", "\u62cd", "\u7167", "very", "nice"]
    assert n.tokens(n.normalize("\u3053\u3093\u306b\u3061\u306f\u4e16\u754c")) == list(
        "\u3053\u3093\u306b\u3061\u306f\u4e16\u754c")                        # こんにちは世界: kana and kanji
    assert n.tokens(n.normalize("\uc548\ub155\ud558\uc138\uc694 \uc138\uacc4")) == list(
        "\uc548\ub155\ud558\uc138\uc694\uc138\uacc4")                        # 안녕하세요 세계: Hangul syllables


def _check(s: n.Score, units: int, sub: int, dele: int, ins: int, wer: float, unit: str) -> None:
    assert (s.ref_units, s.substitutions, s.deletions, s.insertions, s.unit) == (units, sub, dele, ins, unit)
    assert s.wer == pytest.approx(wer)


def test_english_wer_by_hand():
    # hello world it's a test / hello word its a test: world->word, it's->its = 2 of 5
    _check(n.score("Hello, World! It's a test.", "hello word its a test"), 5, 2, 0, 0, 2 / 5, "word")
    # one deletion of 6, one insertion over 6
    _check(n.score("The cat sat on the mat.", "The cat sat on mat."), 6, 0, 1, 0, 1 / 6, "word")
    _check(n.score("The cat sat on the mat.", "the cat sat on the mat today"), 6, 0, 0, 1, 1 / 6, "word")
    # case and punctuation never count
    _check(n.score("Please, CLOSE the door!", "please close the door"), 4, 0, 0, 0, 0.0, "word")


def test_chinese_cer_by_hand():
    # 今天天气很好。 vs 今天天氣很好啊: 氣 is 气 in traditional (converted first), 啊 inserted: 1 of 6
    _check(n.score("\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002", "\u4eca\u5929\u5929\u6c23\u5f88\u597d\u554a"),
           6, 0, 0, 1, 1 / 6, "char")
    # 我们下午去公园 vs 我们上午去公园吧: 下->上 substituted, 吧 inserted: 2 of 7
    _check(n.score("\u6211\u4eec\u4e0b\u5348\u53bb\u516c\u56ed", "\u6211\u4eec\u4e0a\u5348\u53bb\u516c\u56ed\u5427"),
           7, 1, 0, 1, 2 / 7, "char")
    # spaces the ASR puts between characters do not matter
    _check(n.score("\u4f60\u597d\u4e16\u754c", "\u4f60 \u597d \u4e16 \u754c"), 4, 0, 0, 0, 0.0, "char")


def test_mixed_text_scores_chinese_characters_and_english_words():
    # 我用iPhone拍照, very nice! -> 我 用 iphone 拍 照 very nice (7 units); "very" heard as 很: 1 of 7
    _check(n.score("\u6211\u7528iPhone\u62cd\u7167, very nice!", "\u6211\u7528 iPhone \u62cd\u7167\uff0c\u5f88 nice"),
           7, 1, 0, 0, 1 / 7, "char")


def test_empty_transcripts_and_references():
    _check(n.score("Hello there.", ""), 2, 0, 2, 0, 1.0, "word")           # silence: every word deleted
    empty_ref = n.score("...", "noise words")
    assert empty_ref.ref_units == 0 and empty_ref.wer is None and empty_ref.insertions == 2


def test_corpus_wer_weights_by_length():
    scores = [n.score("Hello, World! It's a test.", "hello word its a test"),   # 2 errors / 5
              n.score("The cat sat on the mat.", "The cat sat on mat."),       # 1 error / 6
              n.score("...", "ignored")]                                       # no reference units
    assert n.corpus_wer([(s.errors, s.ref_units) for s in scores]) == pytest.approx(3 / 11)
    assert n.corpus_wer([]) is None


@pytest.mark.parametrize("language, code", [
    ("English", "en"), ("Chinese", "zh"), ("japanese", "ja"), ("Korean", "ko"), ("German", "de"),
    ("French", "fr"), ("Russian", "ru"), ("Portuguese", "pt"), ("Spanish", "es"), ("Italian", "it"),
    ("en", "en"), ("Auto", None), ("", None), (None, None), ("Klingon", None),
])
def test_language_from_the_dataset_item(language, code):
    assert language_code(language) == code
