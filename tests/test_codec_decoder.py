"""Codec decoder behaviour that needs no reference: streaming chunks with left context reproduce the one-shot
decode, padded batch rows decode as if alone, bad codes are refused. (Equality with the official decoder is in
test_codec_parity.py.)"""

import copy
import dataclasses
from unittest import mock

import pytest
import torch

from serving.model.codec_config import released_codec_config, tiny_codec_config
from serving.model.codec_decoder import Codebook, CodecDecoder, chunk_schedule, init_random_

FRAMES = 80
SPF = 64  # samples per frame of the test decoder


@pytest.fixture(scope="module")
def decoder():
    """The tiny decoder with a 12-frame window (receptive field 27 frames instead of 154) and 64 samples per frame
    instead of 1920, so that streaming runs which really drop history stay cheap on CI's 2 cores. Neither
    changes the mechanism under test; the released window and rates are checked against the official decoder in
    test_codec_parity.py."""
    cfg = dataclasses.replace(tiny_codec_config().decoder, sliding_window=12, upsample_rates=(2, 2, 2, 2))
    dec = CodecDecoder(cfg).eval()
    init_random_(dec, torch.Generator().manual_seed(0))
    return dec


@pytest.fixture(scope="module")
def codes_and_one_shot(decoder):
    codes = torch.randint(0, 2048, (2, FRAMES, 16), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        return codes, decoder(codes)


def _stream(decoder, codes, first, chunk, context):
    with torch.inference_mode():
        pieces = [decoder.decode_chunk(codes[:, cs:end], start - cs)
                  for cs, start, end in chunk_schedule(codes.shape[1], first, chunk, context)]
    return torch.cat(pieces, dim=1)


def test_random_weights_make_a_waveform_that_depends_on_the_codes(decoder, codes_and_one_shot):
    codes, wav = codes_and_one_shot
    assert wav.shape == (2, FRAMES * SPF)
    assert 0.05 < float(wav.std()) < 0.8
    assert float((wav.abs() >= 1).float().mean()) < 0.05  # the scaled last conv keeps most samples unclipped
    other = codes.clone()
    other[:, 50, 3] = (other[:, 50, 3] + 1) % 2048
    with torch.inference_mode():
        changed = (decoder(other) - wav).abs().amax(dim=0)
    assert float(changed[: 50 * SPF].max()) == 0.0  # causal: earlier samples untouched
    assert float(changed[50 * SPF: 51 * SPF].max()) > 1e-3  # a change in one codebook is heard


@pytest.mark.parametrize("first, chunk", [(1, 7), (3, 25)])
def test_streaming_with_receptive_field_context_equals_one_shot(decoder, codes_and_one_shot, first, chunk):
    codes, one_shot = codes_and_one_shot
    context = decoder.receptive_field_frames
    assert context < FRAMES - chunk  # later chunks really drop history
    streamed = _stream(decoder, codes, first, chunk, context)
    assert streamed.shape == one_shot.shape
    assert float((streamed - one_shot).abs().max()) < 1e-4


def test_streaming_with_full_history_equals_one_shot(decoder, codes_and_one_shot):
    codes, one_shot = codes_and_one_shot
    streamed = _stream(decoder, codes[:, :60], 2, 25, 60)
    assert float((streamed - one_shot[:, : 60 * SPF]).abs().max()) < 1e-4


def test_receptive_field_of_the_released_decoder():
    dec_cfg = released_codec_config().decoder
    with torch.device("meta"):
        dec = CodecDecoder(dec_cfg)
    assert dec.receptive_field_frames >= dec_cfg.num_hidden_layers * (dec_cfg.sliding_window - 1)
    assert dec.receptive_field_frames == 580


def test_batched_rows_with_different_context_decode_as_alone(decoder, codes_and_one_shot):
    codes, _ = codes_and_one_shot
    # row 0: 20 frames of context + 30 new; row 1: 5 frames of context + 30 new, left-padded by 15 junk frames
    row0 = codes[0, 10:60]
    row1 = torch.cat([torch.randint(0, 2048, (15, 16), generator=torch.Generator().manual_seed(2)), codes[1, 45:80]])
    with torch.inference_mode():
        batched = decoder.decode_chunk(torch.stack([row0, row1]), torch.tensor([20, 5]))
        alone0 = decoder.decode_chunk(row0[None], 20)
        alone1 = decoder.decode_chunk(codes[1:2, 45:80], 5)
    assert batched.shape == (2, 30 * SPF)
    assert float((batched[0] - alone0[0]).abs().max()) < 1e-4
    assert float((batched[1] - alone1[0]).abs().max()) < 1e-4


def test_decode_trims_each_row_to_its_length(decoder, codes_and_one_shot):
    codes, one_shot = codes_and_one_shot
    wavs = decoder.decode(codes[:, :50], lengths_b=[50, 31])
    assert [w.shape[0] for w in wavs] == [50 * SPF, 31 * SPF]
    assert float((wavs[1] - one_shot[1, : 31 * SPF]).abs().max()) < 1e-4


def test_schedule_covers_every_frame_once():
    plan = chunk_schedule(103, first_chunk_frames=4, chunk_frames=25, left_context_frames=72)
    assert plan[0] == (0, 0, 4)
    assert [(s, e) for _, s, e in plan] == [(0, 4), (4, 29), (29, 54), (54, 79), (79, 103)]
    assert plan[-1][0] == 79 - 72
    with pytest.raises(ValueError):
        chunk_schedule(10, first_chunk_frames=0)


@pytest.mark.parametrize("bad, message", [
    (torch.full((1, 3, 16), 2048), r"codes must lie in \[0, 2048\)"),
    (torch.full((1, 3, 16), -1), r"codes must lie in \[0, 2048\)"),
    (torch.zeros((1, 3, 15), dtype=torch.long), r"codes must be \(batch, frames, 16\)"),
    (torch.zeros((1, 3, 16)), "codes must be integers"),
])
def test_bad_codes_are_refused(decoder, bad, message):
    with pytest.raises(ValueError, match=message):
        decoder.decode(bad)


def test_chunk_without_new_frames_is_refused(decoder):
    with pytest.raises(ValueError, match="leaves no new frames"):
        decoder.decode_chunk(torch.zeros((1, 5, 16), dtype=torch.long), 5)


def test_tabulated_quantizer_equals_the_reference_and_follows_the_weights(decoder, codes_and_one_shot):
    """The engine's table (each codebook's vectors through its projection) gives the reference decode's latents
    within float32 rounding, with no per-codebook lookup, and is rebuilt when the weights change in place."""
    codes, _ = codes_and_one_shot
    quantizer = copy.deepcopy(decoder.quantizer)
    with torch.inference_mode():
        reference = quantizer.decode(codes)
        quantizer.tabulate()
        with mock.patch.object(Codebook, "lookup", side_effect=AssertionError("a per-codebook lookup ran")):
            tabulated = quantizer.decode(codes)
    assert tabulated.shape == reference.shape == (2, decoder.config.codebook_dim, FRAMES)
    assert float(reference.abs().max()) > 0.1
    torch.testing.assert_close(tabulated, reference, rtol=1e-5, atol=1e-5)
    table, _ = quantizer.table()
    assert quantizer.table()[0] is table  # kept while the weights stay
    assert quantizer.table_bytes == table.numel() * 4 == 16 * 2048 * decoder.config.codebook_dim * 4
    with torch.no_grad():
        quantizer.rvq_rest.vq.layers[3]._codebook.embedding_sum.mul_(2)
    with torch.inference_mode():
        changed = quantizer.decode(codes)
        quantizer.tabulated = False
        torch.testing.assert_close(changed, quantizer.decode(codes), rtol=1e-5, atol=1e-5)
    assert quantizer.table()[0] is not table and not torch.allclose(changed, tabulated)
    with torch.inference_mode():  # weights copied in inference mode carry no version; their table still builds
        frozen = copy.deepcopy(decoder.quantizer)
        assert frozen.rvq_first.output_proj.weight.is_inference()
        frozen.tabulate()
        torch.testing.assert_close(frozen.decode(codes), reference, rtol=1e-5, atol=1e-5)
