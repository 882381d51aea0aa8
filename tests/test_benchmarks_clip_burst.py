"""benchmarks/clip_burst_bench.py runs a burst of inline clips through the server's clip step: each distinct clip
is decoded once however many requests bring it at once."""

import sys

from benchmarks import clip_burst_bench


def test_a_burst_decodes_each_distinct_clip_once(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["clip_burst_bench.py", "--requests", "6", "--voices", "2", "--reps", "1"])
    clip_burst_bench.main()
    assert "6 clips of 2 voices at once" in (out := capsys.readouterr().out) and out.rstrip().endswith("2 decodings")
