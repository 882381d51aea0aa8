"""The playback model behind `underrun_s`, recomputed from a request's raw chunk arrivals.

The player is the harness's own (ttsbench.metrics.stalls); the report draws its stalls on the
chunk-arrival timelines, so they are recomputed here from `chunks` rather than taken on trust.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from ttsbench.metrics import stalls


@dataclass
class Playback:
    """Arrival and playback curves of one request, in seconds since the request was sent."""
    arrival_t: list[float]        # chunk arrival times
    received_s: list[float]       # audio seconds received once each chunk has arrived
    stalls: list[tuple[float, float]]  # (start, end) of each starvation
    end_t: float                  # when the player finishes the last sample

    @property
    def underrun_s(self) -> float:
        return sum(b - a for a, b in self.stalls)

    def played_curve(self) -> tuple[list[float], list[float]]:
        """(times, audio seconds played): slope 1 while playing, flat during each stall."""
        ts, played = [self.arrival_t[0]], [0.0]
        for a, b in self.stalls:
            pos = played[-1] + (a - ts[-1])
            ts += [a, b]
            played += [pos, pos]
        ts.append(self.end_t)
        played.append(self.received_s[-1])
        return ts, played

    @property
    def underrun_max_s(self) -> float:
        return max((b - a for a, b in self.stalls), default=0.0)


def seconds_per_byte(record: dict) -> float | None:
    """Audio seconds per payload byte: from the stored totals, else 16-bit mono at the stream's rate."""
    audio_s, nbytes, rate = record.get("audio_s"), record.get("bytes"), record.get("sample_rate")
    if audio_s and nbytes:
        return audio_s / nbytes
    if rate:
        return 1.0 / (2 * rate)
    return None


def timed_audio(record: dict) -> list[tuple[float, float]] | None:
    """(arrival in seconds since the request was sent, audio seconds) of each chunk that carried audio, or None
    when the record has no timed audio."""
    spb = seconds_per_byte(record)
    chunks = [(float(t), int(n)) for t, n in (record.get("chunks") or []) if n > 0]
    if spb is None or not chunks:
        return None
    return [(t_ms / 1000.0, n * spb) for t_ms, n in chunks]


def playback(record: dict) -> Playback | None:
    """The playback of one request record, or None when it carried no timed audio."""
    chunks = timed_audio(record)
    if chunks is None:
        return None
    arrival_t = [t for t, _ in chunks]
    received_s = list(accumulate(s for _, s in chunks))
    starved = stalls(chunks)
    end_t = arrival_t[0] + received_s[-1] + sum(b - a for a, b in starved)
    return Playback(arrival_t, received_s, starved, end_t)
