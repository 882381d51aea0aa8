"""`ttsbench serve`: check the options, find the checkpoint, then serve until interrupted."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from serving.api.server import SpeechServer, run_server
from serving.engine.checkpoint import cache_root, resolve_model
from serving.engine.codec_graphs import parse_batches
from serving.engine.engine import Engine, EngineConfig
from serving.engine.loader import check_placement

log = logging.getLogger("serving.api")


@dataclass(frozen=True)
class ServeOptions:
    model: str = "tiny-random"
    load_format: str = "auto"
    dtype: str = "auto"
    talker_device: str = "auto"
    codec_device: str = "auto"
    max_batch_size: int = 32
    max_queue: int = 64
    kv_cache_gb: float | None = None
    max_model_len: int = 4096
    chunk_frames: int = 25
    first_chunk_frames: int = 2
    left_context_frames: int = 72
    host: str = "127.0.0.1"
    port: int = 8091
    api_key: str | None = None
    voices_dir: Path | None = None
    served_model_name: str | None = None
    enforce_eager: bool = False
    compile: bool | None = None
    max_graph_batch: int = 128
    ignore_eos: bool = False
    length_policy: str = "text"
    codec_dtype: str = "auto"
    max_codec_batch: int = 64
    codec_batch_wait_ms: float = 100.0
    codec_graph_batches: str | None = None  # "1,2,4,8,16", or "none"
    codec_graph_memory_gb: float | None = None
    request_log: Path | None = None  # one JSON line per finished speech request (serving/api/request_log.py)


def build_server(options: ServeOptions) -> SpeechServer:
    """Everything but listening; raises ValueError with a clear message for any bad option."""
    if options.first_chunk_frames > options.chunk_frames:
        raise ValueError("--first-chunk-frames must not exceed --chunk-frames")
    path = resolve_model(options.model)
    name = options.served_model_name or options.model
    config = EngineConfig(
        model=str(path), model_name=name, load_format=options.load_format, dtype=options.dtype,
        talker_device=options.talker_device, codec_device=options.codec_device,
        max_batch_size=options.max_batch_size, max_queue=options.max_queue, kv_cache_gb=options.kv_cache_gb,
        max_model_len=options.max_model_len, chunk_frames=options.chunk_frames,
        first_chunk_frames=options.first_chunk_frames, left_context_frames=options.left_context_frames,
        enforce_eager=options.enforce_eager, compile=options.compile, max_graph_batch=options.max_graph_batch,
        ignore_eos=options.ignore_eos, length_policy=options.length_policy, codec_dtype=options.codec_dtype,
        max_codec_batch=options.max_codec_batch, codec_batch_wait_ms=options.codec_batch_wait_ms,
        codec_graph_batches=parse_batches(options.codec_graph_batches),
        codec_graph_memory_gb=options.codec_graph_memory_gb)
    check_placement(config)  # a bad device or dtype fails here, before the server listens
    voices_dir = options.voices_dir or cache_root() / "voices" / _safe(name)
    names = tuple(dict.fromkeys((name, options.model, str(path), path.name)))
    return SpeechServer(Engine(config), voices_dir=voices_dir, api_key=options.api_key, served_model_names=names,
                        request_log=options.request_log)


def serve_forever(options: ServeOptions) -> None:
    server = build_server(options)
    log.info("serving %s on http://%s:%d (voices in %s)", server.served_model_names[0], options.host, options.port,
             server.voices_dir)
    run_server(server, options.host, options.port)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip("._") or "model"
