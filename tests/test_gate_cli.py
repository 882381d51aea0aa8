"""`ttsbench baseline` and `ttsbench gate` on crafted run directories: pass, fail on each rule, exit 2 on
unusable input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.runfixtures import edit_summary, make_run
from ttsbench.cli import app
from ttsbench.gate import load_rules

cli = CliRunner()


def invoke(*args: str):
    return cli.invoke(app, list(map(str, args)), terminal_width=200)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> Path:
    """A run with no failed request and quality scored: passes the default rules against itself."""
    return make_run(tmp_path_factory.mktemp("runs") / "clean", label="clean", levels=("c1", "c4"),
                    n_per_level=8, quality=True)


@pytest.fixture(scope="module")
def baseline_file(clean_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("baselines") / "clean.json"
    result = invoke("baseline", clean_run, "-o", out)
    assert result.exit_code == 0, result.output
    return out


def copy_run(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_baseline_holds_every_figure_and_its_provenance(clean_run, baseline_file):
    doc = json.loads(baseline_file.read_text())
    summary = json.loads((clean_run / "summary.json").read_text())
    assert doc["kind"] == "ttsbench-baseline" and doc["version"] == 1
    assert doc["rows"] == summary["rows"] and doc["quality"] == summary["quality"]
    assert doc["slo"] == summary["slo"]
    src = doc["source"]
    assert src["run_dir"] == str(clean_run) and src["label"] == "clean"
    assert src["config"]["concurrency"] == [1, 4] and src["started_at"].startswith("2025-11-21")
    assert src["command"][:2] == ["ttsbench", "run"] and src["host"]["cpu_count"] == 2


def test_identical_run_passes_against_baseline_file_and_run_dir(clean_run, baseline_file):
    for base in (baseline_file, clean_run):
        result = invoke("gate", "--baseline", base, "--current", clean_run)
        assert result.exit_code == 0, result.output
        assert "PASS" in result.output and "FAIL" not in result.output
        # Every default rule appears with every level (or quality task/set) it checks.
        for rule in load_rules().rules:
            assert rule.metric in result.output
        assert "custom/short/c1" in result.output and "custom/short/c4" in result.output


# One crafted regression per default rule: (metric, where, value just past the limit, value just inside).
# Baseline values come from the clean run; each lambda maps the baseline value to the current one.
REGRESSIONS = {
    "failed": ("row", lambda b: 1, lambda b: 0),
    "ttfab_ms_p95": ("row", lambda b: b * 1.11, lambda b: b * 1.09),
    "e2e_ms_p95": ("row", lambda b: b * 1.11, lambda b: b * 1.09),
    "rtf_p95": ("row", lambda b: b * 1.11, lambda b: b * 1.09),
    "audio_throughput": ("row", lambda b: b * 0.94, lambda b: b * 0.96),
    "request_throughput": ("row", lambda b: b * 0.94, lambda b: b * 0.96),
    "underrun_s_p95": ("row", lambda b: b * 1.1 + 0.051 if b else 0.051, lambda b: b + 0.049),
    "goodput": ("row", lambda b: b - 0.051, lambda b: b - 0.049),
    "wer_mean": ("quality", lambda b: b + 0.0051, lambda b: b + 0.0049),
    "sim_mean": ("quality", lambda b: b - 0.021, lambda b: b - 0.019),
    "flagged_share": ("quality", lambda b: b + 0.051, lambda b: b + 0.049),
}


def test_every_default_rule_has_a_crafted_regression():
    assert {r.metric for r in load_rules().rules} == set(REGRESSIONS)


def _craft(clean_run: Path, dst: Path, metric: str, which: int) -> tuple[Path, str]:
    kind, past, inside = REGRESSIONS[metric]
    run = copy_run(clean_run, dst)
    where = {}

    def edit(summary):
        target = summary["rows"][0] if kind == "row" else summary["quality"][0]
        target[metric] = (past, inside)[which](target[metric])
        where["key"] = "/".join(target[k] for k in ("task", "set", "level") if k in target)

    edit_summary(run, edit)
    return run, where["key"]


@pytest.mark.parametrize("metric", sorted(REGRESSIONS))
def test_each_rule_fails_just_past_its_limit_and_passes_inside(metric, clean_run, baseline_file, tmp_path):
    bad, key = _craft(clean_run, tmp_path / "bad", metric, 0)
    result = invoke("gate", "--baseline", baseline_file, "--current", bad)
    assert result.exit_code == 1, result.output
    failing = [line for line in result.output.splitlines() if "FAIL" in line and "│" in line]
    assert len(failing) == 1, result.output
    assert metric in failing[0] and key in failing[0]
    assert "FAIL: 1 of" in result.output

    ok, _ = _craft(clean_run, tmp_path / "ok", metric, 1)
    result = invoke("gate", "--baseline", baseline_file, "--current", ok)
    assert result.exit_code == 0, result.output


def test_missing_levels_fail_on_either_side_unless_rules_say_report(clean_run, baseline_file, tmp_path):
    fewer = copy_run(clean_run, tmp_path / "fewer")
    edit_summary(fewer, lambda s: s.update(rows=[r for r in s["rows"] if r["level"] != "c4"]))
    result = invoke("gate", "--baseline", baseline_file, "--current", fewer)
    assert result.exit_code == 1
    assert "custom/short/c4" in result.output and "not in the current run" in result.output

    more = make_run(tmp_path / "more", levels=("c1", "c4", "c8"), n_per_level=8, quality=True)
    result = invoke("gate", "--baseline", baseline_file, "--current", more)
    assert result.exit_code == 1
    assert "custom/short/c8" in result.output and "not in the baseline" in result.output

    lenient = tmp_path / "lenient.toml"
    lenient.write_text('missing_levels = "report"\n[[rule]]\nmetric = "failed"\nmax = 0\n')
    result = invoke("gate", "--baseline", baseline_file, "--current", fewer, "--rules", lenient)
    assert result.exit_code == 0, result.output
    assert "missing" in result.output and "custom/short/c4" in result.output


def test_quality_scored_on_one_side_only_is_reported(clean_run, baseline_file, tmp_path):
    unscored = copy_run(clean_run, tmp_path / "unscored")
    edit_summary(unscored, lambda s: s.update(quality=[]))
    result = invoke("gate", "--baseline", baseline_file, "--current", unscored)
    assert result.exit_code == 1
    assert "quality not scored in the current run" in result.output

    # Neither side scored: quality rules are listed as not scored, not failed.
    result = invoke("gate", "--baseline", unscored, "--current", unscored)
    assert result.exit_code == 0, result.output
    assert "not scored" in result.output


def test_differing_run_options_are_noted(clean_run, baseline_file, tmp_path):
    other = copy_run(clean_run, tmp_path / "other")
    meta = json.loads((other / "run.json").read_text())
    meta["config"]["max_new_tokens"] = 512
    meta["label"] = "other"
    (other / "run.json").write_text(json.dumps(meta))
    result = invoke("gate", "--baseline", baseline_file, "--current", other)
    assert result.exit_code == 0, result.output      # a note, not a failure: the figures decide
    assert "option max_new_tokens differs: baseline 2048, current 512" in result.output
    assert "label" not in result.output.split("note:", 1)[1]


def test_rule_that_checks_nothing_is_reported(clean_run, baseline_file, tmp_path):
    rules = tmp_path / "typo.toml"
    rules.write_text('[[rule]]\nmetric = "failed"\nmax = 0\n'
                     '[[rule]]\nmetric = "ttfab_ms_p95"\nmax_rise_pct = 10\nlevels = ["c16"]\n')
    result = invoke("gate", "--baseline", baseline_file, "--current", clean_run, "--rules", rules)
    assert result.exit_code == 1 and "checked nothing" in result.output and "levels=c16" in result.output


def test_json_verdict(clean_run, baseline_file, tmp_path):
    bad, key = _craft(clean_run, tmp_path / "bad", "audio_throughput", 0)
    out = tmp_path / "verdict.json"
    result = invoke("gate", "--baseline", baseline_file, "--current", bad, "--json", out)
    assert result.exit_code == 1
    verdict = json.loads(out.read_text())
    assert verdict["ok"] is False and verdict["failures"] == 1 and verdict["current"] == str(bad)
    failed = [c for c in verdict["checks"] if c["status"] == "FAIL"]
    assert failed[0]["where"] == key and failed[0]["rule"].startswith("audio_throughput")
    assert failed[0]["current"] < 0.95 * failed[0]["baseline"]
    assert len(verdict["checks"]) == sum(1 for line in result.output.splitlines() if "│" in line and "rule" not in line)


def test_custom_rules_with_filters_and_rate_levels(tmp_path):
    base = make_run(tmp_path / "base", levels=("r1", "r2.5", "rinf"), n_per_level=10)
    slower = make_run(tmp_path / "slower", levels=("r1", "r2.5", "rinf"), n_per_level=10, speed=1.5)
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nmetric = "ttfab_ms_p95"\nmax_rise_pct = 20\nlevels = ["r1"]\n'
                     '[[rule]]\nmetric = "ttfab_ms_p95"\nmax = 100000\n')
    result = invoke("gate", "--baseline", base, "--current", slower, "--rules", rules)
    assert result.exit_code == 1
    fails = [line for line in result.output.splitlines() if "FAIL" in line and "│" in line]
    assert len(fails) == 1 and "custom/short/r1" in fails[0]
    assert "custom/short/rinf" in result.output and "custom/short/r2.5" in result.output


def _bad_json(run: Path) -> None:
    (run / "summary.json").write_text("{not json")


def _damage_json(run: Path, edit) -> None:
    summary = json.loads((run / "summary.json").read_text())
    edit(summary)
    (run / "summary.json").write_text(json.dumps(summary))


def _string_figure(run: Path) -> None:
    _damage_json(run, lambda s: s["rows"][0].update(ttfab_ms_p95="fast"))


def _rows_not_list(run: Path) -> None:
    _damage_json(run, lambda s: s.update(rows={"c1": {}}))


def _row_without_level(run: Path) -> None:
    _damage_json(run, lambda s: s["rows"][0].pop("level"))


def _no_summary(run: Path) -> None:
    (run / "summary.json").unlink()


def _no_run_json(run: Path) -> None:
    (run / "run.json").unlink()


@pytest.mark.parametrize("damage,message", [
    (_bad_json, "not valid JSON"), (_string_figure, "must be a number"), (_rows_not_list, "'rows' must be a list"),
    (_row_without_level, "has no 'level'"), (_no_summary, "ttsbench summarize"), (_no_run_json, "run.json not found"),
])
def test_malformed_current_run_exits_2(damage, message, clean_run, baseline_file, tmp_path):
    run = copy_run(clean_run, tmp_path / "damaged")
    damage(run)
    result = invoke("gate", "--baseline", baseline_file, "--current", run)
    assert result.exit_code == 2, result.output
    assert message in result.output


@pytest.mark.parametrize("text,message", [
    ("[[rule]\nmetric=", "not valid TOML"),
    ('[[rule]]\nmetric = "ttfab_ms_p95"\nmax_rise_percent = 10\n', "unknown key"),
    ('[[rule]]\nmetric = "ttfab_p95"\nmax_rise_pct = 10\n', "unknown metric 'ttfab_p95'"),
    ('[[rule]]\nmetric = "ttfab_ms_p95"\n', "gives no limit"),
    ('[[rule]]\nmetric = "ttfab_ms_p95"\nmax_rise_pct = "10%"\n', "must be a number"),
    ('[[rule]]\nmetric = "ttfab_ms_p95"\nmax_rise_pct = -1\n', "must be >= 0"),
    ('[[rule]]\nmetric = "failed"\nmax = 0\nlevels = "c1"\n', "non-empty list"),
    ('missing_levels = "ignore"\n[[rule]]\nmetric = "failed"\nmax = 0\n', "missing_levels"),
    ('missing_levels = "fail"\n', "no [[rule]]"),
    ('tolerance = 5\n[[rule]]\nmetric = "failed"\nmax = 0\n', "unknown top-level key"),
])
def test_bad_rules_exit_2(text, message, clean_run, baseline_file, tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text(text)
    result = invoke("gate", "--baseline", baseline_file, "--current", clean_run, "--rules", rules)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_fields_of_later_versions_are_kept_and_gateable(clean_run, baseline_file, tmp_path):
    """Unknown fields do not make a summary unusable; a numeric one can be gated, a non-numeric one not."""
    def add(summary):
        for row in summary["rows"]:
            row["latency_histogram"] = {"<100ms": 3, ">=100ms": 5}
        for q in summary["quality"]:
            q["utmos_mean"] = 3.9
    newer_base, newer = copy_run(clean_run, tmp_path / "nb"), copy_run(clean_run, tmp_path / "n")
    edit_summary(newer_base, add)
    edit_summary(newer, add)
    edit_summary(newer, lambda s: s["quality"][0].update(utmos_mean=3.5))
    rules = tmp_path / "utmos.toml"
    rules.write_text('[[rule]]\nmetric = "utmos_mean"\nmax_fall = 0.2\n')
    result = invoke("gate", "--baseline", newer_base, "--current", newer, "--rules", rules)
    assert result.exit_code == 1, result.output
    assert "custom/short " in result.output and "3.5" in result.output   # judged per (task, set)
    for metric in ("latency_histogram", "sim_kind"):
        rules.write_text(f'[[rule]]\nmetric = "{metric}"\nmax = 1\n')
        result = invoke("gate", "--baseline", newer_base, "--current", newer, "--rules", rules)
        assert result.exit_code == 2 and "is not a number" in result.output, result.output


def test_missing_inputs_exit_2(clean_run, baseline_file, tmp_path):
    result = invoke("gate", "--baseline", tmp_path / "nope.json", "--current", clean_run)
    assert result.exit_code == 2 and "not found" in result.output
    result = invoke("gate", "--baseline", baseline_file, "--current", tmp_path / "nope")
    assert result.exit_code == 2 and "not found" in result.output
    result = invoke("gate", "--baseline", baseline_file, "--current", clean_run, "--rules", tmp_path / "r.toml")
    assert result.exit_code == 2 and "rules file not found" in result.output
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"kind": "something-else", "rows": []}))
    result = invoke("gate", "--baseline", other, "--current", clean_run)
    assert result.exit_code == 2 and "not a ttsbench baseline" in result.output
    result = invoke("baseline", tmp_path / "nope", "-o", tmp_path / "b.json")
    assert result.exit_code == 2 and not (tmp_path / "b.json").exists()


def test_show_rules_prints_the_packaged_defaults():
    result = invoke("gate", "--show-rules")
    assert result.exit_code == 0
    assert 'metric = "ttfab_ms_p95"' in result.output and "max_rise_pct = 10" in result.output


def test_installed_command_exit_codes(clean_run, baseline_file, tmp_path):
    """The real console script, as CI calls it: 0 pass, 1 regression, 2 unusable input."""
    exe = str(Path(sys.executable).with_name("ttsbench"))
    ok = subprocess.run([exe, "gate", "--baseline", baseline_file, "--current", clean_run],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad, _ = _craft(clean_run, tmp_path / "bad", "ttfab_ms_p95", 0)
    fail = subprocess.run([exe, "gate", "--baseline", baseline_file, "--current", bad], capture_output=True, text=True)
    assert fail.returncode == 1 and "FAIL" in fail.stdout
    unusable = subprocess.run([exe, "gate", "--baseline", tmp_path / "none.json", "--current", bad],
                              capture_output=True, text=True)
    assert unusable.returncode == 2 and "error:" in unusable.stderr


def _scale(run: Path, factor: float, levels=None) -> None:
    """Make every latency `factor` times longer and throughput `factor` times lower (at `levels`)."""
    def edit(summary):
        for row in summary["rows"]:
            if levels and row["level"] not in levels:
                continue
            for key, value in list(row.items()):
                if isinstance(value, float) and key.startswith(("ttfab_ms", "e2e_ms", "rtf")):
                    row[key] = value * factor
                elif key in ("audio_throughput", "request_throughput"):
                    row[key] = value / factor
    edit_summary(run, edit)


def test_relative_to_level_cancels_machine_speed(clean_run, baseline_file, tmp_path):
    rules = tmp_path / "ratios.toml"
    rules.write_text('[[rule]]\nmetric = "ttfab_ms_p95"\nmax_rise_pct = 10\nrelative_to_level = "c1"\n'
                     '[[rule]]\nmetric = "audio_throughput"\nmax_fall_pct = 5\nrelative_to_level = "c1"\n')
    slower_machine = copy_run(clean_run, tmp_path / "slower")
    _scale(slower_machine, 2.0)
    result = invoke("gate", "--baseline", baseline_file, "--current", slower_machine, "--rules", rules)
    assert result.exit_code == 0, result.output
    assert "ttfab_ms_p95 ÷ c1" in result.output and "custom/short/c4" in result.output
    assert "custom/short/c1" not in result.output          # the reference level itself is not checked
    # Same machine, but worse scaling under load: only c4 got slower.
    worse_scaling = copy_run(clean_run, tmp_path / "worse")
    _scale(worse_scaling, 1.5, levels=("c4",))
    result = invoke("gate", "--baseline", baseline_file, "--current", worse_scaling, "--rules", rules)
    assert result.exit_code == 1
    assert "FAIL: 2 of 2 checks failed" in result.output
    # Without the reference level on one side there is nothing to divide by.
    no_c1 = copy_run(clean_run, tmp_path / "noc1")
    edit_summary(no_c1, lambda s: s.update(rows=[r for r in s["rows"] if r["level"] != "c1"]))
    result = invoke("gate", "--baseline", baseline_file, "--current", no_c1, "--rules", rules)
    assert result.exit_code == 1 and "no c1 in the current run" in result.output


def test_relative_to_level_is_for_per_level_figures(clean_run, baseline_file, tmp_path):
    rules = tmp_path / "bad.toml"
    rules.write_text('[[rule]]\nmetric = "wer_mean"\nmax_rise = 0.01\nrelative_to_level = "c1"\n')
    result = invoke("gate", "--baseline", baseline_file, "--current", clean_run, "--rules", rules)
    assert result.exit_code == 2 and "not quality figures" in result.output
