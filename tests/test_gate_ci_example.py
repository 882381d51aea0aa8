"""The CI workflow example stays runnable: it parses, names files that exist, and benchmarks with the
options the committed baseline was made with (else the gate would find every level missing)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = REPO / "docs" / "ci" / "github-actions.yml"


def _options(argv: list[str], drop=("--url", "--label", "--out", "--serve-args")) -> list[str]:
    """argv after `ttsbench run`, without the options that name or start the server or say where results go."""
    out, skip = [], False
    for arg in argv[argv.index("run") + 1:]:
        if skip:
            skip = False
        elif arg in drop:
            skip = True
        else:
            out.append(arg)
    return out


def test_workflow_benchmarks_like_the_baseline_and_gates_it():
    steps = {s.get("name"): s for s in yaml.safe_load(WORKFLOW.read_text())["jobs"]["gate"]["steps"]}
    bench = shlex.split(steps["Benchmark"]["run"])
    gate = shlex.split(steps["Gate against the committed baseline"]["run"])
    baseline = gate[gate.index("--baseline") + 1]
    rules = gate[gate.index("--rules") + 1]
    assert (REPO / baseline).is_file() and (REPO / rules).is_file()
    source = json.loads((REPO / baseline).read_text())["source"]
    assert _options(bench) == _options(source["command"])
    # the workflow starts its server as the baseline's embedded one was started
    serve_args = source["command"][source["command"].index("--serve-args") + 1]
    workflow = yaml.safe_load(WORKFLOW.read_text())["jobs"]["gate"]
    assert workflow["env"]["SERVE_ARGS"] == serve_args and "$SERVE_ARGS" in steps["Start the server"]["run"]
    assert gate[gate.index("--current") + 1] == bench[bench.index("--out") + 1]
