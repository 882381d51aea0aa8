"""A stage's loop that dies of an error must fail its requests and say so, never leave them waiting for audio."""

import json
import urllib.error
import urllib.request

import pytest

from tests.server_fixtures import ServerThread, post_json

BODY = {"input": "Hello there.", "voice": "vivian", "max_new_tokens": 8, "seed": 1}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = ServerThread("tiny-random", tmp_path_factory.mktemp("voices"))
    yield server
    server.stop()


def _health(srv) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(srv.url + "/health", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_failed_talker_loop_fails_its_request_and_the_server_refuses_more(srv, monkeypatch):
    status, _, _ = post_json(srv.url + "/v1/audio/speech", BODY, timeout=60)
    assert status == 200 and _health(srv)[0] == 200
    engine = srv.server.engine

    def broken_compact():  # outside the calls the loop guards: a bug, as the loop sees it
        raise RuntimeError("injected scheduler fault")

    monkeypatch.setattr(engine.scheduler, "compact", broken_compact)
    status, _, body = post_json(srv.url + "/v1/audio/speech", BODY, timeout=60)
    error = json.loads(body)["error"]
    assert status == 500 and error["code"] == "generation_failed"
    assert "talker stage failed: RuntimeError: injected scheduler fault" in error["message"]
    code, health = _health(srv)
    assert code == 503 and health["status"] == "error" and "injected scheduler fault" in health["error"]
    status, _, body = post_json(srv.url + "/v1/audio/speech", BODY, timeout=60)
    error = json.loads(body)["error"]
    assert status == 503 and error["code"] == "engine_failed" and "stopped serving" in error["message"]
