"""The fused Triton sampler draws the tokens of the general sampler (and so of the torch candidate sampler).

CI has no GPU, so the kernel runs in Triton's interpreter (TRITON_INTERPRET=1: the same kernel source executed
with numpy on CPU tensors). The module is imported fresh in a child process with the variable set, since
Triton reads it when the kernel is decorated.
"""

import textwrap

import pytest

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton", reason="triton is a test dependency (scripts/setup.sh --test installs it)")

SCRIPT = textwrap.dedent("""
    import torch
    from serving.engine import triton_sampling
    from serving.engine.rng import exponential_noise
    from serving.engine.topk_sampling import CANDIDATES, sample_top_candidates
    from serving.model.sampler import SamplingParams, sample

    def general(logits, params, seed, frame, group):
        return sample(logits.float(), params, noise=exponential_noise(seed, frame, group, logits.shape[-1]))

    gen = torch.Generator().manual_seed(0)
    checked = 0
    # 2-byte logits are ranked by their own 16 bits, float32 ones by their scores' 32
    for vocab, dtype, bits in ((2048, torch.bfloat16, 1), (2048, torch.bfloat16, 2), (2048, torch.bfloat16, 4),
                               (2048, torch.float16, 2), (3072, torch.float32, 4), (37, torch.float32, 2)):
        triton_sampling.RADIX_BITS = bits  # digits of the radix select per counting pass
        for _ in range(4):
            batch = 16
            logits = (torch.randn(batch, vocab, generator=gen) * 3).to(dtype)
            logits[0, : vocab // 2] = float("-inf")  # masked ids (the talker's suppressed codes)
            logits[1, 5:9] = logits[1].max()  # a tie at the top: greedy takes the first
            logits[2] = 1.0  # every score tied: all are at the k-th score and all kept, as transformers keeps
            # them (the torch candidate sampler keeps only its CANDIDATES; this row is the one they differ on)
            params = SamplingParams(do_sample=torch.rand(batch, generator=gen) > 0.25,
                                    temperature=torch.rand(batch, generator=gen) + 0.3,
                                    top_k=torch.randint(0, CANDIDATES + 1, (batch,), generator=gen),
                                    top_p=torch.ones(batch))
            params.do_sample[:3] = torch.tensor([True, False, True])
            params.top_k[params.do_sample & (params.top_k == 0)] = 1  # sampling rows must be eligible (top-k on)
            params.top_k[2] = 1
            seed = torch.randint(0, 2**40, (batch,), generator=gen)
            frame = torch.randint(0, 999, (batch,), generator=gen)
            group = int(torch.randint(0, 16, (1,), generator=gen))
            expected = general(logits, params, seed, frame, group)
            got = triton_sampling.sample_top_candidates(logits, params, seed, frame, group)
            assert got.dtype == torch.int64 and got.shape == (batch,)
            assert torch.equal(got, expected), (vocab, dtype, bits, got.tolist(), expected.tolist())
            assert torch.equal(got[3:], sample_top_candidates(logits.float(), params, seed, frame, group)[3:])
            checked += batch
    # a row view with a stride (the code predictor's logits are contiguous, the general case is not)
    wide = torch.randn(4, 2 * 2048, generator=gen)
    params = SamplingParams(torch.ones(4, dtype=torch.bool), torch.full((4,), 0.9), torch.full((4,), 50),
                            torch.ones(4))
    seed, frame = torch.arange(4), torch.zeros(4, dtype=torch.int64)
    assert torch.equal(triton_sampling.sample_top_candidates(wide[:, :2048], params, seed, frame, 1),
                       general(wide[:, :2048], params, seed, frame, 1))
    print("rows", checked)
""")


def test_fused_kernel_draws_the_candidate_samplers_tokens():
    assert "rows 384" in run_interpreted(SCRIPT)


def test_the_talker_stage_draws_with_the_kernel_on_cuda_only():
    import torch

    from serving.engine import triton_sampling
    from serving.engine.talker_stage import _torch_candidates, candidate_sampler

    assert candidate_sampler(torch.device("cuda")) is triton_sampling.sample_top_candidates
    assert candidate_sampler(torch.device("cpu")) is _torch_candidates
