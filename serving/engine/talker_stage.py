"""Stage 0 on its device: prefill one request into a KV slot, then decode every running slot one frame per step.

All per-request state lives in preallocated tensors indexed by slot (KV cache, positions, last hidden state,
code-0 history for the repetition penalty, trailing text, sampling parameters, seeds), so a decode step over
the first `bucket` slots has fixed shapes and no host synchronisation until its codes are read back: the
same function is captured as one CUDA graph per bucket on a GPU and runs eagerly on a CPU.
"""

from __future__ import annotations

from collections import OrderedDict
import numpy as np
import torch

from serving.engine.request import GenerationRequest
from serving.engine.rng import exponential_noise
from serving.model.layers import attention_mask
from serving.model.sampler import SamplingParams, mask_code0, penalize_repeats, sample


class _CacheView:
    """The first rows (or one row) of a KV cache, with the attributes the model's layers read."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def _rows(params: SamplingParams, n: int) -> SamplingParams:
    return SamplingParams(params.do_sample[:n], params.temperature[:n], params.top_k[:n], params.top_p[:n])


class TalkerRunner:
    def __init__(self, model, prompts, *, num_slots: int, max_model_len: int, buckets: tuple[int, ...],
                 device: torch.device, dtype: torch.dtype, voice_cache_size: int = 64):
        self.model = model  # serving.model.model.Qwen3TTSModel
        self.talker = model.talker
        self.prompts = prompts  # serving.engine.prompts.PromptBuilder
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.buckets = buckets
        self.device = device
        self.dtype = dtype
        cfg = model.cfg.talker
        tc = cfg.transformer
        self.num_groups = cfg.num_code_groups
        self.vocab = tc.vocab_size
        self.cp_vocab = cfg.code_predictor.vocab_size
        self.eos_id = cfg.codec_eos_token_id
        from serving.model.layers import KVCache

        self.kv = KVCache.for_stack(tc, num_slots, max_model_len, dtype, device)
        self.cp_kv = self.talker.code_predictor.new_cache(num_slots, dtype, device)
        s, h = num_slots, tc.hidden_size
        zeros = lambda *shape, dt=torch.float32: torch.zeros(shape, dtype=dt, device=device)  # noqa: E731
        self.hidden = zeros(s, h, dt=dtype)  # post-norm talker hidden of each slot's last position
        self.pos = zeros(s, dt=torch.int64)  # cache position of each slot's next token
        self.active = zeros(s, dt=torch.int64)  # 1 for occupied slots (their positions advance)
        self.generated = zeros(s, dt=torch.int64)  # frames sampled so far
        self.seen = zeros(s, self.vocab, dt=torch.bool)  # code-0 history (repetition penalty)
        self.trailing = zeros(s, max_model_len, h, dt=dtype)
        self.trailing_len = zeros(s, dt=torch.int64)
        self.seed = zeros(s, dt=torch.int64)
        self.rep_penalty = torch.ones(s, dtype=torch.float32, device=device)
        self.talker_params = SamplingParams.build(s, device, True, 0.9, 50, 1.0)
        self.cp_params = SamplingParams.build(s, device, True, 0.9, 50, 1.0)
        self.suppress = torch.zeros(self.vocab, dtype=torch.bool, device=device)
        self.suppress[list(cfg.suppressed_code0_ids)] = True
        self.suppress[self.eos_id] = False
        self.pad_embed = self.prompts.tts_pad_embed().to(device=device, dtype=dtype)  # [H]
        self.lengths = [0] * s  # host mirror of self.pos: how far each slot's keys reach, without a sync
        self._voice_cache: OrderedDict[str, tuple] = OrderedDict()
        self._voice_cache_size = voice_cache_size

    def describe(self) -> dict:
        return {"num_slots": self.num_slots, "buckets": list(self.buckets), "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."), "kv_cache_bytes": self.kv_bytes()}

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv.k, self.kv.v, self.trailing))

    # --- prefill -----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, slot: int, request: GenerationRequest) -> tuple[np.ndarray, int]:
        """Run the request's prompt into `slot`. Returns (reference codes as codec left context, frame limit).
        Raises ValueError when the prompt leaves no room in the slot."""
        prompt, ref_codes = self.prompts.build(request, self._voice_cache_lookup)
        length = prompt.prefill.shape[0]
        room = self.max_model_len - length
        if room < 1:
            raise ValueError(f"the prompt takes {length} positions, more than --max-model-len "
                             f"{self.max_model_len} allows; shorten the input or the reference")
        if prompt.trailing.shape[0] > self.max_model_len:
            raise ValueError("the input text is longer than --max-model-len allows")
        x = prompt.prefill.to(device=self.device, dtype=self.dtype)[None]
        positions = torch.arange(length, device=self.device)[None]
        view = _CacheView(self.kv.k[:, slot:slot + 1], self.kv.v[:, slot:slot + 1])
        out = self.talker.model(x, positions, view, positions, kv_len=length, mask=None)
        self.hidden[slot] = out[0, -1]
        self.pos[slot] = length
        self.lengths[slot] = length
        self.active[slot] = 1
        self.generated[slot] = 0
        self.seen[slot] = False
        t = prompt.trailing.shape[0]
        if t:
            self.trailing[slot, :t] = prompt.trailing.to(device=self.device, dtype=self.dtype)
        self.trailing_len[slot] = t
        sp = request.sampling
        self.seed[slot] = sp.seed
        self.rep_penalty[slot] = sp.repetition_penalty
        for params, (do_sample, temp, top_k, top_p) in (
            (self.talker_params, (sp.do_sample, sp.temperature, sp.top_k, sp.top_p)),
            (self.cp_params, (sp.subtalker_do_sample, sp.subtalker_temperature, sp.subtalker_top_k,
                              sp.subtalker_top_p)),
        ):
            params.do_sample[slot] = do_sample
            params.temperature[slot] = temp
            params.top_k[slot] = top_k
            params.top_p[slot] = top_p
        return ref_codes, min(request.max_new_tokens, room)

    def _voice_cache_lookup(self, key: str | None, compute):
        """Speaker embedding and reference codes of uploaded voices are computed once per voice."""
        if key is None:
            return compute()
        if key in self._voice_cache:
            self._voice_cache.move_to_end(key)
            return self._voice_cache[key]
        value = compute()
        self._voice_cache[key] = value
        if len(self._voice_cache) > self._voice_cache_size:
            self._voice_cache.popitem(last=False)
        return value

    def release(self, slot: int) -> None:
        self.active[slot] = 0
        self.pos[slot] = 0
        self.lengths[slot] = 0

    # --- decode ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode_step(self, bucket: int) -> tuple[np.ndarray, np.ndarray]:
        """One frame for slots [0, bucket): (codes [bucket, Q] int64, ended [bucket] bool: end of speech)."""
        kv_len = max(self.lengths[:bucket]) + 1
        codes, ended = self._step(bucket, kv_len)
        for i in range(bucket):
            if self.lengths[i]:
                self.lengths[i] += 1
        return codes.cpu().numpy(), ended.cpu().numpy()

    def _step(self, b: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed-shape frame: sample code 0, run the code predictor, feed the frame back to the talker."""
        talker = self.talker
        hidden = self.hidden[:b]
        frame = self.generated[:b]
        seed = self.seed[:b]
        logits = talker.codec_logits(hidden)
        logits = penalize_repeats(logits, self.seen[:b], self.rep_penalty[:b])
        logits = mask_code0(logits, frame, self.eos_id, self.suppress)
        code0 = sample(logits, _rows(self.talker_params, b), noise=exponential_noise(seed, frame, 0, self.vocab))
        noise = torch.stack([exponential_noise(seed, frame, g, self.cp_vocab) for g in range(1, self.num_groups)],
                            dim=1)
        cp_view = _CacheView(self.cp_kv.k[:, :b], self.cp_kv.v[:, :b])
        rest = talker.code_predictor(hidden, talker.embed_codec(code0), cp_view, _rows(self.cp_params, b),
                                     noise=noise)
        codes = torch.cat([code0[:, None], rest], dim=1)
        self.seen[:b].scatter_(1, code0[:, None], True)
        self.generated[:b] += 1
        # next input: the frame's summed embeddings plus the next trailing text token (else tts_pad)
        text_idx = (frame).clamp(max=self.trailing.shape[1] - 1)
        rows = torch.arange(b, device=self.device)
        text = torch.where((frame < self.trailing_len[:b])[:, None], self.trailing[rows, text_idx],
                           self.pad_embed[None, :])
        x = (talker.embed_frame(codes) + text)[:, None]
        pos = self.pos[:b, None]
        key_valid = torch.arange(kv_len, device=self.device)[None, :] <= pos
        view = _CacheView(self.kv.k[:, :b], self.kv.v[:, :b])
        out = talker.model(x, pos, view, pos, kv_len=kv_len, mask=attention_mask(pos, key_valid))
        self.hidden[:b] = out[:, 0]
        self.pos[:b] += self.active[:b]
        return codes, code0 == self.eos_id

    def warmup(self) -> None:
        """Run every bucket's step once on empty slots (allocations, kernel selection; graphs on GPU later)."""
        with torch.inference_mode():
            for b in self.buckets:
                self._step(b, 1)
            self.hidden.zero_()
            self.generated.zero_()
            self.seen.zero_()
            self.pos.zero_()
