"""Text side: the checkpoint's Qwen2 BPE tokenizer and the talker prompt (prefill embeddings + trailing text).

Layouts follow the official Qwen3TTSForConditionalGeneration.generate, slice for slice:

  [P(instruct)]  P(role: "<|im_start|>assistant\\n")
  (tts_pad ... tts_pad, tts_bos) + C(think|nothink, think_bos, [language], think_eos, [speaker], pad)
  then one body:
    streaming text       P(text[0]) + C(bos)                      trailing: P(text[1:]), P(tts_eos)
    non-streaming text   (P(text), P(tts_eos)) + C(pad); P(tts_pad) + C(bos)       trailing: none
    ICL voice clone      text track P(ref_text ++ text), P(tts_eos) against codec track
                         C(bos), sum_g E_g(ref_code[t, g]) ...; non-streaming puts the whole text first
                         (+ C(pad)), then the codec track (+ P(tts_pad)); streaming adds them position-wise
                         and the text left over trails into the decode steps.
After the trailing text runs out, every decode step adds P(tts_pad).
The official embeds each slice of a text's tokens on its own; here all texts of a burst are embedded in one pass
and sliced after (PromptBuilder._embed_texts): P acts on each token alone, so it is the same maths (on CPU in
float32, the same bits: the parity tests with qwen-tts give identical codes).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from serving.engine.lru import LRU
from serving.model.config import ModelConfig
from serving.model.talker import Talker
from serving.model.transfer import upload
from serving.model.weights import weights_stamp

TASKS = ("custom_voice", "voice_design", "voice_clone")
VOICE_MEMO_SIZE = 64  # voices whose prompt pieces stay on the device (PromptBuilder._per_voice)


def load_text_tokenizer(path: str):
    """The Qwen2 BPE tokenizer from the checkpoint's vocab.json / merges.txt / tokenizer_config.json."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def ref_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


def instruct_text(instruct: str) -> str:
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


@dataclass
class SynthesisRequest:
    """One utterance to synthesise. Which fields apply depends on the task:
    custom_voice: speaker (+ instruct on 1.7B); voice_design: instruct; voice_clone: speaker_embedding
    (x-vector, from reference audio or supplied by the caller) and, for ICL cloning, ref_codes + ref_text."""

    text: str
    task: str
    language: str = "auto"
    speaker: str | None = None
    instruct: str | None = None
    speaker_embedding: torch.Tensor | None = None  # [H]
    ref_codes: torch.Tensor | None = None  # [T_ref, G] int64
    ref_text: str | None = None
    non_streaming_text: bool | None = None  # None: the task's official default
    # The reference's identity where the caller has one (the server's key of an uploaded voice or inline clip):
    # the voice's prompt pieces are then looked up by it, not by a hash of speaker_embedding and ref_codes
    voice_key: str | None = None

    @property
    def icl(self) -> bool:
        return self.ref_codes is not None


@dataclass
class Prompt:
    prefill: torch.Tensor  # [L, H]
    trailing: torch.Tensor  # [T, H] text to add to decode steps 0..T-1 (may be empty)
    tts_pad: torch.Tensor  # [H], added to every decode step after the trailing text


def validate_request(cfg: ModelConfig, req: SynthesisRequest) -> None:
    """Clear errors for requests the checkpoint cannot serve (raises ValueError)."""
    if req.task not in TASKS:
        raise ValueError(f"unknown task {req.task!r}; expected one of {TASKS}")
    if req.task != cfg.task:
        raise ValueError(f"this checkpoint ({cfg.tts_model_type}) serves task {cfg.task!r}, not {req.task!r}")
    if not req.text or not req.text.strip():
        raise ValueError("text is empty")
    lang = (req.language or "auto").lower()
    if lang not in cfg.languages:
        raise ValueError(f"unsupported language {req.language!r}; supported: {cfg.languages}")
    if req.task == "custom_voice":
        if not req.speaker:
            raise ValueError(f"custom_voice needs a speaker; supported: {cfg.speakers}")
        if req.speaker.lower() not in cfg.talker.spk_id:
            raise ValueError(f"unsupported speaker {req.speaker!r}; supported: {cfg.speakers}")
    elif req.speaker:
        raise ValueError(f"speaker applies to custom_voice only (task {req.task!r})")
    if req.task == "voice_clone":
        if req.speaker_embedding is None:
            raise ValueError("voice_clone needs a speaker embedding (reference audio or a supplied x-vector)")
        hidden = cfg.talker.transformer.hidden_size
        if tuple(req.speaker_embedding.shape) != (hidden,):
            raise ValueError(f"speaker embedding must have shape [{hidden}], got {list(req.speaker_embedding.shape)}")
        if req.icl:
            if not req.ref_text:
                raise ValueError("ICL voice cloning (reference codes) needs the reference text")
            g = cfg.talker.num_code_groups
            if req.ref_codes.dim() != 2 or req.ref_codes.shape[1] != g or req.ref_codes.shape[0] == 0:
                raise ValueError(f"reference codes must have shape [frames, {g}], got {list(req.ref_codes.shape)}")
    elif req.icl or req.speaker_embedding is not None:
        raise ValueError("reference audio / speaker embeddings apply to voice_clone only")


