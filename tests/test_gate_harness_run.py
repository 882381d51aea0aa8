"""The whole chain on real run directories: `ttsbench run` against a scripted server on a loopback
socket, then `report`, `baseline` and `gate` on what it wrote (the run-format contract end to end)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.scripted_server import running
from tests.test_report_html import GROUP_FIGURES, parse
from ttsbench.cli import app

cli = CliRunner()
N = 4
CHUNK = 9600            # 0.2 s of 24 kHz 16-bit mono


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of a fast server and one of a slow one (first audio after 300 ms, stalls after)."""
    root = tmp_path_factory.mktemp("chain")
    script = {}
    for i in range(N):
        script[f"fast {i}"] = {"chunks": [[20, CHUNK], [60, CHUNK], [100, CHUNK]]}
        script[f"slow {i}"] = {"chunks": [[300, CHUNK], [700, CHUNK], [1100, CHUNK]]}
    for name in ("fast", "slow"):
        (root / f"{name}.jsonl").write_text(
            "".join(json.dumps({"id": f"{name}{i}", "text": f"{name} {i}", "language": "English"}) + "\n"
                    for i in range(N)))
    out = {}
    with running(script, root / "server") as srv:
        for label, data in (("fast", "fast"), ("fast-again", "fast"), ("slow", "slow")):
            # The set takes its name from the dataset file's stem, so both datasets are the set "speech".
            (root / "speech.jsonl").write_text((root / f"{data}.jsonl").read_text())
            result = cli.invoke(app, ["run", "--url", srv.url, "--dataset", str(root / "speech.jsonl"),
                                      "--concurrency", "1,2", "--num-requests", str(N), "--warmup", "0",
                                      "--no-save-audio", "--label", label, "--out", str(root / label)],
                                catch_exceptions=False)
            assert result.exit_code == 0, result.output
            out[label] = root / label
    return out


def test_report_of_real_runs(runs, tmp_path):
    out = tmp_path / "report.html"
    result = cli.invoke(app, ["report", str(runs["fast"]), str(runs["slow"]), "-o", str(out)])
    assert result.exit_code == 0, result.output
    p = parse(out)
    sec = p.sections["results-custom-speech-concurrency"]
    assert set(sec["figures"]) == GROUP_FIGURES and sec["figures"].count("timeline") == 2
    assert "c1" in sec["text"] and "c2" in sec["text"] and "slow" in sec["text"]
    assert 'id="notes"' not in out.read_text()       # e.g. recomputed underruns agree with the stored ones
    rows = json.loads((runs["slow"] / "summary.json").read_text())["rows"]
    assert all(r["underrun_s_max"] > 0.1 for r in rows)               # the slow stream really stalled


def test_gate_on_real_runs(runs, tmp_path):
    base = tmp_path / "fast.json"
    assert cli.invoke(app, ["baseline", str(runs["fast"]), "-o", str(base)]).exit_code == 0
    # Loopback timings jitter on a busy machine: a generous tolerance, as a CI gate would use.
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nmetric = "failed"\nmax = 0\n'
                     '[[rule]]\nmetric = "ttfab_ms_p95"\nmax_rise_pct = 300\nmax_rise = 100\n'
                     '[[rule]]\nmetric = "underrun_s_p95"\nmax_rise = 0.1\n')
    same = cli.invoke(app, ["gate", "--baseline", str(base), "--current", str(runs["fast-again"]),
                            "--rules", str(rules)], terminal_width=200)
    assert same.exit_code == 0, same.output
    slow = cli.invoke(app, ["gate", "--baseline", str(base), "--current", str(runs["slow"]),
                            "--rules", str(rules)], terminal_width=200)
    assert slow.exit_code == 1, slow.output
    failing = [line for line in slow.output.splitlines() if "FAIL" in line and "│" in line]
    assert {("ttfab_ms_p95" in line, "underrun_s_p95" in line) for line in failing} == {(True, False), (False, True)}
    assert len(failing) == 4        # both rules at both levels
