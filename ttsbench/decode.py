"""Turns a RawResponse into audio and per-chunk audio arrivals, after the request has completed.

Forms, told apart by Content-Type (and the first bytes when it is vague):
- raw PCM (`audio/pcm`, `audio/L16`, octet-stream): s16le mono at the rate the response names
  (`rate=` parameter or `X-Sample-Rate`), else the configured PCM rate (24 kHz for Qwen3-TTS);
- WAV: a RIFF header first (streaming servers write 0xFFFFFFFF or 0 as sizes), then PCM;
- SSE (`text/event-stream`): `speech.audio.delta` events with base64 audio (PCM, or WAV pieces
  whose headers are stripped), ended by `speech.audio.done`;
- compressed (FLAC, and whatever libsndfile reads): decoded whole; audio seconds are spread
  over the chunks in proportion to their bytes.
A chunk's audio counts from the arrival of the network read that completed it, so a WAV header or
SSE framing never counts as audio.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import struct
from dataclasses import dataclass, field

import numpy as np
import soundfile

from ttsbench.client import RawResponse

DEFAULT_PCM_RATE = 24000
_UNKNOWN_SIZE = 0x7FFFFFFF  # streaming WAVs write 0xFFFFFFFF (or a near value) or 0
_PCM_TYPES = ("audio/pcm", "audio/l16", "audio/raw", "audio/x-raw", "application/octet-stream")
_WAV_TYPES = ("audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave")


class AudioError(Exception):
    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind, self.detail = kind, detail


@dataclass
class Decoded:
    """Audio of one response. `chunks`: (arrival seconds, audio bytes, audio seconds) per read
    that carried audio. `fmt` is a WAVE fmt chunk body describing `data`."""
    error: str | None = None
    error_detail: str | None = None
    chunks: list[tuple[float, int, float]] = field(default_factory=list)
    data: bytes = b""
    fmt: bytes | None = None
    sample_rate: int | None = None
    n_bytes: int = 0
    audio_s: float | None = None

    def wav_bytes(self) -> bytes:
        """A complete WAV file of the received audio (correct sizes, the stream's own format)."""
        fmt = self.fmt or _pcm16_fmt(self.sample_rate or DEFAULT_PCM_RATE, 1)
        body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(self.data)) + self.data
        if len(self.data) & 1:
            body += b"\0"
        return b"RIFF" + struct.pack("<I", len(body)) + body


def _pcm16_fmt(rate: int, channels: int) -> bytes:
    return struct.pack("<HHIIHH", 1, channels, rate, rate * 2 * channels, 2 * channels, 16)


@dataclass
class _Wav:
    fmt: bytes
    rate: int
    block_align: int
    data_offset: int
    data_size: int | None


def _parse_wav_header(buf: bytes) -> _Wav | None:
    """The header of a (possibly streaming) WAV; None while more bytes are needed."""
    if len(buf) < 12:
        return None
    if buf[:4] != b"RIFF" or buf[8:12] != b"WAVE":
        raise AudioError("invalid_audio", "WAV stream does not start with a RIFF/WAVE header")
    pos, fmt = 12, None
    while True:
        if len(buf) < pos + 8:
            return None
        chunk_id, size = buf[pos:pos + 4], struct.unpack_from("<I", buf, pos + 4)[0]
        if chunk_id == b"data":
            if fmt is None:
                raise AudioError("invalid_audio", "WAV data chunk before its fmt chunk")
            _, channels, rate, _, block_align, _ = struct.unpack_from("<HHIIHH", fmt)
            if channels < 1 or rate < 1 or block_align < 1:
                raise AudioError("invalid_audio", f"WAV fmt chunk is malformed ({channels} ch, {rate} Hz)")
            unknown = size == 0 or size >= _UNKNOWN_SIZE
            return _Wav(fmt, rate, block_align, pos + 8, None if unknown else size)
        if size >= _UNKNOWN_SIZE:
            raise AudioError("invalid_audio", f"WAV chunk {chunk_id!r} has no usable size")
        if len(buf) < pos + 8 + size:
            return None
        if chunk_id == b"fmt ":
            if size < 16:
                raise AudioError("invalid_audio", "WAV fmt chunk is too short")
            fmt = buf[pos + 8:pos + 8 + size]
        pos += 8 + size + (size & 1)


