"""Token selection on the device, with per-row parameters as tensors (no host sync, CUDA-graph friendly).

Semantics follow the official generate (transformers 4.57 logits processors, in their order):
talker code0: repetition penalty over the code0 history -> eos banned until min_new_tokens -> suppressed ids
(the top 1024 codec ids except eos) -> [sampling only] temperature -> top-k -> top-p. The code predictor
("subtalker") uses temperature/top-k/top-p only. Greedy rows take the argmax after the penalties.
Sampling draws with the exponential-race trick (argmax of p / Exp(1) noise), which is distributed exactly
like multinomial sampling but has no data-dependent control flow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_NEW_TOKENS = 2  # hard-coded by the official generate


@dataclass
class SamplingParams:
    """Per-row sampling parameters, each a tensor of shape [B] on the model's device."""

    do_sample: torch.Tensor  # bool
    temperature: torch.Tensor  # float32, > 0 where do_sample
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor  # float32, 1.0 = off

    @classmethod
    def build(cls, batch: int, device, do_sample: bool, temperature: float, top_k: int, top_p: float) -> "SamplingParams":
        validate(do_sample, temperature, top_k, top_p)
        return cls(
            do_sample=torch.full((batch,), bool(do_sample), device=device),
            temperature=torch.full((batch,), float(temperature), dtype=torch.float32, device=device),
            top_k=torch.full((batch,), int(top_k), dtype=torch.int64, device=device),
            top_p=torch.full((batch,), float(top_p), dtype=torch.float32, device=device),
        )


def validate(do_sample: bool, temperature: float, top_k: int, top_p: float, repetition_penalty: float = 1.0) -> None:
    """Reject values the official generate would reject (or silently misuse), with a clear message."""
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32; seen [B, V] bool (ids already generated); penalty [B]."""
    p = penalty[:, None]
    return torch.where(seen, torch.where(logits < 0, logits * p, logits / p), logits)


def mask_code0(logits: torch.Tensor, num_generated: torch.Tensor, eos_id: int, suppress: torch.Tensor) -> torch.Tensor:
    """Ban eos while fewer than MIN_NEW_TOKENS code0 were sampled (num_generated [B]), then the suppressed ids
    (suppress [V] bool)."""
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    eos_banned = (num_generated < MIN_NEW_TOKENS)[:, None] & (vocab == eos_id)[None, :]
    logits = torch.where(eos_banned, -float("inf"), logits)
    return torch.where(suppress[None, :], -float("inf"), logits)


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling-only transforms, in transformers' order: temperature, top-k, top-p. Removed ids get -inf."""
    vocab = logits.shape[-1]
    temperature = torch.where(params.do_sample, params.temperature, torch.ones_like(params.temperature))
    scores = logits / temperature[:, None]
    # top-k: keep scores >= the k-th largest (ties kept, as transformers' TopKLogitsWarper)
    k = torch.where(params.top_k > 0, params.top_k.clamp(max=vocab), torch.full_like(params.top_k, vocab))
    kth = scores.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    scores = scores.masked_fill(scores < kth, -float("inf"))
    # top-p: drop the low tail whose cumulative probability is <= 1 - top_p; the top token always stays
    sorted_scores, sorted_idx = scores.sort(dim=-1)
    cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1 - params.top_p)[:, None]
    remove_sorted[:, -1] = False
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted) & (params.top_p < 1.0)[:, None]
    return scores.masked_fill(remove, -float("inf"))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           noise: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] float32 (penalties already applied) -> token ids [B] (int64).

    noise [B, V]: Exp(1) draws to use instead of drawing from `generator` (the serving engine passes per-request
    seeded streams, so a request samples the same codes alone or in any batch)."""
    greedy = logits.argmax(-1)
    probs = warp(logits, params).softmax(dim=-1)
    if noise is None:
        noise = torch.empty_like(probs).exponential_(generator=generator)
    sampled = (probs / noise).argmax(-1)
    return torch.where(params.do_sample, sampled, greedy)
