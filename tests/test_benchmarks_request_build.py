"""benchmarks/request_build_bench.py: every task and clone mode builds bodies the runner would send, and is timed."""

import json
import sys

from benchmarks import request_build_bench


def test_every_case_is_timed(tmp_path, monkeypatch, capsys):
    out = tmp_path / "build.json"
    monkeypatch.setattr(sys, "argv", ["request_build_bench.py", "--set", "short", "--bodies", "5", "--json", str(out)])
    request_build_bench.main()
    rows = json.loads(out.read_text())
    assert [(r["task"], r["clone_mode"]) for r in rows] == list(request_build_bench.CASES)
    assert all(r["ms"] > 0 for r in rows)
    sizes = {(r["task"], r["clone_mode"]): r["bytes"] for r in rows}
    assert sizes["clone", "inline"] > 100_000 > sizes["clone", "upload"]  # a clip inline, a name uploaded
    assert "| clone | fresh |" in capsys.readouterr().out
