"""`ttsbench run` without --url: the embedded reference server, started, measured and stopped, per task."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
SERVE_ARGS = "--max-batch-size 4 --max-model-len 512 --chunk-frames 5 --first-chunk-frames 2 --left-context-frames 8"


def ttsbench(*args, timeout=600):
    return subprocess.run([sys.executable, "-c", "from ttsbench.cli import app; app()", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("task,extra", [("custom", []), ("design", ["--no-stream"]),
                                        ("clone", ["--clone-mode", "upload", "--stream-format", "sse"])])
def test_run_against_the_embedded_server(tmp_path, task, extra):
    out = tmp_path / "run"
    proc = ttsbench("run", "--task", task, "--set", "short", "--num-requests", "2", "--concurrency", "2",
                    "--warmup", "0", "--max-new-tokens", "4", "--sampling-seed", "1", "--serve-args", SERVE_ARGS,
                    "--out", str(out), *extra)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    server = run["embedded_server"]
    assert server["model"] == f"tiny-random-{task}" and server["engine"]["num_slots"] == 4
    assert server["engine"]["chunk_frames"] == 5 and server["command"][:2] == ["ttsbench", "serve"]
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["ok"] for r in records), records
    assert all(abs(r["audio_s"] - 4 * 1920 / 24000) < 1e-6 for r in records)


def test_embedded_server_refuses_a_model_of_another_task(tmp_path):
    proc = ttsbench("run", "--task", "design", "--model", "tiny-random-custom", "--num-requests", "1",
                    "--serve-args", SERVE_ARGS, "--out", str(tmp_path / "run"))
    assert proc.returncode == 2 and "CustomVoice" in proc.stderr and "Traceback" not in proc.stderr


def test_embedded_server_needs_one_task():
    proc = ttsbench("run", "--task", "custom,design")
    assert proc.returncode == 2 and "one task" in proc.stderr
