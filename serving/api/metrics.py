"""Prometheus metrics of one server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_PHASE_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                  1.0, 2.0, 5.0)
_LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], dict[str, float]]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("ttsbench_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.first_audio = Histogram("ttsbench_first_audio_latency_seconds",
                                     "Request arrival to first audio ready to send", buckets=_LATENCY_BUCKETS,
                                     registry=r)
        self.e2e = Histogram("ttsbench_e2e_latency_seconds", "Request arrival to last audio sent",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.audio_seconds = Counter("ttsbench_audio_seconds", "Seconds of audio produced", registry=r)
        self.cancelled = Counter("ttsbench_cancelled_requests", "Requests cancelled by a client disconnect",
                                 registry=r)
        self.phase = Histogram("ttsbench_engine_phase_seconds",
                               "Where requests' time goes inside the engine, by phase (serving.engine.engine.PHASES)",
                               ["phase"], buckets=_PHASE_BUCKETS, registry=r)
        r.register(_EngineCollector(engine_stats))

    def observe_phase(self, phase: str, seconds: float) -> None:
        self.phase.labels(phase).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


_ENGINE_GAUGES = (
    ("queue_depth", "Requests waiting for a batch slot"),
    ("running", "Requests in the running talker batch"),
    ("kv_slots_total", "KV cache slots (the most requests that can run at once)"),
    ("kv_slots_free", "KV cache slots free"),
    ("frames_per_second", "Talker frames generated per second over the last few seconds"),
    ("codec_pending_frames", "Frames generated but not yet decoded to audio"),
)


class _EngineCollector:
    """Reads the engine's live figures at scrape time, so nothing has to be pushed on every step."""

    def __init__(self, stats: Callable[[], dict[str, float]]):
        self.stats = stats

    def describe(self):
        return []

    def collect(self):
        stats = self.stats()
        for key, help_text in _ENGINE_GAUGES:
            yield GaugeMetricFamily(f"ttsbench_{key}", help_text, value=float(stats.get(key, 0.0)))
        yield CounterMetricFamily("ttsbench_frames_generated", "Talker frames (16 codes each) generated",
                                  value=float(stats.get("frames_total", 0.0)))
        yield CounterMetricFamily("ttsbench_slot_moves", "Running requests moved to lower KV slots, so that a "
                                  "draining batch's steps cover fewer rows",
                                  value=float(stats.get("slot_moves_total", 0.0)))
        yield CounterMetricFamily("ttsbench_codec_frames_decoded", "Frames the codec decoded to audio",
                                  value=float(stats.get("codec_frames_decoded", 0.0)))
        yield CounterMetricFamily("ttsbench_codec_frames_computed", "Frames of the captured (rows, frames) shapes "
                                  "its calls ran, padding included (the vocoder skips what lies past a row's frames)",
                                  value=float(stats.get("codec_frames_computed", 0.0)))
        yield CounterMetricFamily("ttsbench_codec_frames_padding_rows", "Of the frames computed, those of rows that "
                                  "only fill a call up to its captured batch size",
                                  value=float(stats.get("codec_frames_padding_rows", 0.0)))
