"""`ttsbench run`, `summarize` and `datasets` end to end against a real scripted server."""

from __future__ import annotations

import csv
import json
import shutil
import socket

import pytest
import soundfile
from typer.testing import CliRunner

from tests.scripted_server import running
from tests.test_harness_datasets import _write, fixture_data  # noqa: F401  (pytest fixture)
from ttsbench.cli import app

# Fields every request record carries (docs/run-format.md).
RECORD_FIELDS = {
    "id", "item_id", "task", "set", "language", "text", "voice", "instructions", "ref_audio_path", "ref_text",
    "mode", "level", "concurrency", "rate", "warmup", "stream", "ok", "error", "error_detail", "http_status",
    "t_start", "t_headers_ms", "ttfab_ms", "e2e_ms", "chunks", "bytes", "sample_rate", "audio_s", "rtf",
    "n_chunks", "max_gap_ms", "underrun_s", "underrun_max_s", "underrun_buffered_s", "underrun_chunk", "audio_path",
    "session"}
ROW_FIELDS = {"task", "set", "level", "mode", "concurrency", "rate", "completed", "failed", "errors", "duration_s",
              "request_throughput", "audio_throughput", "frames_per_s", "total_audio_s", "goodput", "starved",
              "starved_at_chunk"} | {
    f"{m}_{s}" for m in ("ttfab_ms", "e2e_ms", "rtf", "underrun_s", "max_gap_ms")
    for s in ("mean", "median", "p90", "p95", "p99", "max")}

cli = CliRunner()


@pytest.fixture
def data(fixture_data):  # noqa: F811
    _write(fixture_data / "short.jsonl",
           [{"id": f"s{i}", "text": f"short {i}", "language": "English"} for i in range(6)])
    return fixture_data


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    script = {f"short {i}": {"chunks": [[5, 4800], [10, 4800]]} for i in range(6)}
    script["short 5"] = {"status": 503}
    with running(script, tmp_path_factory.mktemp("cli")) as srv:
        yield srv


def _run(*args):
    return cli.invoke(app, ["run", *args], catch_exceptions=False)


