"""The codec transformer's kernels compute the torch reference: the RMSNorm (any row count, widths that are not a
power of two, strided input), the rotary (the projections' transposed views and the concatenated keys) and the
scaled residual addition, each rounding as the reference does, and install() points every norm, layer scale and
attention of a decoder at them; a decoder with them and the vocoder's installed decodes the reference audio in
test_engine_triton_vocoder.py.

CI has no GPU, so the kernels run in Triton's interpreter (TRITON_INTERPRET=1, CPU tensors), in a child process
since Triton reads the variable when the kernels are decorated.
"""

import textwrap

import pytest

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton", reason="triton is a test dependency (scripts/setup.sh --test installs it)")

SCRIPT = textwrap.dedent("""
    import torch
    from serving.engine import triton_codec_transformer as tct
    from serving.model.codec_config import tiny_codec_config
    from serving.model.codec_decoder import (Attention, CodecDecoder, LayerScale, TransformerNorm, rope_reference,
                                             rope_tables, scaled_residual_reference)
    from serving.model.layers import rms_norm

    gen = torch.Generator().manual_seed(0)
    norms = 0
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((2, 5, 64), (1, 1, 48), (3, 0, 64), (4, 100)):
            x = (torch.randn(shape, generator=gen) * 3).to(dtype)
            w = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
            got, want = tct.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5)
            assert got.dtype == want.dtype and got.shape == want.shape
            # bfloat16: the sum's order may move x / rms by one rounding step; float32 to its last bits
            tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got, want, **tol)
            norms += 1
        strided, w = torch.randn(3, 64, 2, generator=gen).to(dtype)[..., 0], torch.rand(64, generator=gen).to(dtype)
        torch.testing.assert_close(tct.rms_norm(strided, w, 1e-5), rms_norm(strided, w, 1e-5), **tol)
        norms += 1
    print("norms", norms)

    ropes = 0
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = rope_tables(7, 16, 10000.0, "cpu", dtype)
        q = torch.randn(2, 5, 4, 16, generator=gen).to(dtype).transpose(1, 2)  # (B, H, T, D) view of (B, T, H, D)
        k = torch.randn(2, 2, 7, 16, generator=gen).to(dtype)
        for x, c, s in ((q, cos[-5:], sin[-5:]), (k, cos, sin)):
            got, want = tct.rope(x, c, s), rope_reference(x, c, s)
            assert got.is_contiguous() and got.dtype == want.dtype
            if dtype == torch.float32:  # the same roundings, elementwise
                assert torch.equal(got, want), (got - want).abs().max()
            else:  # Triton's interpreter truncates to bfloat16 where a GPU rounds to nearest: a step or two apart
                torch.testing.assert_close(got, want, atol=4e-2, rtol=2e-2)
            ropes += 1
    print("ropes", ropes)

    residuals = 0
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((2, 5, 64), (1, 1, 48), (3, 0, 64)):
            x, y = (torch.randn(shape, generator=gen) * 3).to(dtype), torch.randn(shape, generator=gen).to(dtype)
            scale = (torch.rand(shape[-1], generator=gen) * 0.3).to(dtype)
            got, want = tct.scaled_residual(x, scale, y), scaled_residual_reference(x, scale, y)
            assert got.dtype == want.dtype and got.shape == want.shape
            if dtype == torch.float32:  # the same two roundings, elementwise
                assert torch.equal(got, want), (got - want).abs().max()
            else:  # the interpreter truncates where a GPU rounds: a step apart at most
                torch.testing.assert_close(got, want, atol=6e-2, rtol=1e-2)
            residuals += 1
    print("residuals", residuals)

    decoder = CodecDecoder(tiny_codec_config().decoder)
    assert tct.install(decoder)
    assert all(m.kernel is tct.rms_norm for m in decoder.modules() if isinstance(m, TransformerNorm))
    assert all(m.rope is tct.rope for m in decoder.modules() if isinstance(m, Attention))
    assert all(m.kernel is tct.scaled_residual for m in decoder.modules() if isinstance(m, LayerScale))
    print("installed")
""")


def test_codec_transformer_kernels_compute_the_reference_and_decode_the_same_audio():
    out = run_interpreted(SCRIPT)
    assert "norms 10" in out and "ropes 4" in out and "residuals 6" in out and "installed" in out
