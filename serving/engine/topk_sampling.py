"""Sampling over the top candidates only: the same tokens as serving.model.sampler.sample, without sorting.

The general sampler sorts the whole vocabulary twice per draw (top-k threshold, top-p tail) and draws noise for
every id; the talker stage draws 16 times per frame, so on a GPU those sorts and noise kernels cost more than
the model's layers at small batch. With top-p off and top-k at most CANDIDATES (the defaults: top_k 50, top_p 1)
every token that can be drawn is among the CANDIDATES best scores, so one top-k selection, a softmax over those
scores and the noise at those ids give the same draw (softmax renormalises the same kept scores; the per-request
noise is a hash of the token id, see rng.exponential_noise_at). Rows that ask for more (top_k 0 or > CANDIDATES,
top_p < 1) go through the general sampler: `eligible` tells the caller which path a batch can take.
"""

from __future__ import annotations

import torch

from serving.engine.rng import exponential_noise_at
from serving.model.sampler import SamplingParams

CANDIDATES = 64


def eligible(do_sample: bool, top_k: int, top_p: float) -> bool:
    """Whether a request's parameters fit the candidate sampler (greedy rows always do)."""
    return (not do_sample) or (1 <= top_k <= CANDIDATES and top_p >= 1.0)


def sample_top_candidates(logits: torch.Tensor, params: SamplingParams, seed: torch.Tensor, frame: torch.Tensor,
                          group: int) -> torch.Tensor:
    """logits [B, V] float32 (penalties applied) -> token ids [B]; every sampling row must be `eligible`.

    Draws with the exponential race on the seeded noise of (seed, frame, group, id), like the engine's general
    path. Ties at the k-th score are kept as transformers' top-k keeps them (within the candidates)."""
    greedy = logits.argmax(-1)
    temperature = torch.where(params.do_sample, params.temperature, torch.ones_like(params.temperature))
    scores = logits / temperature[:, None]
    values, ids = scores.topk(min(CANDIDATES, scores.shape[-1]), dim=-1)
    k = params.top_k.clamp(min=1, max=values.shape[-1])
    kth = values.gather(1, (k - 1)[:, None])
    probs = values.masked_fill(values < kth, -float("inf")).softmax(dim=-1)
    noise = exponential_noise_at(seed, frame, group, ids)
    sampled = ids.gather(1, (probs / noise).argmax(-1, keepdim=True))[:, 0]
    return torch.where(params.do_sample, sampled, greedy)
