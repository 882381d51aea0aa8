"""benchmarks/voice_encode_bench.py times each built-in voice's encoding by part; on CPU with the tiny encoders
it must still run end to end and its parts must add up to each total."""

import json
import sys

import pytest

from benchmarks import voice_encode_bench


def test_every_clip_is_timed_by_part(tmp_path, monkeypatch, capsys):
    out = tmp_path / "voices.json"
    monkeypatch.setattr(sys, "argv", ["voice_encode_bench.py", "--device", "cpu", "--size", "tiny", "--reps", "1",
                                      "--json", str(out)])
    voice_encode_bench.main()
    result = json.loads(out.read_text())
    clips = sorted(p.name for p in voice_encode_bench.VOICES.glob("*.wav"))
    assert [r["clip"] for r in result["rows"]] == clips and len(clips) == 8
    for row in result["rows"]:
        assert 3 < row["seconds"] < 6
        for call in (row["first"], row["repeat"]):
            parts = call["resample"] + call["mel"] + call["speaker_net"] + call["codec"]
            assert call["codec"] > 0 and call["speaker_net"] > 0 and parts == pytest.approx(call["total"], abs=0.05)
    assert "mean over 8 clips" in capsys.readouterr().out