def _content_type(raw: RawResponse) -> tuple[str, dict[str, str]]:
    value = raw.headers.get("content-type", "")
    main, *params = [p.strip() for p in value.split(";")]
    parsed = {}
    for p in params:
        if "=" in p:
            k, v = p.split("=", 1)
            parsed[k.strip().lower()] = v.strip().strip('"')
    return main.lower(), parsed


def _pcm_rate(raw: RawResponse, params: dict[str, str], default: int) -> int:
    for value in (params.get("rate"), params.get("samplerate"), raw.headers.get("x-sample-rate")):
        if value and value.isdigit() and int(value) > 0:
            return int(value)
    return default


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style JSON error, else the body's first characters."""
    text = body.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:500]
        return str(err)[:500]
    except (json.JSONDecodeError, AttributeError):
        return text[:500]


def _byte_stream(pieces: list[tuple[float, bytes]], form: str, pcm_rate: int, out: Decoded) -> None:
    """PCM, or WAV (its header at the start of the stream is not audio), arriving in `pieces`."""
    body = b"".join(p for _, p in pieces)
    announced = None
    if form == "wav":
        wav = _parse_wav_header(body)
        if wav is None:
            raise AudioError("truncated", f"stream ended inside the WAV header ({len(body)} bytes)")
        start, fmt, rate, align = wav.data_offset, wav.fmt, wav.rate, wav.block_align
        announced = wav.data_size
    else:
        start, fmt, rate, align = 0, _pcm16_fmt(pcm_rate, 1), pcm_rate, 2
    end = len(body) if announced is None else min(len(body), start + announced)
    _fill(out, pieces, start, end, body, fmt, rate, align)
    if announced is not None and end - start < announced:
        raise AudioError("truncated", f"WAV header announces {announced} data bytes, got {end - start}")
    if (end - start) % align:
        raise AudioError("truncated", f"stream ended inside a sample ({end - start} bytes, frames of {align})")


