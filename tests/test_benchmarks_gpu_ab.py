"""benchmarks/gpu_ab.sh, in a scratch git repository whose gpu_bench.sh only says which tree ran it and with
what: `pack` archives a revision's tree, `run` gives every variant in order the same stages, knobs and compile
caches, each in its own result folder, and refuses to run without a packed base."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAKE_BENCH = """#!/bin/bash
mkdir -p "$OUT"
echo "=== {tree} stages=$* levels=$LEVELS triton=$TRITON_CACHE_DIR" | tee "$OUT/table.md"
"""


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def _repo(tmp_path: Path) -> tuple[Path, str]:
    """A repository whose first commit's gpu_bench.sh says 'base' and whose working tree's says 'new'."""
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    for script in ("gpu_ab.sh", "compile_cache.sh"):
        shutil.copy(REPO / "benchmarks" / script, repo / "benchmarks" / script)
    bench = repo / "benchmarks" / "gpu_bench.sh"
    bench.write_text(FAKE_BENCH.format(tree="base"))
    (repo / "docs").mkdir()
    (repo / "docs" / "big.md").write_text("not packed")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    rev = _git(repo, "rev-parse", "--short", "HEAD").strip()
    bench.write_text(FAKE_BENCH.format(tree="new"))
    return repo, rev


def _ab(repo: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(repo / "benchmarks" / "gpu_ab.sh"), *args], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", **env})


def test_each_variant_runs_its_own_tree_with_the_same_stages_and_knobs(tmp_path):
    repo, rev = _repo(tmp_path)
    out = tmp_path / "out"
    refused = _ab(repo, "run", "serve", OUT=str(out))
    assert refused.returncode == 2 and "pack" in refused.stdout
    packed = _ab(repo, "pack", "HEAD")
    assert packed.returncode == 0, packed.stderr
    assert (repo / ".ab" / "rev").read_text().strip() == rev
    names = subprocess.run(["tar", "-tzf", str(repo / ".ab" / "base.tgz")], capture_output=True, text=True).stdout
    assert "benchmarks/gpu_bench.sh" in names and "docs/" not in names
    cache = tmp_path / "cache"
    ran = _ab(repo, "run", "serve", "table", OUT=str(out), VARIANTS="new base new", LEVELS="1,32",
              COMPILE_CACHE_DIR=str(cache))
    assert ran.returncode == 0, ran.stderr
    said = [line for line in ran.stdout.splitlines() if line.startswith("===")]
    knobs = f"stages=serve table levels=1,32 triton={cache}/triton"  # both trees compile into one cache
    assert said == [f"=== new {knobs}", f"=== base {knobs}", f"=== new {knobs}"]
    for name, tree in (("new", "new"), ("base", "base"), ("new-2", "new")):
        assert (out / name / "table.md").read_text().startswith(f"=== {tree} ")
        assert (out / f"{name}.log").exists()
    assert f"base: {rev}" in ran.stdout
