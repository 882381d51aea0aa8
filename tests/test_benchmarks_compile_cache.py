"""benchmarks/compile_cache.sh on real folders and archives: sourcing points Triton's and Inductor's caches into
one folder and seeds it from an archive once, adding only what the folder lacks; `pack` writes the archive that seeds
it."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_cache.sh"
SHOW = 'echo "triton=$TRITON_CACHE_DIR inductor=$TORCHINDUCTOR_CACHE_DIR"'


def _bash(command: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", **env})


def _fill(folder: Path) -> None:
    (folder / "triton" / "AB12").mkdir(parents=True)
    (folder / "triton" / "AB12" / "kernel.cubin").write_bytes(bytes(range(256)) * 8)
    (folder / "inductor" / "fxgraph").mkdir(parents=True)
    (folder / "inductor" / "fxgraph" / "entry").write_text("graph")


def test_a_packed_cache_seeds_a_fresh_folder_and_never_overwrites_one(tmp_path):
    first, second, archive = tmp_path / "first", tmp_path / "second", tmp_path / "compile-cache.tar.xz"
    _fill(first)
    packed = _bash(f"bash {SCRIPT} pack {archive}", COMPILE_CACHE_DIR=str(first))
    assert packed.returncode == 0, packed.stderr
    assert "compile caches into" in packed.stdout and archive.stat().st_size > 0

    seeded = _bash(f"source {SCRIPT}; {SHOW}", COMPILE_CACHE_DIR=str(second), COMPILE_CACHE=str(archive))
    assert seeded.returncode == 0, seeded.stderr
    assert "seeded from" in seeded.stdout
    assert f"triton={second}/triton inductor={second}/inductor" in seeded.stdout
    assert (second / "triton" / "AB12" / "kernel.cubin").read_bytes() == bytes(range(256)) * 8
    assert (second / "inductor" / "fxgraph" / "entry").read_text() == "graph"

    (second / "inductor" / "fxgraph" / "entry").write_text("compiled since")
    again = _bash(f"source {SCRIPT}", COMPILE_CACHE_DIR=str(second), COMPILE_CACHE=str(archive))
    assert again.returncode == 0 and "seeded" not in again.stdout  # this archive is in already: not read again
    assert (second / "inductor" / "fxgraph" / "entry").read_text() == "compiled since"


def test_an_archive_from_another_machine_adds_what_a_warm_folder_lacks_and_keeps_what_it_compiled(tmp_path):
    """A machine whose call ended mid-compile keeps its folder; an archive packed elsewhere since brings the entries
    the folder lacks, and no entry compiled on this machine is overwritten. The archive packed from the merged folder
    holds both, without the seeding's own mark."""
    other, warm, archive = tmp_path / "other", tmp_path / "warm", tmp_path / "compile-cache.tar.xz"
    _fill(other)
    (other / "triton" / "CD34").mkdir()
    (other / "triton" / "CD34" / "kernel.cubin").write_bytes(b"clone kernels")
    assert _bash(f"bash {SCRIPT} pack {archive}", COMPILE_CACHE_DIR=str(other)).returncode == 0
    (warm / "inductor" / "fxgraph").mkdir(parents=True)
    (warm / "inductor" / "fxgraph" / "entry").write_text("compiled here")
    seeded = _bash(f"source {SCRIPT}", COMPILE_CACHE_DIR=str(warm), COMPILE_CACHE=str(archive))
    assert seeded.returncode == 0 and "seeded from" in seeded.stdout, seeded.stderr
    assert (warm / "triton" / "CD34" / "kernel.cubin").read_bytes() == b"clone kernels"
    assert (warm / "triton" / "AB12" / "kernel.cubin").read_bytes() == bytes(range(256)) * 8
    assert (warm / "inductor" / "fxgraph" / "entry").read_text() == "compiled here"

    merged, fresh = tmp_path / "merged.tar.xz", tmp_path / "fresh"
    assert _bash(f"bash {SCRIPT} pack {merged}", COMPILE_CACHE_DIR=str(warm)).returncode == 0
    assert _bash(f"source {SCRIPT}", COMPILE_CACHE_DIR=str(fresh), COMPILE_CACHE=str(merged)).returncode == 0
    assert (fresh / "inductor" / "fxgraph" / "entry").read_text() == "compiled here"
    assert (fresh / "triton" / "CD34" / "kernel.cubin").read_bytes() == b"clone kernels"
    with tarfile.open(merged) as tar:
        assert "./.seeded" not in tar.getnames() and "./triton/CD34/kernel.cubin" in tar.getnames()


def test_folders_set_by_the_caller_are_kept(tmp_path):
    shown = _bash(f"source {SCRIPT}; {SHOW}", COMPILE_CACHE_DIR=str(tmp_path / "c"), TRITON_CACHE_DIR="/elsewhere")
    assert f"triton=/elsewhere inductor={tmp_path}/c/inductor" in shown.stdout


def test_a_missing_archive_or_folder_is_said_and_nothing_is_made(tmp_path):
    folder = tmp_path / "cache"
    missing = _bash(f"source {SCRIPT}", COMPILE_CACHE_DIR=str(folder), COMPILE_CACHE=str(tmp_path / "none.tar.xz"))
    assert missing.returncode == 0 and "no such file" in missing.stdout and not folder.exists()
    nothing = _bash(f"bash {SCRIPT} pack {tmp_path / 'out.tar.xz'}", COMPILE_CACHE_DIR=str(folder))
    assert nothing.returncode == 1 and "no compile caches" in nothing.stdout
    assert not (tmp_path / "out.tar.xz").exists()
    usage = _bash(f"bash {SCRIPT}")
    assert usage.returncode == 2 and "usage" in usage.stdout