def test_run_all_tasks_writes_the_run_directory(server, data, tmp_path):
    out = tmp_path / "run"
    result = _run("--url", server.url, "--task", "all", "--set", "short", "--concurrency", "1,3",
                  "--num-requests", "6", "--warmup", "1", "--out", str(out), "--api-key", "secret-key",
                  "--label", "smoke", "--slo-ttfab-ms", "10000")
    assert result.exit_code == 0, result.output
    assert "ttsbench summary" in result.output and "custom/short/c3" in result.output

    info = json.loads((out / "run.json").read_text())
    assert info["version"] == 1 and info["url"] == server.url and info["label"] == "smoke"
    assert info["config"]["tasks"] == ["custom", "design", "clone"] and info["config"]["concurrency"] == [1, 3]
    assert info["config"]["model"] == "scripted-tts"  # taken from /v1/models
    assert info["server"]["health"]["body"] == {"status": "ok"} and info["finished_at"]
    assert {"hostname", "cpu_count", "python"} <= set(info["host"]) and info["packages"]["aiohttp"]
    assert "secret-key" not in (out / "run.json").read_text()

    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 2 * (6 + 1)
    for r in records:
        assert RECORD_FIELDS <= set(r), RECORD_FIELDS - set(r)
    measured = [r for r in records if not r["warmup"]]
    assert len({r["id"] for r in records}) == len(records)
    assert {r["id"] for r in measured if r["task"] == "design"} == {f"design/short/{lv}/{i}" for lv in ("c1", "c3") for i in range(6)}
    failed = [r for r in measured if not r["ok"]]
    assert {r["error"] for r in failed} == {"http_503"} and len(failed) == 6  # item 5, once per task and level
    clone = [r for r in measured if r["task"] == "clone" and r["ok"]][0]
    assert clone["voice"] == "v1" and clone["ref_text"] == "Hello there." and clone["ref_audio_path"] == "voices/v1.wav"
    samples, rate = soundfile.read(out / clone["audio_path"], dtype="int16")
    assert rate == 24000 and len(samples) == 4800
    sent = [e for e in server.log() if e.get("authorization")]
    assert sent and all(e["authorization"] == "Bearer secret-key" for e in sent)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["slo"] == {"ttfab_ms": 10000.0, "underrun_s": 0.0} and summary["quality"] == []
    assert len(summary["rows"]) == 6
    for row in summary["rows"]:
        assert ROW_FIELDS <= set(row) and row["completed"] == 5 and row["errors"] == {"http_503": 1}
        assert row["goodput"] == pytest.approx(5 / 6)
        assert row["starved"] == 0 and row["starved_at_chunk"] == {}
    with open(out / "summary.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == 6 and json.loads(csv_rows[0]["errors"]) == {"http_503": 1}
    assert json.loads(csv_rows[0]["starved_at_chunk"]) == {}

    # summarize recomputes the same figures from requests.jsonl alone
    (out / "summary.json").unlink()
    result = cli.invoke(app, ["summarize", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "summary.json").read_text())["rows"] == summary["rows"]
    result = cli.invoke(app, ["summarize", str(out), "--slo-ttfab-ms", "0.001"])
    assert all(r["goodput"] == 0 for r in json.loads((out / "summary.json").read_text())["rows"])


def test_resume_continues_an_interrupted_run(server, data, tmp_path):
    out = tmp_path / "run"
    assert _run("--url", server.url, "--concurrency", "1,2", "--num-requests", "4", "--warmup", "0",
                "--out", str(out)).exit_code == 0
    lines = (out / "requests.jsonl").read_text().splitlines()
    # as if killed during the second level: 5 records kept, the 6th cut off mid-line
    (out / "requests.jsonl").write_text("\n".join(lines[:5]) + "\n" + lines[5][:30])
    with pytest.warns(UserWarning, match="requests.jsonl:6: skipping an incomplete record"):
        result = _run("--resume", str(out), "--url", server.url)
    assert result.exit_code == 0, result.output
    with pytest.warns(UserWarning, match="incomplete record"):
        from ttsbench.storage import RunDir
        records = RunDir.open(out).records()
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted(f"custom/short/c{c}/{i}" for c in (1, 2) for i in range(4))
    assert [r["session"] for r in records] == [0] * 5 + [1] * 3
    info = json.loads((out / "run.json").read_text())
    assert len(info["sessions"]) == 2 and info["sessions"][1]["finished_at"]
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert [(r["level"], r["completed"] + r["failed"]) for r in rows] == [("c1", 4), ("c2", 4)]


def test_open_loop_rate_levels(server, data, tmp_path):
    out = tmp_path / "run"
    result = _run("--url", server.url, "--request-rate", "50,inf", "--num-requests", "5", "--warmup", "0",
                  "--no-save-audio", "--out", str(out))
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert [(r["level"], r["mode"], r["rate"], r["concurrency"]) for r in rows] == [
        ("r50", "rate", 50.0, None), ("rinf", "rate", None, None)]
    assert not (out / "audio").exists()
    assert json.loads((out / "run.json").read_text())["config"]["request_rate"] == [50.0, "inf"]


def test_user_dataset_file(server, data, tmp_path):
    mine = _write(tmp_path / "mine.jsonl", [{"text": "short 1"}, {"text": "short 2", "language": "english"}])
    out = tmp_path / "run"
    assert _run("--url", server.url, "--dataset", str(mine), "--num-requests", "2", "--warmup", "0",
                "--out", str(out)).exit_code == 0
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert {(r["set"], r["item_id"], r["language"]) for r in records} == {("mine", "mine-1", "Auto"), ("mine", "mine-2", "English")}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args,code,message", [
    (["--url", "URL", "--concurrency", "0"], 2, "positive integer"),
    (["--url", "URL", "--concurrency", "2", "--request-rate", "1"], 2, "not both"),
    (["--url", "URL", "--request-rate", "fast"], 2, "not a number"),
    (["--url", "URL", "--task", "sing"], 2, "'sing' is not one of"),
    (["--url", "URL", "--set", "huge"], 2, "'huge' is not one of"),
    (["--url", "URL", "--language", "Elvish"], 2, "'Elvish' is not one of"),
    (["--url", "URL", "--stream-format", "ws"], 2, "'ws' is not one of"),
    (["--url", "http://127.0.0.1:PORT"], 1, "cannot reach the server"),
])
def test_bad_options_fail_clearly(server, data, tmp_path, args, code, message):
    args = [a.replace("URL", server.url).replace("PORT", str(_closed_port())) for a in args]
    result = cli.invoke(app, ["run", *args, "--out", str(tmp_path / "run")])
    assert result.exit_code == code and message in result.output, result.output
    assert not (tmp_path / "run" / "requests.jsonl").exists()


def test_bad_dataset_line_and_reused_directory(server, data, tmp_path):
    bad = _write(tmp_path / "bad.jsonl", [{"text": "ok"}, '{"text": 5}'])
    result = cli.invoke(app, ["run", "--url", server.url, "--dataset", str(bad)])
    assert result.exit_code == 2 and f"{bad}:2: field 'text'" in result.output
    out = tmp_path / "run"
    assert _run("--url", server.url, "--num-requests", "1", "--warmup", "0", "--out", str(out)).exit_code == 0
    result = cli.invoke(app, ["run", "--url", server.url, "--out", str(out)])
    assert result.exit_code == 2 and "--resume" in result.output


