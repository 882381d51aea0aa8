"""The per-frame decode pieces shared by the offline API and the serving engine.

prefill(): run the talker over left-padded prompts and sample the first code0.
decode_frame(): one audio frame for every row: the code predictor turns each row's pending code0 into 16
codes, their embeddings plus the row's text input for this step become the talker's next input, and one
talker step samples the next code0 (with repetition penalty, eos ban for the first frames and suppression).
All per-row state lives in tensors (DecodeState), so a step never syncs with the host; with fixed batch
slots and `mask_always=True` its shapes depend only on the step's KV length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.model.layers import KVCache, attention_mask
from serving.model.sampler import SamplingParams, mask_code0, penalize_repeats, sample
from serving.model.talker import Talker


@dataclass
class TalkerSampling:
    """Per-row talker (code0) sampling parameters, plus the subtalker (code predictor) ones."""

    code0: SamplingParams
    repetition_penalty: torch.Tensor  # [B] float32
    subtalker: SamplingParams


@dataclass
class DecodeState:
    cache: KVCache  # talker keys/values [layers, B, KV, S, D]
    cp_cache: KVCache  # code predictor keys/values for the 16 positions of one frame
    key_valid: torch.Tensor  # [B, S] bool: False on left padding
    next_position: torch.Tensor  # [B] long: RoPE position of each row's next talker input
    length: int  # cache positions written so far (the same for every row)
    padded: bool  # any left padding: attention needs an explicit mask
    hidden: torch.Tensor  # [B, H] post-norm talker hidden state of the last position
    code0: torch.Tensor  # [B] pending code0 (sampled, not yet expanded into a frame)
    seen: torch.Tensor  # [B, V] bool: code0 ids sampled so far (repetition penalty)
    num_generated: torch.Tensor  # [B] long: code0 sampled so far
    finished: torch.Tensor  # [B] bool: row has sampled eos


def _sample_code0(talker: Talker, state: DecodeState, sampling: TalkerSampling, suppress: torch.Tensor,
                  generator) -> None:
    cfg = talker.cfg
    logits = talker.codec_logits(state.hidden)
    logits = penalize_repeats(logits, state.seen, sampling.repetition_penalty)
    logits = mask_code0(logits, state.num_generated, cfg.codec_eos_token_id, suppress)
    code0 = sample(logits, sampling.code0, generator)
    code0 = torch.where(state.finished, torch.full_like(code0, cfg.codec_eos_token_id), code0)
    state.code0 = code0
    state.seen[torch.arange(code0.shape[0], device=code0.device), code0] = True
    state.num_generated += 1
    state.finished |= code0 == cfg.codec_eos_token_id


def suppress_mask(talker: Talker, device) -> torch.Tensor:
    cfg = talker.cfg
    mask = torch.zeros(cfg.transformer.vocab_size, dtype=torch.bool, device=device)
    ids = cfg.suppressed_code0_ids
    mask[ids.start:ids.stop] = True
    mask[cfg.codec_eos_token_id] = False
    return mask


@torch.no_grad()
def prefill(talker: Talker, prefills: list[torch.Tensor], max_new_tokens: int, sampling: TalkerSampling,
            generator: torch.Generator | None = None) -> DecodeState:
    """prefills: one [L_b, H] prompt embedding per row. Allocates caches for max_new_tokens more positions."""
    device, dtype = prefills[0].device, prefills[0].dtype
    batch, max_len = len(prefills), max(p.shape[0] for p in prefills)
    lengths = torch.tensor([p.shape[0] for p in prefills], device=device)
    pad = max_len - lengths
    x = torch.zeros(batch, max_len, prefills[0].shape[1], dtype=dtype, device=device)
    for b, p in enumerate(prefills):
        x[b, max_len - p.shape[0]:] = p
    cfg = talker.cfg
    cache = KVCache.for_stack(cfg.transformer, batch, max_len + max_new_tokens, dtype, device)
    key_valid = torch.arange(cache.max_len, device=device)[None, :] >= pad[:, None]
    positions = (torch.arange(max_len, device=device)[None, :] - pad[:, None]).clamp(min=0)
    write_pos = torch.arange(max_len, device=device).expand(batch, max_len)
    padded = bool((pad > 0).any())
    mask = attention_mask(write_pos, key_valid[:, :max_len]) if padded else None
    hidden = talker.model(x, positions, cache, write_pos, kv_len=max_len, mask=mask)
    vocab = cfg.transformer.vocab_size
    state = DecodeState(
        cache=cache, cp_cache=talker.code_predictor.new_cache(batch, dtype, device), key_valid=key_valid,
        next_position=lengths.clone(), length=max_len, padded=padded, hidden=hidden[:, -1],
        code0=torch.zeros(batch, dtype=torch.int64, device=device),
        seen=torch.zeros(batch, vocab, dtype=torch.bool, device=device),
        num_generated=torch.zeros(batch, dtype=torch.int64, device=device),
        finished=torch.zeros(batch, dtype=torch.bool, device=device),
    )
    _sample_code0(talker, state, sampling, suppress_mask(talker, device), generator)
    return state


@torch.no_grad()
def decode_frame(talker: Talker, state: DecodeState, text_embeds: torch.Tensor, sampling: TalkerSampling,
                 generator: torch.Generator | None = None, sample_next: bool = True) -> torch.Tensor:
    """Expand each row's pending code0 into a frame [B, G] and (sample_next) sample the next code0.

    text_embeds [B, H]: each row's text-track input for this step (trailing text or P(tts_pad)).
    Rows already finished produce frames that the caller discards."""
    code0 = state.code0
    code0_embed = talker.embed_codec(code0)
    rest = talker.code_predictor(state.hidden, code0_embed, state.cp_cache, sampling.subtalker, generator)
    codes = torch.cat((code0[:, None], rest), dim=1)
    if not sample_next:
        return codes
    if state.length >= state.cache.max_len:
        raise RuntimeError("talker KV cache is full: allocate it for more new tokens")
    x = (talker.embed_frame(codes) + text_embeds)[:, None]
    batch = codes.shape[0]
    write_pos = torch.full((batch, 1), state.length, dtype=torch.int64, device=codes.device)
    kv_len = state.length + 1
    mask = attention_mask(write_pos, state.key_valid[:, :kv_len]) if state.padded else None
    hidden = talker.model(x, state.next_position[:, None], state.cache, write_pos, kv_len=kv_len, mask=mask)
    state.hidden = hidden[:, -1]
    state.length += 1
    state.next_position += 1
    _sample_code0(talker, state, sampling, suppress_mask(talker, codes.device), generator)
    return codes
