"""The on-device sampler against transformers' logits processors (the ones the official generate uses)."""

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor, SuppressTokensLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper,
)

from serving.model.sampler import SamplingParams, mask_code0, penalize_repeats, sample, validate, warp


def _params(batch, do_sample=True, temperature=0.9, top_k=50, top_p=1.0):
    return SamplingParams.build(batch, "cpu", do_sample, temperature, top_k, top_p)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.9, 50, 1.0), (0.7, 5, 0.8), (1.3, 0, 0.5), (1.0, 3000, 0.95)])
def test_warp_equals_transformers_warpers(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 3072, generator=gen) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone()) if temperature != 1.0 else logits.clone()
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    got = warp(logits, _params(4, True, temperature, top_k, top_p))
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    torch.testing.assert_close(got[finite], expected[finite], rtol=0, atol=0)


def test_per_row_parameters_are_independent():
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(do_sample=torch.tensor([True, True]), temperature=torch.tensor([1.0, 1.0]),
                            top_k=torch.tensor([1, 0]), top_p=torch.tensor([1.0, 1.0]))
    out = warp(logits, params)
    assert int((~torch.isinf(out[0])).sum()) == 1 and not torch.isinf(out[1]).any()


def test_repetition_penalty_equals_transformers():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    history = torch.tensor([[1, 5, 5, 9], [0, 2, 3, 4], [7, 7, 7, 7]])
    seen = torch.zeros(3, 64, dtype=torch.bool)
    seen[torch.arange(3)[:, None], history] = True
    expected = RepetitionPenaltyLogitsProcessor(1.05)(history, logits.clone())
    got = penalize_repeats(logits, seen, torch.full((3,), 1.05))
    assert torch.equal(got, expected)


def test_code0_masks_eos_until_two_tokens_and_suppresses_control_ids():
    vocab, eos = 3072, 2150
    suppress = torch.zeros(vocab, dtype=torch.bool)
    suppress[2048:] = True
    suppress[eos] = False
    logits = torch.zeros(3, vocab)
    logits[:, eos] = 100.0
    out = mask_code0(logits, torch.tensor([0, 1, 2]), eos, suppress)
    assert torch.isinf(out[0, eos]) and torch.isinf(out[1, eos]) and out[2, eos] == 100.0
    ids = [i for i in range(2048, vocab) if i != eos]
    expected = SuppressTokensLogitsProcessor(ids)(None, logits[2:].clone())
    assert torch.equal(out[2:], expected)
    assert int(out[2].argmax()) == eos


def test_greedy_rows_take_the_argmax_and_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 2.0, 1.0]]).repeat(2, 1)
    params = SamplingParams(do_sample=torch.tensor([False, True]), temperature=torch.tensor([0.5, 1.0]),
                            top_k=torch.tensor([0, 0]), top_p=torch.tensor([1.0, 1.0]))
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits, params, gen) for _ in range(4000)])
    assert (draws[:, 0] == 1).all()
    freq = torch.bincount(draws[:, 1], minlength=3).float() / 4000
    torch.testing.assert_close(freq, logits[1].softmax(-1), atol=0.03, rtol=0)


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(4, 2048, generator=torch.Generator().manual_seed(5))
    params = _params(4)
    a = sample(logits, params, torch.Generator().manual_seed(11))
    b = sample(logits, params, torch.Generator().manual_seed(11))
    assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs,match", [
    (dict(do_sample=True, temperature=0.0, top_k=50, top_p=1.0), "temperature"),
    (dict(do_sample=True, temperature=0.9, top_k=-1, top_p=1.0), "top_k"),
    (dict(do_sample=True, temperature=0.9, top_k=50, top_p=0.0), "top_p"),
    (dict(do_sample=True, temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=0.0), "repetition_penalty"),
])
def test_invalid_parameters_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        validate(**kwargs)
