"""benchmarks/engine_phases.py and gpu_table.py's padding cell: a level's codec padding from two /metrics
scrapes, split into rows that only fill a call's batch and chunks shorter than their call's longest, and the
level's slot moves and split codec calls."""

from benchmarks import engine_phases
from benchmarks.gpu_table import padding


def scrape(decoded: float, computed: float, rows: float | None) -> str:
    lines = [f"ttsbench_codec_frames_decoded_total {decoded}", f"ttsbench_codec_frames_computed_total {computed}"]
    if rows is not None:
        lines.append(f"ttsbench_codec_frames_padding_rows_total {rows}")
    calls = decoded / 10  # a codec call of 10 frames every 0.1 s
    return "\n".join(lines + [f'ttsbench_engine_phase_seconds_sum{{phase="codec_call"}} {calls / 10}',
                              f'ttsbench_engine_phase_seconds_count{{phase="codec_call"}} {calls}']) + "\n"


def test_the_padding_between_two_scrapes_and_its_parts():
    """Between the scrapes: 600 frames decoded of 1000 computed, 150 of them rows filling a batch; the rest of
    the padding (250) is chunks shorter than their call's longest."""
    phases = engine_phases.diff(scrape(100, 200, 50), scrape(700, 1200, 200))
    assert phases["codec_frames"] == {"decoded": 600, "computed": 1000, "padded_share": 0.4, "rows_share": 0.15,
                                      "lengths_share": 0.25}
    assert phases["codec_call"] == {"count": 60, "mean_ms": 100.0}
    assert padding(phases["codec_frames"]) == "40.0% (15.0% + 25.0%)"


def test_a_server_without_the_rows_counter_reads_as_padding_by_lengths_alone_and_no_scrape_as_none():
    phases = engine_phases.diff(scrape(0, 0, None), scrape(90, 100, None))
    assert phases["codec_frames"]["padded_share"] == 0.1 and phases["codec_frames"]["rows_share"] == 0
    assert padding(None) == "-" and padding({"padded_share": 0.274}) == "27.4%"
    assert "codec_frames" not in engine_phases.diff("", "")


def test_a_levels_slot_moves_and_none_from_a_server_without_them():
    before = scrape(0, 0, 0) + "ttsbench_slot_moves_total 7.0\n"
    after = scrape(90, 100, 0) + "ttsbench_slot_moves_total 19.0\n"
    assert engine_phases.diff(before, after)["events"] == {"slot_moves": 12}
    assert "events" not in engine_phases.diff(scrape(0, 0, 0), scrape(90, 100, 0))
