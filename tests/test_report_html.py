"""`ttsbench report` on stored runs: every section, table and figure present, self-contained, and
rendered by headless Chromium without console errors (screenshots kept in test-artifacts/)."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.image as mpimg
import pytest
from typer.testing import CliRunner

from tests.runfixtures import SAMPLE_RATE, make_run
from ttsbench.cli import app
from ttsbench.report import plots
from ttsbench.report.playback import playback
from ttsbench.report.tables import QUALITY_FIGURES, SUMMARY_FIGURES

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
GROUP_FIGURES = {"latency", "throughput", "rtf", "ttfab-cdf", "delivery", "timeline"}


class ReportParser(HTMLParser):
    """Sections (by id) with their figures, tables and text; every src/href; decoded images."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.sections: dict[str, dict] = {}
        self.current: str | None = None
        self.refs: list[str] = []
        self.images: list[tuple[str, bytes]] = []
        self.tags: set[str] = set()
        self.title = ""
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.add(tag)
        for key in ("src", "href"):
            if key in a:
                self.refs.append(a[key])
        if tag == "title":
            self._in_title = True
        if tag == "section":           # the report's sections are not nested
            self.current = a["id"]
            self.sections[self.current] = {"attrs": a, "figures": [], "tables": 0, "text": []}
        if self.current:
            sec = self.sections[self.current]
            if tag == "figure":
                sec["figures"].append(a.get("data-figure"))
            if tag == "table":
                sec["tables"] += 1
        if tag == "img":
            assert a["src"].startswith("data:image/png;base64,")
            self.images.append((a.get("alt", ""), base64.b64decode(a["src"].split(",", 1)[1])))

    def handle_endtag(self, tag):
        if tag == "title":
            self._in_title = False
        if tag == "section":
            self.current = None

    def handle_data(self, data):
        if self._in_title:
            self.title += data
        if self.current:
            self.sections[self.current]["text"].append(data)


def parse(path: Path) -> ReportParser:
    p = ReportParser()
    p.feed(path.read_text(encoding="utf-8"))
    for sec in p.sections.values():
        sec["text"] = " ".join(" ".join(sec["text"]).split())
    return p


