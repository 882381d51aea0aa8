"""Offline API: load a checkpoint once, then synthesise (codes + 24 kHz waveform), whole or streamed.

    tts = Qwen3TTS.load("Qwen3-TTS-12Hz-0.6B-CustomVoice", dtype="bfloat16", device="cuda")
    out = tts.generate("Hello!", speaker="vivian", language="english")       # out.codes, out.audio
    for chunk in tts.stream("Hello!", speaker="vivian"): ...                 # float32 numpy chunks

A thin loop over serving.model.frame (the pieces the engine batches). Defaults come from the checkpoint's
generation_config.json, as in the official wrapper. `max_new_tokens` keeps the official meaning: at most
max_new_tokens - 1 frames come out (the official generate never expands its last sampled code0).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from serving.model import weights
from serving.model.codec_stream import IncrementalCodecDecoder, next_chunk_frames
from serving.model.config import SAMPLE_RATE, GenerationDefaults, ModelConfig
from serving.model.frame import TalkerSampling, decode_frame, prefill
from serving.model.model import Qwen3TTSModel
from serving.model.prompt import PromptBuilder, SynthesisRequest, load_text_tokenizer
from serving.model.sampler import SamplingParams, validate
from serving.model.speech_tokenizer import SpeechTokenizer


@dataclass
class Synthesis:
    codes: torch.Tensor  # [frames, 16] int64
    audio: np.ndarray  # float32 mono waveform at sample_rate
    sample_rate: int = SAMPLE_RATE


@dataclass
class VoiceClonePrompt:
    """What a reference recording contributes to voice cloning; reusable across requests."""

    speaker_embedding: torch.Tensor  # [H] x-vector
    ref_codes: torch.Tensor | None = None  # [T, 16]; None = x-vector-only cloning
    ref_text: str | None = None


class Qwen3TTS:
    def __init__(self, cfg: ModelConfig, model: Qwen3TTSModel, speech_tokenizer: SpeechTokenizer, tokenizer,
                 defaults: GenerationDefaults):
        self.cfg, self.model, self.speech_tokenizer, self.defaults = cfg, model, speech_tokenizer, defaults
        self.prompts = PromptBuilder(cfg, model.talker, tokenizer)

    @classmethod
    def load(cls, path: str | Path, load_format: str = "auto", dtype: str | torch.dtype = "bfloat16",
             device: str | torch.device = "cpu", codec_dtype: str | torch.dtype = "float32") -> "Qwen3TTS":
        """load_format: "auto"/"safetensors" read model.safetensors (single or sharded); "dummy" builds the
        same architecture with random weights (config and tokenizer files are still read from path)."""
        if load_format not in weights.LOAD_FORMATS:
            raise ValueError(f"load_format {load_format!r} is not one of {weights.LOAD_FORMATS}")
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint directory not found: {path}")
        cfg = ModelConfig.from_dir(path)
        dtype = weights.resolve_dtype(dtype)
        with torch.device("meta"):
            model = Qwen3TTSModel(cfg)
        model = weights.materialize(model, dtype, device)
        if load_format == "dummy":
            weights.init_dummy_(model)
        else:
            weights.load_safetensors_(model, weights.safetensors_files(path), source=str(path))
        speech_tokenizer = SpeechTokenizer.load(path / "speech_tokenizer", dtype=codec_dtype, device=device,
                                                load_format=load_format)
        return cls(cfg, model.eval(), speech_tokenizer, load_text_tokenizer(path), GenerationDefaults.from_dir(path))

    @property
    def device(self) -> torch.device:
        return self.model.talker.codec_head.weight.device

    # --- voice cloning inputs -------------------------------------------------------------------------------------

    def create_voice_clone_prompt(self, audio: np.ndarray, sample_rate: int, ref_text: str | None = None,
                                  x_vector_only: bool = False) -> VoiceClonePrompt:
        """Reference audio (mono, any rate) -> x-vector, and for ICL cloning (x_vector_only=False) its codes.
        ICL needs the transcript of the reference (ref_text)."""
        if self.model.speaker_encoder is None:
            raise ValueError(f"this checkpoint ({self.cfg.tts_model_type}) has no speaker encoder: voice cloning "
                             "needs a Base checkpoint")
        if not x_vector_only and not ref_text:
            raise ValueError("ICL voice cloning needs ref_text (the reference transcript); "
                             "or pass x_vector_only=True")
        audio = np.asarray(audio, dtype=np.float32)
        embedding = self.model.speaker_encoder.embed(audio, sample_rate)
        codes = None if x_vector_only else self.speech_tokenizer.encoder.encode([audio], sample_rate)[0]
        return VoiceClonePrompt(speaker_embedding=embedding, ref_codes=codes, ref_text=ref_text)

    # --- generation -----------------------------------------------------------------------------------------------

    def _request(self, text: str, speaker, language, instruct, voice: VoiceClonePrompt | None,
                 speaker_embedding, non_streaming_text) -> SynthesisRequest:
        if voice is not None and speaker_embedding is not None:
            raise ValueError("pass either a voice clone prompt or a speaker embedding, not both")
        if speaker_embedding is not None:
            voice = VoiceClonePrompt(speaker_embedding=torch.as_tensor(speaker_embedding))
        return SynthesisRequest(
            text=text, task=self.cfg.task, language=language or "auto", speaker=speaker, instruct=instruct,
            speaker_embedding=None if voice is None else voice.speaker_embedding,
            ref_codes=None if voice is None else voice.ref_codes, ref_text=None if voice is None else voice.ref_text,
            non_streaming_text=non_streaming_text)

    def _sampling(self, overrides: dict) -> tuple[TalkerSampling, int, torch.Generator | None]:
        unknown = set(overrides) - {f.name for f in fields(GenerationDefaults)} - {"seed"}
        if unknown:
            raise TypeError(f"unknown generation parameters: {sorted(unknown)}")
        seed = overrides.pop("seed", None)
        p = {f.name: getattr(self.defaults, f.name) for f in fields(GenerationDefaults)}
        p.update({k: v for k, v in overrides.items() if v is not None})
        validate(p["do_sample"], p["temperature"], p["top_k"], p["top_p"], p["repetition_penalty"])
        if p["max_new_tokens"] < 2:
            raise ValueError(f"max_new_tokens must be >= 2 (frames = max_new_tokens - 1), got {p['max_new_tokens']}")
        dev = self.device
        sampling = TalkerSampling(
            code0=SamplingParams.build(1, dev, p["do_sample"], p["temperature"], p["top_k"], p["top_p"]),
            repetition_penalty=torch.full((1,), float(p["repetition_penalty"]), device=dev),
            subtalker=SamplingParams.build(1, dev, p["subtalker_dosample"], p["subtalker_temperature"],
                                           p["subtalker_top_k"], p["subtalker_top_p"]),
        )
        generator = None
        if seed is not None:
            generator = torch.Generator(device=dev).manual_seed(int(seed))
        return sampling, int(p["max_new_tokens"]), generator

    @torch.inference_mode()
    def iter_frames(self, text: str, *, speaker: str | None = None, language: str | None = None,
                    instruct: str | None = None, voice: VoiceClonePrompt | None = None,
                    speaker_embedding: torch.Tensor | None = None, non_streaming_text: bool | None = None,
                    **generation) -> Iterator[torch.Tensor]:
        """Yield frames ([16] int64 codes) as the talker produces them; stops at eos or the token limit."""
        req = self._request(text, speaker, language, instruct, voice, speaker_embedding, non_streaming_text)
        prompt = self.prompts.build(req)
        sampling, max_new_tokens, generator = self._sampling(dict(generation))
        state = prefill(self.model.talker, [prompt.prefill], max_new_tokens, sampling, generator)
        for step in range(max_new_tokens - 1):
            if bool(state.finished[0]):
                return
            text_embed = prompt.trailing[step] if step < prompt.trailing.shape[0] else prompt.tts_pad
            last = step == max_new_tokens - 2
            codes = decode_frame(self.model.talker, state, text_embed[None], sampling, generator,
                                 sample_next=not last)
            yield codes[0]

    def generate(self, text: str, **kwargs) -> Synthesis:
        """Whole utterance: codes and waveform (for ICL cloning, the reference part is decoded as context and
        cut off, as the official wrapper does)."""
        voice = kwargs.get("voice")
        frames = list(self.iter_frames(text, **kwargs))
        codes = torch.stack(frames) if frames else torch.zeros(0, self.cfg.talker.num_code_groups, dtype=torch.int64)
        return Synthesis(codes=codes.cpu(), audio=self.decode(codes, voice))

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor, voice: VoiceClonePrompt | None = None) -> np.ndarray:
        """Codes [T, 16] -> waveform, with the official offline decode (and ICL reference cut)."""
        decoder = self.speech_tokenizer.decoder
        dev = next(decoder.parameters()).device
        ref = None if voice is None else voice.ref_codes
        full = codes if ref is None else torch.cat((ref.to(codes.device), codes), dim=0)
        if full.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        wav = decoder.decode(full[None].to(dev))[0].float().cpu().numpy()
        if ref is not None:
            cut = int(ref.shape[0] / max(full.shape[0], 1) * wav.shape[0])
            wav = wav[cut:]
        return wav

    @torch.inference_mode()
    def stream(self, text: str, *, first_chunk_frames: int = 2, chunk_frames: int = 25,
               **kwargs) -> Iterator[np.ndarray]:
        """Yield waveform chunks as frames are produced: the first after first_chunk_frames frames, then chunks
        doubling up to chunk_frames (codec_stream.next_chunk_frames; the defaults are the server's). An
        incremental decoder carries the codec's state from chunk to chunk (ICL: the reference codes prime it),
        so the chunks concatenated equal the one-shot decode."""
        if min(first_chunk_frames, chunk_frames) < 1:
            raise ValueError("chunk sizes must be >= 1")
        voice = kwargs.get("voice")
        codec = IncrementalCodecDecoder(self.speech_tokenizer.decoder, num_slots=1)
        first = True
        if voice is not None and voice.ref_codes is not None and len(voice.ref_codes):
            codec.prime([(0, voice.ref_codes)])
            first = False
        pending, decoded = [], 0
        for frame in self.iter_frames(text, **kwargs):
            pending.append(frame)
            if len(pending) >= next_chunk_frames(decoded, first_chunk_frames, chunk_frames):
                yield codec.decode([(0, torch.stack(pending), first)])[0].float().cpu().numpy()
                first, pending, decoded = False, [], decoded + len(pending)
        if pending:
            yield codec.decode([(0, torch.stack(pending), first)])[0].float().cpu().numpy()
