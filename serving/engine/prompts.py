"""From an engine request to the talker's prompt: reference audio becomes an x-vector and codes first.

The prompt layout itself is serving.model.prompt's; this adds what serving needs around it: the task names
of the API, the speaker encoder and codec encoder on the talker's device, and a cache so an uploaded voice
is encoded once, not on every request.
"""

from __future__ import annotations

import threading
import warnings
from typing import Callable

import numpy as np
import torch
from torch import nn

from serving.engine.request import GenerationRequest
from serving.model.config import SAMPLE_RATE
from serving.model.prompt import Prompt, SynthesisRequest
from serving.model.prompt import PromptBuilder as TalkerPromptBuilder
from serving.model.prompt import load_text_tokenizer

MODEL_TASKS = {"CustomVoice": "custom_voice", "VoiceDesign": "voice_design", "Base": "voice_clone"}
WARM_UP_TEXTS = ("A short warm-up line.", "A longer warm-up paragraph, as a served burst brings them: " * 6)
WARM_UP_REFERENCE_FRAMES = 50  # a 4 s reference clip's codes


class _CudnnOff:
    """cuDNN off while any thread encodes a reference. The flag is process-wide and torch.backends.cudnn.flags
    restores on exit what it found on entry, so two overlapping encodings (the engine runs several voice threads)
    would leave it off for good, or turn it back on under the other: here the first one in turns it off and the
    last one out restores it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0
        self._found = True

    def __enter__(self) -> None:
        with self._lock:
            if self._users == 0:
                self._found = torch.backends.cudnn.enabled
                torch.backends.cudnn.enabled = False
            self._users += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                torch.backends.cudnn.enabled = self._found


WITHOUT_CUDNN = _CudnnOff()


class PromptBuilder:
    def __init__(self, path, model, model_cfg, generation_defaults, codec_encoder, device: torch.device):
        self.model = model
        self.cfg = model_cfg
        self.defaults = generation_defaults
        self.codec_encoder = codec_encoder
        self.device = device
        self.builder = TalkerPromptBuilder(model_cfg, model.talker, load_text_tokenizer(str(path)))
        if device.type == "cuda":  # a burst's text is a gather, not kernels planned per shape (tabulate_text)
            self.builder.tabulate_text()
        self.num_groups = model_cfg.talker.num_code_groups
        self._speaker_net = self._codec_net = None
        if model.speaker_encoder is not None and codec_encoder is not None:
            self._speaker_net, self._codec_net = as_torchscript(model.speaker_encoder), as_torchscript(codec_encoder)

    def tts_pad_embed(self) -> torch.Tensor:
        with torch.inference_mode():
            ids = torch.tensor([[self.cfg.tts_pad_token_id]], device=self.device)
            return self.builder.embed_text(ids)[0, 0]

    @torch.inference_mode()
    def build_many(self, requests: list[GenerationRequest], cached: Callable[[str | None, Callable[[], tuple]], tuple]
                   ) -> list[tuple[Prompt, np.ndarray] | ValueError]:
        """For each request, (talker prompt, reference codes (n, Q) for the codec's first-chunk context), or the
        ValueError that makes it unservable. The talker prompts are built together (one tokenizer call)."""
        out: list = [None] * len(requests)
        synthesis = []
        for i, request in enumerate(requests):
            try:
                synthesis.append((i, self._synthesis(request, cached)))
            except ValueError as exc:
                out[i] = exc
        prompts = self.builder.build_many([s for _, s in synthesis])
        for (i, s), prompt in zip(synthesis, prompts):
            if isinstance(prompt, ValueError):
                out[i] = prompt
                continue
            codes = (s.ref_codes.cpu().numpy().astype(np.int64) if s.ref_codes is not None
                     else np.zeros((0, self.num_groups), dtype=np.int64))
            out[i] = (prompt, codes)
        return out

    def _synthesis(self, request: GenerationRequest, cached) -> SynthesisRequest:
        """The model's request: reference audio becomes an x-vector and codes (once per voice, through `cached`)."""
        embedding = ref_codes = None
        if request.task == "Base":
            if request.speaker_embedding is not None:
                embedding = torch.as_tensor(request.speaker_embedding, dtype=torch.float32)
            elif request.encoded_voice is not None:
                embedding, ref_codes = request.encoded_voice
            else:
                embedding, ref_codes = cached(request.voice_key, lambda: self.encode_reference(request.ref_audio))
                if request.x_vector_only:
                    ref_codes = None
        return SynthesisRequest(
            text=request.text, task=MODEL_TASKS[request.task], language=request.language,
            speaker=request.speaker, instruct=request.instructions, speaker_embedding=embedding,
            ref_codes=ref_codes, ref_text=request.ref_text if ref_codes is not None else None,
            non_streaming_text=request.non_streaming_mode, voice_key=request.voice_key)

    def warm_up_requests(self, n: int) -> list[GenerationRequest]:
        """n requests of the checkpoint's task for a start-up admission (TalkerRunner.warmup): every speaker with
        every language (the prompt pieces each pair shares are memoised on first use), short and long texts; for
        voice clone, an x-vector alone and in-context references (random codes) in turn."""
        task = next(name for name, model_task in MODEL_TASKS.items() if model_task == self.cfg.task)
        speakers = self.cfg.speakers if task == "CustomVoice" else [None]
        pairs = [(speaker, language) for speaker in speakers for language in self.cfg.languages]
        hidden = self.cfg.talker.transformer.hidden_size
        requests = []
        for i in range(n):
            speaker, language = pairs[i % len(pairs)]
            text = WARM_UP_TEXTS[i % len(WARM_UP_TEXTS)]
            voice = {}
            if task == "Base" and i % 2:
                codes = torch.zeros((WARM_UP_REFERENCE_FRAMES, self.num_groups), dtype=torch.long)
                voice = dict(encoded_voice=(torch.zeros(hidden), codes), ref_text=WARM_UP_TEXTS[0])
            elif task == "Base":
                voice = dict(speaker_embedding=np.zeros(hidden, dtype=np.float32))
            requests.append(GenerationRequest(
                task=task, text=text, language=language, speaker=speaker,
                instructions="A calm voice." if task == "VoiceDesign" else None, **voice))
        return requests

    def warm_up_encoders(self) -> None:
        """Encode a synthetic clip once (voice clone checkpoints): a process's first encoding sets up the FFT and
        the kernels' modules, 0.77 s on an H100 against ~35 ms for a new voice after it
        (benchmarks/voice_encode_bench.py), which the server's first clone request would otherwise pay."""
        if self.model.speaker_encoder is not None and self.codec_encoder is not None:
            clip = np.random.default_rng(0).standard_normal(2 * SAMPLE_RATE).astype(np.float32) * 0.1
            self.encode_reference(clip)

    def encode_reference(self, audio: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x-vector, reference codes [frames, groups]) of a reference clip, both on the host: the caller may run
        this on its own CUDA stream, and the copies finish that stream's work before anyone reads them."""
        if audio is None or self.model.speaker_encoder is None or self.codec_encoder is None:
            raise ValueError("voice cloning needs reference audio and a Base checkpoint")
        # Without cuDNN: each reference has its own length, and cuDNN sets up its convolutions anew for each shape.
        # On an H100 a new length took 29 + 60 ms (speaker + codec encoder) through cuDNN, 24 + 17 ms without
        # (repeats: 7 + 15 against 22 + 15; docs/performance.md). A voice is encoded once, so first calls are what
        # count. The flag is process-wide: the codec thread's eager calls (priming) meanwhile also skip cuDNN.
        # The networks run as TorchScript (as_torchscript), unoptimised: the same operators, no fusions compiled per
        # length. The graph executor's flag is per thread; cuDNN's is the process's (WITHOUT_CUDNN counts its users).
        with WITHOUT_CUDNN, torch.jit.optimized_execution(False):
            embedding = self.model.speaker_encoder.embed(audio, SAMPLE_RATE, net=self._speaker_net).float().cpu()
            codes = self.codec_encoder.encode([audio], SAMPLE_RATE, net=self._codec_net)[0].cpu()
        return embedding, codes


def as_torchscript(module: nn.Module) -> torch.jit.ScriptModule:
    """A reference encoder as TorchScript, for the voice threads. In Python each of an encoding's ~700 operators
    takes the interpreter back after its launch, beside the talker's, codec's and loops' threads: on an H100 a new
    voice took ~40-50 ms under load against ~19 alone, ~20 voices a second (docs/performance.md). TorchScript runs
    the whole network with the interpreter let go, the same operators, and the same parameters (shared, not
    copied). On an H100 beside two threads of small launches: 40.3 new voices a second against 21.4 in Python, and
    four threads sharing the networks (the engine's VOICE_THREADS) reach 142.8 (docs/performance.md).
    torch.jit.script warns that it is deprecated (PyTorch 2.13); it still ships and is what releases the interpreter
    for a whole call without a compile step per length."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.* is deprecated")
        return torch.jit.script(module)