def build(run_dirs: list[Path], out: Path) -> Path:
    result = CliRunner().invoke(app, ["report", *map(str, run_dirs), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    groups = (("custom", "short"), ("clone", "medium"))
    return {
        "base": make_run(root / "base", label="base", groups=groups, levels=("c1", "c2", "c8"), n_per_level=8,
                         failures={"c8": ["timeout", "http_500"]}, quality=True),
        "cand": make_run(root / "cand", label="candidate", groups=groups, levels=("c1", "c2", "c8"), n_per_level=8,
                         speed=1.3, seed=1, quality=True, wer_shift=0.3),
        "rate": make_run(root / "rate", label="open-loop", levels=("r1", "r2.5", "rinf"), n_per_level=8),
    }


@pytest.fixture(scope="module")
def reports(runs, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("reports")
    return {"single": build([runs["base"]], out / "single.html"),
            "compare": build([runs["base"], runs["cand"]], out / "compare.html"),
            "rate": build([runs["rate"]], out / "rate.html")}


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_single_run_has_every_section_table_and_figure(runs, reports):
    p = parse(reports["single"])
    ids = set(p.sections)
    assert {"overview", "configuration", "quality", "errors",
            "results-custom-short-concurrency", "results-clone-medium-concurrency"} <= ids
    cfg = p.sections["configuration"]["text"]
    assert "http://127.0.0.1:8091" in cfg and "Qwen3-TTS-12Hz-0.6B-CustomVoice" in cfg and "ci-runner" in cfg
    assert "ttsbench run --url" in cfg and "2025-11-21T10:00:00" in cfg
    summary = _summary(runs["base"])
    overview = p.sections["overview"]["text"]
    for task, set_ in (("custom", "short"), ("clone", "medium")):
        rows = [r for r in summary["rows"] if (r["task"], r["set"]) == (task, set_)]
        peak = max(rows, key=lambda r: r["audio_throughput"])
        assert f"{task} / {set_}" in overview
        assert f"{peak['audio_throughput']:,.2f} @{peak['level']}" in overview
        assert f"{rows[-1]['ttfab_ms_p95']:,.1f} @c8" in overview
    for task, set_ in (("custom", "short"), ("clone", "medium")):
        sec = p.sections[f"results-{task}-{set_}-concurrency"]
        assert sec["attrs"]["data-mode"] == "concurrency"
        assert set(sec["figures"]) == GROUP_FIGURES, sec["figures"]
        for _key, label, *_ in SUMMARY_FIGURES:
            assert label in sec["text"], label
        for row in (r for r in summary["rows"] if (r["task"], r["set"]) == (task, set_)):
            assert row["level"] in sec["text"]
            # The table shows the stored figures themselves.
            assert f"{row['ttfab_ms_p95']:,.1f}" in sec["text"]
            assert f"{row['audio_throughput']:,.3f}" in sec["text"]
            assert f"{row['rtf_p99']:,.3f}" in sec["text"]
    # 4 figures per group + a delivery and a timeline figure per run and group, all valid PNGs of a readable size.
    assert len(p.images) == 2 * 6
    for alt, png in p.images:
        img = mpimg.imread(io.BytesIO(png), format="png")
        assert img.shape[1] >= 600 and img.shape[0] >= 200, alt


def test_report_is_self_contained(reports):
    for path in reports.values():
        p = parse(path)
        assert "script" not in p.tags and "link" not in p.tags
        for ref in p.refs:
            assert ref.startswith(("data:image/png;base64,", "#")), ref
        assert "http://" not in path.read_text().replace("http://127.0.0.1:8091", "")


def test_quality_and_flagged_clips(runs, reports):
    sec = parse(reports["single"]).sections["quality"]
    assert sec["tables"] == 2
    for _key, label, *_ in QUALITY_FIGURES:
        assert label in sec["text"]
    q = _summary(runs["base"])["quality"][0]
    assert f"{100 * q['wer_mean']:.2f}%" in sec["text"] and f"{q['sim_mean']:,.3f}" in sec["text"]
    assert f"too_long: {q['flag_counts']['too_long']}" in sec["text"]
    flagged = [json.loads(line) for line in (runs["base"] / "quality.jsonl").read_text().splitlines()]
    flagged = [c for c in flagged if c["flags"]]
    assert flagged and all(c["id"] in sec["text"] for c in flagged[:25])

    rate = parse(reports["rate"]).sections["quality"]
    assert rate["tables"] == 0 and "Not scored" in rate["text"]


def test_errors_by_kind_with_messages(reports):
    sec = parse(reports["single"]).sections["errors"]
    assert sec["tables"] == 2
    for text in ("http_500", "timeout", "c8", "CUDA out of memory", "no response within 300 s"):
        assert text in sec["text"]
    rate = parse(reports["rate"]).sections["errors"]
    assert "No request failed" in rate["text"]


def test_several_runs_side_by_side_with_relative_change(runs, reports):
    p = parse(reports["compare"])
    assert "base" in p.title and "candidate" in p.title
    base, cand = _summary(runs["base"]), _summary(runs["cand"])
    sec = p.sections["results-custom-short-concurrency"]
    assert set(sec["figures"]) == GROUP_FIGURES
    assert sec["figures"].count("timeline") == 2     # one per run; the other plots overlay both runs
    assert sec["figures"].count("delivery") == 2
    assert "candidate" in sec["text"] and "Each run beside the first (base)" in sec["text"]
    for b, c in zip(base["rows"], cand["rows"]):
        if (b["task"], b["set"]) != ("custom", "short"):
            continue
        for key in ("ttfab_ms_p95", "audio_throughput"):
            rel = 100 * (c[key] - b[key]) / b[key]
            assert f"({rel:+.1f}%)" in sec["text"], (key, b["level"], rel)
    # Quality compared too, and the setting that differs between runs is marked.
    assert "candidate" in p.sections["quality"]["text"]
    html = reports["compare"].read_text()
    assert 'class="differs" title="differs between runs">command<' in html


def test_baseline_file_beside_a_run(runs, tmp_path):
    """A CI job can show the current run next to the committed baseline it was gated against."""
    base = tmp_path / "base.json"
    assert CliRunner().invoke(app, ["baseline", str(runs["base"]), "-o", str(base)]).exit_code == 0
    p = parse(build([base, runs["cand"]], tmp_path / "r.html"))
    sec = p.sections["results-custom-short-concurrency"]
    assert "baseline base" in sec["text"] and "candidate" in sec["text"]
    assert sec["figures"].count("timeline") == 1        # only the run has per-request records
    assert sec["figures"].count("delivery") == 1
    assert set(sec["figures"]) == GROUP_FIGURES
    alone = parse(build([base], tmp_path / "alone.html")).sections["results-custom-short-concurrency"]
    assert alone["figures"] == ["latency", "throughput"]  # no empty distribution plots
    b = next(r for r in _summary(runs["base"])["rows"] if r["level"] == "c8")
    assert f"{b['ttfab_ms_p95']:,.1f}" in sec["text"]
    assert "ci-runner" in p.sections["configuration"]["text"]     # the baseline's provenance


def test_rate_levels_plot_against_rate(reports):
    p = parse(reports["rate"])
    sec = p.sections["results-custom-short-rate"]
    assert sec["attrs"]["data-mode"] == "rate"
    assert "by request rate" in sec["text"]
    assert set(sec["figures"]) == GROUP_FIGURES
    text = sec["text"]
    assert text.index("r1") < text.index("r2.5") < text.index("rinf")


def test_playback_model_matches_stored_underruns_and_the_harness(runs):
    """The timelines' stalls are recomputed from `chunks`; they agree with the stored figures and
    with the harness's own playback model (ttsbench.metrics.underrun)."""
    from ttsbench import metrics

    records = [json.loads(line) for line in (runs["base"] / "requests.jsonl").read_text().splitlines()]
    streamed = [r for r in records if r["ok"]]
    assert any(r["underrun_s"] > 0 for r in streamed)
    for r in streamed:
        pb = playback(r)
        assert abs(pb.underrun_s - r["underrun_s"]) < 1e-5
        assert abs(pb.underrun_max_s - r["underrun_max_s"]) < 1e-5
        spb = r["audio_s"] / r["bytes"]
        total, worst = metrics.underrun([(t / 1000, n * spb) for t, n in r["chunks"]])
        assert abs(pb.underrun_s - total) < 1e-5 and abs(pb.underrun_max_s - worst) < 1e-5


def test_delivery_series_by_hand():
    """Two requests sent 1 s apart, each 1 s of audio at 24 kHz PCM16 in two chunks: audio received per second
    and requests in flight, slice by slice."""
    def rec(t, chunks, e2e_ms):
        return {"t_start": t, "chunks": chunks, "e2e_ms": e2e_ms, "sample_rate": 24000}
    half = 24000  # bytes of 0.5 s of 16-bit mono audio at 24 kHz
    starts, audio, flight = plots.delivery_series(
        [rec(10.0, [[200.0, half], [900.0, half]], 1000.0), rec(11.0, [[500.0, half], [1900.0, half]], 2000.0)],
        bins=3)
    assert list(starts) == [0.0, 1.0, 2.0]
    assert list(audio) == [1.0, 0.5, 0.5]  # 0.2 s and 0.9 s; 1.5 s; 2.9 s
    assert list(flight) == [1.0, 1.0, 1.0]
    assert plots.delivery_series([rec(0.0, [], 10.0)]) is None


def test_playback_by_hand():
    one_s = SAMPLE_RATE * 2     # bytes of one second of 16-bit mono audio
    rec = {"chunks": [[100.0, one_s], [1500.0, one_s], [1600.0, one_s // 2]], "sample_rate": SAMPLE_RATE}
    pb = playback(rec)
    assert pb.stalls == [(1.1, 1.5)]             # 1 s played from 0.1 s, dry at 1.1 s until 1.5 s
    assert pb.end_t == pytest.approx(1.5 + 1.5)  # then 1.5 s of audio on hand, no further stall
    ts, played = pb.played_curve()
    assert ts == [0.1, 1.1, 1.5, 3.0] and played == [0.0, 1.0, 1.0, 2.5]
    assert playback({"chunks": [], "sample_rate": SAMPLE_RATE}) is None


def test_damaged_runs_are_reported_not_hidden(runs, tmp_path):
    run = tmp_path / "cut"
    shutil.copytree(runs["rate"], run)
    records = [json.loads(line) for line in (run / "requests.jsonl").read_text().splitlines()]
    next(r for r in records if r["ok"] and not r["warmup"])["underrun_s"] += 1.0   # disagrees with its chunks
    (run / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with (run / "requests.jsonl").open("a") as f:
        f.write('{"id": "custom/short/r1/99", "ok": tr')       # a crash mid-line
    meta = json.loads((run / "run.json").read_text())
    meta["finished_at"] = None
    (run / "run.json").write_text(json.dumps(meta))
    text = build([run], tmp_path / "r.html").read_text()
    assert "1 unreadable line(s)" in text and "no finished_at" in text
    assert "for 1 request(s) the underrun recomputed from the chunk timings differs" in text


def test_resumed_run_lists_its_sessions(runs, tmp_path):
    run = tmp_path / "resumed"
    shutil.copytree(runs["rate"], run)
    meta = json.loads((run / "run.json").read_text())
    meta["sessions"].append({"started_at": "2025-11-21T11:00:00+00:00", "finished_at": "2025-11-21T11:02:00+00:00",
                             "command": ["ttsbench", "run", "--resume", str(run)], "url": "http://127.0.0.1:8091"})
    (run / "run.json").write_text(json.dumps(meta))
    cfg = parse(build([run], tmp_path / "r.html")).sections["configuration"]["text"]
    assert "sessions" in cfg and "2025-11-21T11:00:00+00:00 – 2025-11-21T11:02:00+00:00" in cfg


def test_report_command_errors_and_default_output(runs, tmp_path):
    cli = CliRunner()
    result = cli.invoke(app, ["report", str(runs["rate"]), "-o", str(tmp_path)])
    assert result.exit_code == 2 and "cannot write the report" in result.output
    result = cli.invoke(app, ["report", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "run directory not found" in result.output
    bare = tmp_path / "bare"
    shutil.copytree(runs["rate"], bare)
    (bare / "summary.json").unlink()
    result = cli.invoke(app, ["report", str(bare)])
    assert result.exit_code == 2 and "ttsbench summarize" in result.output
    assert not (bare / "report.html").exists()
    whole = tmp_path / "whole"
    shutil.copytree(runs["rate"], whole)
    result = cli.invoke(app, ["report", str(whole)])
    assert result.exit_code == 0 and (whole / "report.html").is_file()     # default: inside the run


# --- rendering in headless Chromium -------------------------------------------------------------

_PROBE = ('<script>window.addEventListener("load",function(){var im=document.images,ok=0;'
          'for(var i=0;i<im.length;i++){if(im[i].complete&&im[i].naturalWidth>0)ok++;'
          'else console.error("broken image: "+im[i].alt)}'
          'document.body.setAttribute("data-probe",ok+"/"+im.length+" "+document.documentElement.scrollWidth'
          '+" "+document.documentElement.scrollHeight)});</script>')


def chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium is not installed: run `bash scripts/setup.sh --test`")
    # The background-networking flags keep it from dialling out (connections are refused here).
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--hide-scrollbars", f"--user-data-dir={tmp / 'profile'}", "--enable-logging=stderr", "--v=0",
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "LANG": "C.UTF-8"})


@pytest.mark.parametrize("name", ["compare", "rate"])
def test_renders_in_chromium_without_console_errors(name, reports, tmp_path):
    src = reports[name]
    probe = tmp_path / "probe.html"
    probe.write_text(src.read_text().replace("</body>", _PROBE + "</body>"))
    width, height = 1366, 768           # a laptop screen
    dom = chromium(tmp_path, f"--window-size={width},{height}", "--virtual-time-budget=10000", "--dump-dom",
                   probe.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line]
    assert not console, console
    marker = dom.stdout.split('data-probe="', 1)[1].split('"', 1)[0]
    loaded, page_width, page_height = marker.split()
    n_images = len(parse(src).images)
    assert loaded == f"{n_images}/{n_images}"
    assert int(page_width) <= width          # no sideways scrolling on a laptop: wide tables scroll inside
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(src, ARTIFACTS / f"report-{name}.html")
    for shot, size in ((f"report-{name}-laptop.png", (width, height)),
                       (f"report-{name}-full.png", (width, min(int(page_height), 16000)))):
        out = ARTIFACTS / shot
        out.unlink(missing_ok=True)
        res = chromium(tmp_path, f"--window-size={size[0]},{size[1]}", f"--screenshot={out}", src.as_uri())
        assert res.returncode == 0 and out.is_file(), res.stderr[-2000:]
        assert not [line for line in res.stderr.splitlines() if "CONSOLE" in line]
        img = mpimg.imread(out)
        assert img.shape[:2] == (size[1], size[0])
        assert (img[..., :3] < 0.9).any(axis=2).mean() > 0.02    # real content, not a blank page
