"""The vocoder's kernels compute the torch reference: SnakeBeta in any layout, the window products of causal and
transposed convolutions with their epilogues (and both leaving the tiles past each row's wanted frames alone), and
a decoder with them and the transformer's kernels
(test_engine_triton_codec_transformer.py) installed decodes (streamed, and one-shot with padded rows) the
reference decoder's audio.

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
    import torch.nn.functional as F
    from serving.engine import triton_codec_transformer, triton_conv, triton_vocoder
    from serving.model.codec_config import tiny_codec_config
    from serving.model.codec_decoder import (CausalConv1d, CausalConvTranspose1d, CodecDecoder, init_random_,
                                             snake_reference)
    from serving.model.codec_stream import IncrementalCodecDecoder

    gen = torch.Generator().manual_seed(0)
    checked = 0
    for b, c, length in ((2, 3, 5), (1, 8, 1500), (3, 4, 1024), (2, 5, 0), (2, 96, 70)):
        wide = torch.randn(b, c, 2 * length + 3, generator=gen) * 3
        sliced = wide[..., 3: 3 + length]  # a strided slice, as a transposed convolution's output is
        last = (torch.randn(b, length, c, generator=gen) * 3).transpose(1, 2)  # channels innermost
        alpha, beta = (torch.randn(c, generator=gen) * 0.5 for _ in range(2))
        for x in (sliced, last):
            for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
                xs = x.to(dtype)
                got = triton_vocoder.snake(xs, alpha, beta)
                want = snake_reference(xs.float(), alpha, beta).to(dtype)  # the kernel computes in fp32
                assert got.dtype == dtype and got.shape == (b, c, length)
                assert got.is_contiguous() if x is sliced else got.stride() == xs.stride()
                torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
                # into the columns behind a causal convolution's history, leaving the history as it was
                full = torch.full((b, c, 6 + length), 7.0, dtype=dtype)
                assert triton_vocoder.snake(xs, alpha, beta, out=full[..., 6:]).data_ptr() \
                    == full[..., 6:].data_ptr()
                assert (full[..., :6] == 7).all()
                torch.testing.assert_close(full[..., 6:].float(), want.float(), atol=tol, rtol=tol)
                checked += 1
    print("shapes", checked)

    # window products: causal convs (dilated, k1, one output channel) and transposed convs, any input strides,
    # with SnakeBeta and a residual in the epilogue
    products = 0
    for b, c, c_out, k, d, length in ((2, 8, 5, 7, 3, 13), (1, 40, 16, 7, 1, 70), (2, 6, 1, 7, 1, 9),
                                      (3, 16, 24, 1, 1, 5), (1, 96, 96, 7, 9, 140)):
        w, bias = torch.randn(c_out, c, k, generator=gen) / (c * k) ** 0.5, torch.randn(c_out, generator=gen)
        full = torch.randn(b, c, length + (k - 1) * d, generator=gen)
        alpha, beta = (torch.randn(c_out, generator=gen) * 0.3 for _ in range(2))
        res = torch.randn(b, c_out, length, generator=gen)
        plain = F.conv1d(full, w, bias, dilation=d)
        for x_blc in (full.transpose(1, 2), full.transpose(1, 2).contiguous()):
            got = triton_conv.window_product(x_blc, triton_conv.conv_matrix(w), bias, taps=k, dilation=d)
            torch.testing.assert_close(got.transpose(1, 2), plain, atol=1e-4, rtol=1e-4)
            got = triton_conv.window_product(x_blc, triton_conv.conv_matrix(w), bias, taps=k, dilation=d,
                                             snake=(alpha, beta), residual=res.transpose(1, 2))
            torch.testing.assert_close(got.transpose(1, 2), snake_reference(plain, alpha, beta) + res,
                                       atol=1e-4, rtol=1e-4)
            products += 1
    for b, c, c_out, stride, m, length in ((2, 8, 6, 5, 2, 7), (1, 16, 8, 2, 1, 9), (2, 12, 4, 3, 2, 1)):
        w, bias = torch.randn(c, c_out, m * stride, generator=gen), torch.randn(c_out, generator=gen)
        full = torch.randn(b, c, length + m - 1, generator=gen)
        want = F.conv_transpose1d(full, w, bias, stride=stride)[..., (m - 1) * stride: (m - 1 + length) * stride]
        got = triton_conv.window_product(full.transpose(1, 2), triton_conv.transposed_matrix(w, stride), bias,
                                         taps=m, phases=stride)
        torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-4, rtol=1e-4)
        products += 1
    print("products", products)

    # with `valid`, tiles wholly past a row's wanted frames are left as they were: row 0 wants 3 frames of 50 rows
    # (tiles of 128 rows here: the first two computed, the third not), row 1 none (a batch's padding row)
    frames = torch.tensor([3, 0])
    w, bias = torch.randn(6, 8, 7, generator=gen) / 56 ** 0.5, torch.randn(6, generator=gen)
    full = torch.randn(2, 8, 384 + 6, generator=gen)
    alpha, beta = (torch.randn(6, generator=gen) * 0.3 for _ in range(2))
    want = snake_reference(F.conv1d(full, w, bias), alpha, beta)
    out = torch.full((2, 384, 6), 7.0)
    assert triton_conv.pick_blocks(2 * 384, 6, 8, True)[0] == 128
    triton_conv.window_product(full.transpose(1, 2), triton_conv.conv_matrix(w), bias, taps=7, snake=(alpha, beta),
                               out=out, valid=(frames, 50))
    torch.testing.assert_close(out[0, :150].T, want[0, :, :150], atol=1e-4, rtol=1e-4)
    assert (out[0, 256:] == 7).all() and (out[1] == 7).all()
    x = torch.randn(2, 600, 128, generator=gen).transpose(1, 2)  # channels innermost: 32-sample tiles
    alpha, beta = (torch.randn(128, generator=gen) * 0.3 for _ in range(2))
    out = torch.full_like(x, 7.0)
    block_l = triton_vocoder._tiles(x)[1]
    triton_vocoder.snake(x, alpha, beta, out=out, valid=(frames, 50))
    torch.testing.assert_close(out[0, :, :150], snake_reference(x, alpha, beta)[0, :, :150])
    assert block_l < 150 and (out[0, :, -(-150 // block_l) * block_l:] == 7).all() and (out[1] == 7).all()
    print("padding left alone")

    decoder = CodecDecoder(tiny_codec_config().decoder)
    init_random_(decoder, torch.Generator().manual_seed(0))
    decoder.eval()
    fused = copy.deepcopy(decoder)
    assert triton_vocoder.install(fused) and triton_codec_transformer.install(fused)  # the codec's kernels, all
    convs = [m for m in fused.modules() if isinstance(m, (CausalConv1d, CausalConvTranspose1d))]
    assert all((m.product is None) == (m.conv.groups > 1) for m in convs)
    assert sum(m.product is not None for m in convs) == 2 + 1 + 4 * (1 + 6) + 2  # pre_conv .. last conv
    codes = torch.randint(0, 2048, (2, 6, 16), generator=gen)
    with torch.inference_mode():
        whole = decoder(codes)
    pool = IncrementalCodecDecoder(fused, num_slots=2)
    # rows of different lengths: the vocoder's kernels skip each row's padding (Frames.valid), its state unharmed
    pieces = [pool.decode([(0, codes[0, :4], True), (1, codes[1, :1], True)]),
              pool.decode([(0, codes[0, 4:], False), (1, codes[1, 1:], False)])]
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
    assert "shapes 20" in out and "products 13" in out and "padding left alone" in out and "streams equal" in out
    assert "padded batches equal" in out


def test_the_codec_stage_installs_the_kernels_on_cuda_only():
    from serving.engine.codec_stage import codec_kernels
    from serving.model.codec_config import tiny_codec_config
    from serving.model.codec_decoder import (Attention, CausalConv1d, CausalConvTranspose1d, CodecDecoder, SnakeBeta,
                                             TransformerNorm, rope_reference, snake_reference)
    from serving.model.layers import rms_norm

    decoder = CodecDecoder(tiny_codec_config().decoder)
    assert not codec_kernels(decoder, torch.device("cpu"))
    assert all(m.kernel is snake_reference for m in decoder.modules() if isinstance(m, SnakeBeta))
    assert all(m.kernel is rms_norm for m in decoder.modules() if isinstance(m, TransformerNorm))
    assert all(m.rope is rope_reference for m in decoder.modules() if isinstance(m, Attention))
    assert all(m.product is None for m in decoder.modules()
               if isinstance(m, (CausalConv1d, CausalConvTranspose1d)))