class PromptBuilder:
    """Builds talker prompts for one checkpoint (its tokenizer, config and talker embeddings)."""

    def __init__(self, cfg: ModelConfig, talker: Talker, tokenizer):
        self.cfg, self.talker, self.tokenizer = cfg, talker, tokenizer
        self._memo_cache: dict[tuple, torch.Tensor] = {}
        self._voice_memo = LRU(VOICE_MEMO_SIZE)
        self._memo_stamp: tuple = ()
        self._tabulate = False
        self._text_table: torch.Tensor | None = None  # P(every text token id) [V, H], where tabulate_text() asked

    def tabulate_text(self) -> None:
        """Project the whole text vocabulary once (at the next build, and again whenever the weights change), so
        that a prompt's text is one gather from the table: P acts on each token alone, so a row of the table is
        what projecting the token in a burst gives, to the last bits of a product, whose summation order follows
        its row count (on CPU in float32, within 1e-6 of the tiny test model's). A served burst's projection
        was ~45% of its prompts' building on an H100 (two products and a SiLU whose shapes change with every
        burst's token count; docs/performance.md, twenty-fifth pass). Costs vocabulary x hidden in the weights'
        dtype on their device (0.6B: 311 MB, 1.7B: 622 MB in bfloat16)."""
        self._tabulate = True
        self._memo_stamp = ()

    @property
    def text_table_bytes(self) -> int:
        table = self._text_table
        return 0 if table is None else table.numel() * table.element_size()

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """P(ids) [..., H]: rows of the projected vocabulary (tabulate_text), else the projection itself. Every
        text embedding of a prompt comes through here, so the special pieces match the texts' rows."""
        self._check_memo()
        if self._text_table is None:
            return self.talker.embed_text(ids)
        return self._text_table[ids]

    def _embed_texts(self, texts: list[str]) -> list[torch.Tensor]:
        """Each text's token embeddings P(ids) [1, L, H] on the talker's device: one batched tokenizer call, one
        copy and one projection for all of them; each prompt's pieces are slices (views) of these. A served burst
        builds dozens of prompts at once: a tokenizer call and a copy per prompt, then a projection per slice (~5
        kernels each, ~4 slices a prompt, every new slice length a new shape for cuBLAS to plan) were most of its
        building (docs/performance.md, eighth and nineteenth passes: 31 long prompts' first build 20 -> 7 ms)."""
        if not texts:
            return []
        ids = self.tokenizer(texts)["input_ids"]
        embedded = self.embed_text(upload([i for row in ids for i in row], torch.int64, self._device))
        return [row[None] for row in embedded.split([len(row) for row in ids])]

    @property
    def _device(self) -> torch.device:
        return self.talker.codec_head.weight.device

    def _memo(self, key: tuple, compute) -> torch.Tensor:
        """The embedding of a piece every prompt of its kind shares (special tokens, codec tags, a speaker, the
        role prefix), computed once: the same ops on the same ids, so the same values. A served burst builds
        dozens of prompts in one call, and each piece was a few small kernels and a synchronising copy of its
        ids. build_many() checks first that the weights are the memo's (_check_memo)."""
        value = self._memo_cache.get(key)
        if value is None:
            value = self._memo_cache[key] = compute()
        return value

    def _check_memo(self) -> None:
        """Weights changed in place or moved (a new version or storage) clear the memo."""
        emb = (self.talker.model.text_embedding.weight, self.talker.model.codec_embedding.weight,
               *self.talker.text_projection.parameters())
        stamp = weights_stamp(emb)
        if stamp != self._memo_stamp:
            self._memo_cache.clear()
            self._voice_memo.clear()
            self._memo_stamp = stamp
            self._text_table = self._project_vocabulary() if self._tabulate else None

    @torch.no_grad()
    def _project_vocabulary(self, rows_per_pass: int = 8192) -> torch.Tensor:
        """P(0 .. V-1) [V, H], in passes of rows_per_pass tokens (bounds the intermediate's memory)."""
        weight = self.talker.model.text_embedding.weight
        return torch.cat([self.talker.text_projection(weight[i:i + rows_per_pass])
                          for i in range(0, weight.shape[0], rows_per_pass)])

    def _per_voice(self, kind: tuple, host: torch.Tensor, voice_key: str | None, compute):
        """A voice's piece of the prompt (the header around its x-vector, its reference codes' codec track),
        kept per voice and `kind` (LRU of VOICE_MEMO_SIZE): the requests of one voice share it. Per request, each
        was a copy from pageable host memory, which waits for the talker stream's queued work, and a few (header)
        to ~18 (codes) small kernels: a first wave of 127 clones built its prompts in lock step with the GPU.
        The voice is its `voice_key` where the request has one, else the value of `host`: a SHA-1 of its bytes,
        ~60 us a request at 128 streams of clones on an H100 host (py-spy, session 44), where the key is a
        dictionary lookup. A tensor already on the device, and keyless, is used as it comes (hashing it would wait
        for the device)."""
        if voice_key is not None:
            key = (kind, voice_key)
        elif host.device.type != "cpu":
            return compute()
        else:
            key = (kind, host.dtype, tuple(host.shape),
                   hashlib.sha1(host.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
        value = self._voice_memo.get(key)
        if value is None:
            value = compute()
            self._voice_memo.put(key, value)
        return value

    def _codec(self, ids: list[int]) -> torch.Tensor:
        """C(ids) [1, n, H] of control ids (tags, speakers, pad, bos), memoised."""
        return self._memo(("codec", *ids), lambda: self.talker.embed_codec(torch.tensor([ids], device=self._device)))

    def _codec_run(self, codec_id: int, n: int) -> torch.Tensor:
        """C(codec_id) repeated n times, [1, n, H] (a view: adding it equals adding the materialised run)."""
        return self._codec([codec_id]).expand(-1, n, -1)

    def build(self, req: SynthesisRequest) -> Prompt:
        """One request's prompt; raises the ValueError that makes it unservable."""
        prompt = self.build_many([req])[0]
        if isinstance(prompt, ValueError):
            raise prompt
        return prompt

    @torch.no_grad()
    def build_many(self, reqs: list[SynthesisRequest]) -> list[Prompt | ValueError]:
        """The prompts of several requests, tokenized together; each unservable request gets its ValueError."""
        out: list = [None] * len(reqs)
        valid = []
        for i, req in enumerate(reqs):
            try:
                validate_request(self.cfg, req)
                valid.append(i)
            except ValueError as exc:
                out[i] = exc
        self._check_memo()
        texts = [self._texts(reqs[i]) for i in valid]
        embedded = iter(self._embed_texts([t for named in texts for t in named.values()]))
        for i, named in zip(valid, texts):
            out[i] = self._build(reqs[i], **{name: next(embedded) for name in named})
        return out

    def _texts(self, req: SynthesisRequest) -> dict[str, str]:
        """The strings a request's prompt tokenizes, by the name _build takes their ids under."""
        texts = {"text": assistant_text(req.text)}
        if self._instruct(req):
            texts["instruct"] = instruct_text(req.instruct)
        if req.icl:
            texts["ref"] = ref_text(req.ref_text)
        return texts

    def _instruct(self, req: SynthesisRequest) -> str | None:
        """The instruction the prompt carries: none for voice clone, nor for CustomVoice checkpoints that drop it."""
        if req.task == "voice_clone" or (req.task == "custom_voice" and self.cfg.drops_instruct):
            return None
        return req.instruct or None

    def _build(self, req: SynthesisRequest, text: torch.Tensor, instruct=None, ref=None) -> Prompt:
        """One prompt from its texts (_texts), each as _embed_texts gives them: embeddings [1, L, H]."""
        cfg, t, talker = self.cfg, self.cfg.talker, self.talker
        non_streaming = req.non_streaming_text
        if non_streaming is None:
            non_streaming = req.task != "voice_clone"
        parts = []
        if instruct is not None:
            parts.append(instruct)

        lang = (req.language or "auto").lower()
        language_id = None if lang == "auto" else t.codec_language_id[lang]
        speaker = req.speaker.lower() if req.speaker else None
        if speaker and lang in ("chinese", "auto") and t.spk_is_dialect.get(speaker, False):
            language_id = t.codec_language_id[t.spk_is_dialect[speaker]]
        tags = ([t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id] if language_id is None
                else [t.codec_think_id, t.codec_think_bos_id, language_id, t.codec_think_eos_id])

        special_ids = (cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id)
        special = self._memo(("text", *special_ids), lambda: self.embed_text(
            torch.tensor([special_ids], device=self._device)))
        tts_bos, tts_eos, tts_pad = special.chunk(3, dim=1)  # 3 x [1, 1, H]

        def header(speaker_part: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            """The codec track of the tags, speaker, pad, bos ([1, n, H]), and the prompt part it makes."""
            codec = [self._codec(tags)] + ([speaker_part] if speaker_part is not None else [])
            codec = torch.cat(codec + [self._codec([t.codec_pad_id, t.codec_bos_id])], dim=1)
            return codec, torch.cat((tts_pad.expand(-1, codec.shape[1] - 2, -1), tts_bos), dim=1) + codec[:, :-1]

        if req.task == "voice_clone":
            dtype = talker.codec_head.weight.dtype
            codec, head = self._per_voice(("header", *tags), req.speaker_embedding, req.voice_key, lambda: header(
                req.speaker_embedding.to(self._device, dtype).view(1, 1, -1)))
        else:
            spk = t.spk_id[speaker] if req.task == "custom_voice" else None
            codec, head = self._memo(("header", *tags, spk), lambda: header(
                None if spk is None else self._codec([spk])))

        parts.append(text[:, :3])
        parts.append(head)

        if req.icl:
            body, trailing = self._icl_body(req, text, ref[:, 3:-2], tts_pad, tts_eos, non_streaming)
            parts.append(body)
        elif non_streaming:
            body = text[:, 3:-5]
            parts.append(torch.cat((body, tts_eos), dim=1) + self._codec_run(t.codec_pad_id, body.shape[1] + 1))
            parts.append(self._memo(("pad+bos",), lambda: tts_pad + self._codec([t.codec_bos_id])))
            trailing = tts_pad[:, :0]
        else:
            parts.append(text[:, 3:4] + codec[:, -1:])
            trailing = torch.cat((text[:, 4:-5], tts_eos), dim=1)
        return Prompt(prefill=torch.cat(parts, dim=1)[0], trailing=trailing[0], tts_pad=tts_pad[0, 0])

    def _icl_body(self, req, text, ref, tts_pad, tts_eos, non_streaming):
        t, talker = self.cfg.talker, self.talker
        text_embed = torch.cat((ref, text[:, 3:-5], tts_eos), dim=1)
        codec_embed = self._per_voice(("codes",), req.ref_codes, req.voice_key, lambda: torch.cat(
            (self._codec([t.codec_bos_id]), talker.embed_frame(req.ref_codes.to(self._device))[None]), dim=1))
        text_len, codec_len = text_embed.shape[1], codec_embed.shape[1]
        if non_streaming:
            body = torch.cat((text_embed + self._codec_run(t.codec_pad_id, text_len), codec_embed + tts_pad), dim=1)
            return body, tts_pad[:, :0]
        if text_len > codec_len:
            return text_embed[:, :codec_len] + codec_embed, text_embed[:, codec_len:]
        padded = torch.cat((text_embed, tts_pad.expand(-1, codec_len - text_len, -1)), dim=1)
        return padded + codec_embed, tts_pad[:, :0]