def test_datasets_command(data):
    result = cli.invoke(app, ["datasets"])
    assert result.exit_code == 2 and "medium.jsonl: no such file" in result.output


def test_datasets_command_builtin(monkeypatch):
    monkeypatch.delenv("TTSBENCH_DATASETS", raising=False)
    from ttsbench import datasets
    if not (datasets.datasets_dir() / "multilingual.jsonl").exists():
        pytest.skip("built-in data not written yet")
    result = cli.invoke(app, ["datasets"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for name in ("short", "medium", "long", "multilingual", "speakers", "voices"):
        assert name in result.output


def test_summarize_needs_a_run_directory(tmp_path):
    result = cli.invoke(app, ["summarize", str(tmp_path)])
    assert result.exit_code == 2 and "not a run directory" in result.output


def test_ctrl_c_keeps_completed_requests_and_resume_finishes(tmp_path):
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    # 0.7 s a request, 30 at two a time: the interrupt lands mid-run even when the run's writer starts slowly
    script = {f"slow {i}": {"chunks": [[100 * k, 4800] for k in range(1, 8)]} for i in range(30)}
    data = _write(tmp_path / "slow.jsonl", [{"text": t} for t in script])
    out = tmp_path / "run"
    exe = str(Path(sys.executable).parent / "ttsbench")
    with running(script, tmp_path / "server") as srv:
        proc = subprocess.Popen([exe, "run", "--url", srv.url, "--dataset", str(data), "--concurrency", "2",
                                 "--num-requests", "30", "--warmup", "0", "--out", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        requests_file = out / "requests.jsonl"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (requests_file.exists() and len(requests_file.read_text().splitlines()) >= 4):
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130 and f"--resume {out}" in output, output
        kept = [json.loads(line) for line in requests_file.read_text().splitlines()]
        assert 4 <= len(kept) < 30 and all(r["ok"] for r in kept)
        assert json.loads((out / "summary.json").read_text())["rows"][0]["completed"] == len(kept)
        assert json.loads((out / "run.json").read_text())["finished_at"] is None

        result = _run("--resume", str(out), "--url", srv.url)
        assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in requests_file.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(f"custom/slow/c2/{i}" for i in range(30))
    assert records[:len(kept)] == kept


def test_clone_upload_mode_registers_voices_once(server, data, tmp_path):
    out = tmp_path / "run"
    seen = len(server.log())
    result = _run("--url", server.url, "--task", "clone", "--clone-mode", "upload", "--num-requests", "3",
                  "--warmup", "0", "--out", str(out))
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    sent = server.entries([r["text"] for r in records], since=seen)
    uploads = [e["upload"] for e in server.log()[seen:] if "upload" in e]
    assert [(u["name"], u["ref_text"]) for u in uploads] == [("v1", "Hello there.")] and uploads[0]["file_size"] > 44
    assert len(sent) == 3 and all(e["fields"]["voice"] == "v1" and e["fields"]["task_type"] == "Base"
                                  and "ref_audio" not in e["fields"] for e in sent.values())


def test_clone_levels_warm_up_every_voice_first(server, data, tmp_path):
    """A clone level resending its voices warms up with one request per voice (3 here, against --warmup 1), so no
    level's measured requests wait on a voice new to the server; fresh clips warm up as asked, and --warmup 0 sends
    none."""
    for name in ("v2", "v3"):
        shutil.copy(data / "voices" / "v1.wav", data / "voices" / f"{name}.wav")
    entries = [json.loads(line) for line in (data / "voices" / "voices.jsonl").read_text().splitlines()]
    _write(data / "voices" / "voices.jsonl", entries + [{**entries[0], "name": n, "file": f"{n}.wav"}
                                                        for n in ("v2", "v3")])

    def warmups(*args):
        out = tmp_path / f"run-{len(list(tmp_path.iterdir()))}"
        result = _run("--url", server.url, "--task", "clone", "--set", "short", "--concurrency", "2",
                      "--num-requests", "4", "--out", str(out), *args)
        assert result.exit_code == 0, result.output
        records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
        assert sum(not r["warmup"] for r in records) == 4
        return sorted(r["voice"] for r in records if r["warmup"])

    assert warmups("--warmup", "1") == ["v1", "v2", "v3"]
    assert warmups("--warmup", "1", "--clone-mode", "upload") == ["v1", "v2", "v3"]
    more = warmups("--warmup", "4")
    assert len(more) == 4 and set(more) == {"v1", "v2", "v3"}
    assert len(warmups("--warmup", "1", "--clone-mode", "fresh")) == 1
    assert warmups("--warmup", "0") == []