def _fill(out: Decoded, pieces, start: int, end: int, body: bytes, fmt: bytes, rate: int, align: int) -> None:
    bytes_per_s = rate * align
    chunks, offset = [], 0
    for t, piece in pieces:
        lo, hi = max(offset, start), min(offset + len(piece), end)
        offset += len(piece)
        if hi > lo:
            chunks.append((t, hi - lo, (hi - lo) / bytes_per_s))
    out.chunks, out.data, out.fmt, out.sample_rate = chunks, body[start:end], fmt, rate
    out.n_bytes = end - start
    out.audio_s = (out.n_bytes // align) / rate


def _compressed(pieces: list[tuple[float, bytes]], out: Decoded) -> None:
    body = b"".join(p for _, p in pieces)
    try:
        samples, rate = soundfile.read(io.BytesIO(body), dtype="int16", always_2d=True)
    except Exception as exc:  # libsndfile reports any unreadable input as a generic error
        raise AudioError("invalid_audio", f"cannot decode audio ({len(body)} bytes): {exc}") from None
    audio_s = samples.shape[0] / rate
    total = sum(len(p) for _, p in pieces) or 1
    out.chunks = [(t, len(p), audio_s * len(p) / total) for t, p in pieces if p]
    out.data = np.ascontiguousarray(samples).tobytes()
    out.fmt, out.sample_rate = _pcm16_fmt(rate, samples.shape[1]), rate
    out.n_bytes, out.audio_s = len(body), audio_s


def _sse_events(raw: RawResponse) -> tuple[list[tuple[float, bytes]], bool]:
    """(arrival, decoded audio) of each speech.audio.delta event, and whether speech.audio.done came.
    An event counts at the arrival of the read that completed it."""
    pieces, done, buf = [], False, b""
    for t, data in raw.chunks:
        buf += data
        if b"\r" in buf:  # CRLF framing, possibly split across reads
            buf = buf.replace(b"\r\n", b"\n")
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            lines = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
            if not lines:
                continue
            payload = b"\n".join(lines)
            if payload == b"[DONE]":
                done = True
                continue
            try:
                obj = json.loads(payload)
            except json.JSONDecodeError:
                raise AudioError("invalid_audio", f"SSE event is not JSON: {payload[:100]!r}") from None
            kind = obj.get("type") if isinstance(obj, dict) else None
            if kind == "speech.audio.delta":
                audio = obj.get("audio") or obj.get("delta") or ""
                try:
                    pieces.append((t, base64.b64decode(audio, validate=True)))
                except (binascii.Error, TypeError):
                    raise AudioError("invalid_audio", "SSE audio delta is not valid base64") from None
            elif kind == "speech.audio.done":
                done = True
            elif kind == "error" or (isinstance(obj, dict) and "error" in obj):
                raise AudioError("other", f"server error event: {_error_message(payload)}")
    return pieces, done


def _sse_wav(pieces: list[tuple[float, bytes]], out: Decoded) -> None:
    """SSE deltas carrying WAV: a header on the first delta only, or one on every delta (each
    delta a small WAV file). Every header is cut away; the first one gives the format."""
    first = _parse_wav_header(pieces[0][1])
    if first is None:
        raise AudioError("invalid_audio", "SSE delta holds an incomplete WAV header")
    stripped = []
    for t, piece in pieces:
        if piece.startswith(b"RIFF"):
            wav = _parse_wav_header(piece)
            if wav is None:
                raise AudioError("invalid_audio", "SSE delta holds an incomplete WAV header")
            end = len(piece) if wav.data_size is None else wav.data_offset + wav.data_size
            piece = piece[wav.data_offset:end]
        stripped.append((t, piece))
    body = b"".join(p for _, p in stripped)
    _fill(out, stripped, 0, len(body), body, first.fmt, first.rate, first.block_align)
    if len(body) % first.block_align:
        raise AudioError("truncated", f"stream ended inside a sample ({len(body)} bytes)")


def _sniff(first: bytes) -> str | None:
    if first.startswith(b"RIFF"):
        return "wav"
    if first.startswith((b"fLaC", b"OggS", b"ID3")) or first[:2] in (b"\xff\xfb", b"\xff\xf3", b"\xff\xf2"):
        return "compressed"
    return None


def decode(raw: RawResponse, pcm_rate: int = DEFAULT_PCM_RATE) -> Decoded:
    """Audio and chunk arrivals of a response; `error` says why it is not a complete, valid answer.
    A transport error (connect, timeout, reset) keeps what arrived before it."""
    out = Decoded(error=raw.error, error_detail=raw.error_detail)
    body_start = raw.chunks[0][1][:16] if raw.chunks else b""
    if raw.status is not None and raw.status >= 400:
        out.error = f"http_{raw.status}"
        out.error_detail = _error_message(b"".join(d for _, d in raw.chunks)) or None
        return out
    main, params = _content_type(raw)
    try:
        if main == "text/event-stream":
            pieces, done = _sse_events(raw)
            kind = _sniff(pieces[0][1]) if pieces else None
            if kind == "wav":
                _sse_wav(pieces, out)
            elif kind == "compressed":
                _compressed(pieces, out)
            else:
                _byte_stream(pieces, "pcm", _pcm_rate(raw, params, pcm_rate), out)
            if not done and raw.error is None:
                raise AudioError("truncated", "SSE stream ended without speech.audio.done")
        elif main.startswith(("application/json", "text/")):
            raise AudioError("invalid_audio", f"expected audio, got {main}: "
                             f"{_error_message(b''.join(d for _, d in raw.chunks))[:200]}")
        else:
            kind = ("wav" if main in _WAV_TYPES else "pcm" if main in _PCM_TYPES else
                    "compressed" if main.startswith("audio/") else None)
            sniffed = _sniff(body_start)
            if sniffed == "wav" or kind is None:
                kind = sniffed or "pcm"
            if kind == "compressed":
                _compressed(raw.chunks, out)
            else:
                _byte_stream(raw.chunks, kind, _pcm_rate(raw, params, pcm_rate), out)
        if out.error is None and not out.n_bytes:
            raise AudioError("invalid_audio", "response carried no audio")
    except AudioError as e:
        if out.error is None:  # a transport error explains a broken stream better than its symptom
            out.error, out.error_detail = e.kind, e.detail
    return out
