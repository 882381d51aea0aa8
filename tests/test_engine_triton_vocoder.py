"""The fused vocoder kernels compute the torch reference's SnakeBeta and residual addition, and a decoder with
them installed decodes (streamed, and one-shot with padded rows) the reference decoder's audio.

CI has no GPU, so the kernels run in Triton's interpreter (TRITON_INTERPRET=1, CPU tensors), in a child
process since Triton reads the variable when the kernels are decorated.
"""

import textwrap

import pytest
import torch

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton", reason="triton is a test dependency (scripts/setup.sh --test installs it)")

SCRIPT = textwrap.dedent("""
    import copy
    import torch
    from serving.engine import triton_vocoder
    from serving.model.codec_config import tiny_codec_config
    from serving.model.codec_decoder import CodecDecoder, init_random_, snake_reference
    from serving.model.codec_stream import IncrementalCodecDecoder

    gen = torch.Generator().manual_seed(0)
    checked = 0
    for b, c, length in ((2, 3, 5), (1, 8, 1500), (3, 4, 1024), (2, 5, 0)):
        wide = torch.randn(b, c, 2 * length + 3, generator=gen) * 3
        x = wide[..., 3: 3 + length]  # a strided slice, as a transposed convolution's output is
        y = torch.randn(b, c, length, generator=gen)
        alpha, beta, bias = (torch.randn(c, generator=gen) * 0.5 for _ in range(3))
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            xs, ys = x.to(dtype), y.to(dtype)
            for with_bias in (None, bias):
                got = triton_vocoder.snake(xs, alpha, beta, with_bias)
                want = snake_reference(xs.float(), alpha, beta, with_bias).to(dtype)  # the kernel computes in fp32
                assert got.dtype == dtype and got.shape == (b, c, length) and got.is_contiguous()
                torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
                # into the columns behind a causal convolution's history, leaving the history as it was
                full = torch.full((b, c, 6 + length), 7.0, dtype=dtype)
                assert triton_vocoder.snake(xs, alpha, beta, with_bias, out=full[..., 6:]).data_ptr() \
                    == full[..., 6:].data_ptr()
                assert (full[..., :6] == 7).all()
                torch.testing.assert_close(full[..., 6:].float(), want.float(), atol=tol, rtol=tol)
            got = triton_vocoder.residual(xs, ys, bias)
            torch.testing.assert_close(got.float(), (xs.float() + ys.float() + bias[:, None]).to(dtype).float(),
                                       atol=tol, rtol=tol)
            checked += 1
    print("shapes", checked)

    decoder = CodecDecoder(tiny_codec_config().decoder)
    init_random_(decoder, torch.Generator().manual_seed(0))
    decoder.eval()
    fused = copy.deepcopy(decoder)
    assert triton_vocoder.install(fused)
    codes = torch.randint(0, 2048, (2, 11, 16), generator=gen)
    with torch.inference_mode():
        whole = decoder(codes)
    pool = IncrementalCodecDecoder(fused, num_slots=2)
    pieces = [pool.decode([(0, codes[0, :4], True), (1, codes[1, :2], True)]),
              pool.decode([(0, codes[0, 4:], False), (1, codes[1, 2:], False)])]
    for row in range(2):
        streamed = torch.cat([p[row] for p in pieces])
        assert (streamed - whole[row]).abs().max() < 1e-4, row
    print("streams equal")
    left_pad, spf = torch.tensor([0, 3]), decoder.samples_per_frame
    with torch.inference_mode():
        want, got = decoder(codes, left_pad), fused(codes, left_pad)
    assert (got[0] - want[0]).abs().max() < 1e-4 and (got[1, 3 * spf:] - want[1, 3 * spf:]).abs().max() < 1e-4
    print("padded batches equal")
""")


def test_fused_kernels_compute_the_reference_and_decode_the_same_audio():
    out = run_interpreted(SCRIPT)
    assert "shapes 8" in out and "streams equal" in out and "padded batches equal" in out


def test_the_codec_stage_fuses_on_cuda_only():
    from serving.engine.codec_stage import fused_activations
    from serving.model.codec_config import tiny_codec_config
    from serving.model.codec_decoder import CodecDecoder, ResidualUnit, SnakeBeta, snake_reference

    decoder = CodecDecoder(tiny_codec_config().decoder)
    assert not fused_activations(decoder, torch.device("cpu"))
    assert all(m.kernel is snake_reference for m in decoder.modules() if isinstance(m, SnakeBeta))
    assert all(m.add_kernel is None for m in decoder.modules() if isinstance(m, ResidualUnit))
