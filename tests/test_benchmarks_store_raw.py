"""benchmarks/store_raw.py on real files: an archive shaped like gpu_bench.sh's raw.tgz (a runs.tgz inside, and a
nested archive whose files would collide with its neighbours) comes out as one flat .tar.xz with every file's
bytes, in place or to a named destination; bad arguments are refused."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks import store_raw

REPO = Path(__file__).resolve().parents[1]


def _tgz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, value in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(value)
            tar.addfile(info, io.BytesIO(value))
    return buf.getvalue()


def _read(path: Path) -> dict[str, bytes]:
    with tarfile.open(path, mode="r:xz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    runs = _tgz({"runs/custom-short-c32/requests.jsonl": b'{"ok": true}\n' * 50, "runs/x/summary.json": b"{}"})
    clash = _tgz({"health.json": b"inner"})  # would overwrite the outer health.json
    path = tmp_path / "2026-11-27-h100-sX-raw.tgz"
    path.write_bytes(_tgz({"health.json": b"outer", "runs.tgz": runs, "d120/raw.tgz": clash,
                           "serve.log": b"log\n"}))
    return path


def test_flattens_nested_archives(raw: Path, tmp_path: Path):
    dest = tmp_path / "out.tar.xz"
    before, after = store_raw.store(raw, dest)
    assert before == raw.stat().st_size and after == dest.stat().st_size
    assert _read(dest) == {"health.json": b"outer", "serve.log": b"log\n", "d120/health.json": b"inner",
                           "runs/custom-short-c32/requests.jsonl": b'{"ok": true}\n' * 50,
                           "runs/x/summary.json": b"{}"}
    store_raw.store(raw, tmp_path / "again.tar.xz")  # the same files give the same bytes
    assert (tmp_path / "again.tar.xz").read_bytes() == dest.read_bytes()


def test_collision_goes_to_a_folder_named_after_the_archive(tmp_path: Path):
    src = tmp_path / "a.tgz"
    src.write_bytes(_tgz({"x/health.json": b"outer", "x/more.tgz": _tgz({"health.json": b"inner"})}))
    store_raw.store(src, tmp_path / "a.tar.xz")
    assert _read(tmp_path / "a.tar.xz") == {"x/health.json": b"outer", "x/more/health.json": b"inner"}


def test_in_place_replaces_every_tgz(raw: Path):
    folder = raw.parent
    (folder / "notes.md").write_text("kept")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "store_raw.py"), "--in-place", str(folder)],
                         capture_output=True, text=True, check=True).stdout
    assert sorted(p.name for p in folder.iterdir()) == ["2026-11-27-h100-sX-raw.tar.xz", "notes.md"]
    assert "1 archives" in out
    assert _read(folder / "2026-11-27-h100-sX-raw.tar.xz")["d120/health.json"] == b"inner"


@pytest.mark.parametrize("args", [["only-one.tgz"], ["a.tgz", "b.tgz"], ["--in-place", "a", "b"]])
def test_bad_arguments(args, tmp_path: Path):
    with pytest.raises(SystemExit) as exc:
        store_raw.main(args)
    assert exc.value.code == 2
