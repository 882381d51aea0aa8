"""The embedded reference server of `ttsbench run` without --url: `ttsbench serve` in a subprocess.

It talks to the server over HTTP only (the harness never imports the serving stack): pick a free loopback
port, start the process, wait for /health, read /v1/models, and stop it afterwards. Its log goes to a
temporary file whose tail is shown when it fails to start.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

TASK_TYPES = {"custom": "CustomVoice", "design": "VoiceDesign", "clone": "Base"}
TINY_MODELS = {"custom": "tiny-random-custom", "design": "tiny-random-design", "clone": "tiny-random-clone"}


class EmbeddedServerError(RuntimeError):
    """The embedded server could not be started or does not fit the run."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str, api_key: str | None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except json.JSONDecodeError:
            return e.code, {}


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@contextlib.contextmanager
def embedded_server(model: str | None, tasks: list[str], serve_args: str = "", api_key: str | None = None,
                    startup_timeout: float = 900.0) -> Iterator[tuple[str, dict]]:
    """Yield (base URL, configuration for run.json) of a started `ttsbench serve`; stop it on exit."""
    if model is None:
        if len(tasks) != 1:
            raise EmbeddedServerError(
                "the embedded server serves one checkpoint, i.e. one task: run one --task at a time "
                "(with --model for real weights), or measure a running server with --url")
        model = TINY_MODELS[tasks[0]]
    port = free_port()
    argv = [sys.executable, "-c", "from ttsbench.cli import app; app()", "serve", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), *shlex.split(serve_args)]
    env = dict(os.environ)
    if api_key:
        env["TTSBENCH_API_KEY"] = api_key
    log_file = Path(tempfile.mkstemp(prefix="ttsbench-serve-", suffix=".log")[1])
    url = f"http://127.0.0.1:{port}"
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        health = _wait_ready(proc, url, api_key, startup_timeout, log_file)
        _, models = _get_json(url + "/v1/models", api_key)
        served = (models.get("data") or [{}])[0]
        wanted = {TASK_TYPES[t] for t in tasks}
        if served.get("task_type") and wanted and wanted != {served["task_type"]}:
            raise EmbeddedServerError(
                f"--model {model} does {served['task_type']}, but the run asks for "
                f"{', '.join(sorted(tasks))}; pick a checkpoint of that task (e.g. {TINY_MODELS[tasks[0]]})")
        info = {"model": model, "command": ["ttsbench", *argv[3:]], "url": url,
                "engine": health.get("engine"), "model_info": served, "log": str(log_file)}
        yield url, info
    finally:
        _stop(proc)


def _wait_ready(proc: subprocess.Popen, url: str, api_key: str | None, timeout: float, log_file: Path) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EmbeddedServerError(f"the embedded server exited with code {proc.returncode}:\n{_tail(log_file)}")
        try:
            status, body = _get_json(url + "/health", api_key)
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            status, body = 0, {}
        if status == 200:
            return body
        if body.get("status") == "error":
            raise EmbeddedServerError(f"the embedded server failed to load the model: {body.get('error')}\n"
                                      f"{_tail(log_file)}")
        time.sleep(0.3)
    raise EmbeddedServerError(f"the embedded server was not ready after {timeout:.0f} s:\n{_tail(log_file)}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)  # aiohttp shuts down cleanly on SIGINT
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
