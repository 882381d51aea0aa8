"""Config reading, the weight loader and the checkpoint writer: tiny checkpoints in the official layout,
sharded weights, clear errors for mismatched tensors, dummy weights, dtypes, and a full-size 0.6B dummy."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from serving.model.checkpoint import model_config_dict, write_checkpoint
from serving.model.config import ConfigError, GenerationDefaults, ModelConfig
from serving.model.model import Qwen3TTSModel
from serving.model.tts import Qwen3TTS
from serving.model.weights import WeightsError

OFFICIAL_FILES = ["config.json", "generation_config.json", "merges.txt", "model.safetensors",
                  "preprocessor_config.json", "tokenizer_config.json", "vocab.json"]
SPEECH_TOKENIZER_FILES = ["config.json", "configuration.json", "model.safetensors", "preprocessor_config.json"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny_cv", size="tiny", model_type="custom_voice")


def _copy_without_weights(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    shutil.copy(src / "speech_tokenizer" / "model.safetensors", dst / "speech_tokenizer" / "model.safetensors")
    return dst


def test_writer_produces_the_official_layout(tiny):
    assert sorted(p.name for p in tiny.iterdir() if p.is_file()) == OFFICIAL_FILES
    assert sorted(p.name for p in (tiny / "speech_tokenizer").iterdir()) == SPEECH_TOKENIZER_FILES
    keys = load_file(str(tiny / "model.safetensors")).keys()
    assert "talker.model.text_embedding.weight" in keys and "talker.code_predictor.lm_head.14.weight" in keys
    assert "talker.code_predictor.small_to_mtp_projection.weight" in keys  # tiny: narrower predictor, like 1.7B
    assert not any(k.startswith("speaker_encoder.") for k in keys)  # CustomVoice has none


def test_tokenizer_files_hold_the_special_tokens_at_official_ids(tiny):
    from serving.model.prompt import load_text_tokenizer

    tok = load_text_tokenizer(tiny)
    ids = tok("<|im_start|>assistant\nHello<|im_end|>\n")["input_ids"]
    assert ids[0] == 151644 and ids[-2] == 151645
    assert tok.convert_tokens_to_ids(["<tts_pad>", "<tts_text_bos>", "<tts_text_eod>"]) == [151671, 151672, 151673]
    assert tok.decode(tok("Grüße, 你好!")["input_ids"]) == "Grüße, 你好!"


def _tiktoken_bpe(ranks: dict[bytes, int], piece: bytes) -> list[int]:
    """tiktoken's BPE of one pre-token: merge the adjacent pair whose joined token ranks lowest, until none is."""
    parts = [bytes([b]) for b in piece]
    while len(parts) > 1:
        i = min(range(len(parts) - 1), key=lambda j: ranks.get(parts[j] + parts[j + 1], len(ranks)))
        if parts[i] + parts[i + 1] not in ranks:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [ranks[p] for p in parts]


def test_a_tiktoken_vocabulary_tokenizes_as_tiktoken_does(tmp_path):
    """--text-vocab: tiktoken ranks (as Qwen's qwen.tiktoken) become vocab.json + merges.txt that transformers
    reads into the same tokens as tiktoken's own rule, with the special tokens after them."""
    import base64

    from serving.model.checkpoint import write_tokenizer
    from serving.model.prompt import load_text_tokenizer

    tokens = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld",
                                                  b" world", b"lo", b"el", "你".encode(), "你好".encode()]
    ranks = {t: i for i, t in enumerate(tokens)}
    vocab_file = tmp_path / "tiny.tiktoken"
    vocab_file.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    write_tokenizer(tmp_path, vocab_file)
    tok = load_text_tokenizer(tmp_path)
    for text, words in (("hello world", [b"hello", b" world"]), ("yellow", [b"yellow"]), ("hel lo", [b"hel", b" lo"]),
                        ("wor", [b"wor"]), ("你好你", ["你好你".encode()])):
        assert tok(text)["input_ids"] == [i for w in words for i in _tiktoken_bpe(ranks, w)], text
    assert tok("hello world")["input_ids"] == [ranks[b"hello"], ranks[b" world"]]
    assert tok("<|im_start|>hello")["input_ids"] == [151644, ranks[b"hello"]]
    with pytest.raises(ValueError, match="special tokens"):  # a vocabulary that runs into the special ids
        vocab_file.write_text("".join(f"{base64.b64encode(str(i).encode()).decode()} {i}\n" for i in range(151700)))
        write_tokenizer(tmp_path, vocab_file)


def test_config_traps_are_read_from_the_file():
    cfg = ModelConfig.from_dict(model_config_dict("0.6B", "custom_voice"))
    assert cfg.talker.transformer.head_dim == 128 != 1024 // 16
    assert not cfg.talker.has_mtp_projection and cfg.drops_instruct
    big = ModelConfig.from_dict(model_config_dict("1.7B", "voice_design"))
    assert big.talker.has_mtp_projection and not big.drops_instruct and big.task == "voice_design"
    assert cfg.talker.spk_is_dialect["eric"] == "sichuan_dialect" and cfg.talker.spk_id["vivian"] == 3065
    assert "beijing_dialect" not in cfg.languages and "english" in cfg.languages and cfg.languages[0] == "auto"
    with torch.device("meta"):
        model = Qwen3TTSModel(big)
    assert tuple(model.talker.model.layers[0].self_attn.q_proj.weight.shape) == (16 * 128, 2048)
    assert tuple(model.talker.code_predictor.small_to_mtp_projection.weight.shape) == (1024, 2048)


@pytest.mark.parametrize("mutate,match", [
    (lambda c: c.update(model_type="qwen2"), "model_type"),
    (lambda c: c.update(tts_model_type="music"), "tts_model_type"),
    (lambda c: c["talker_config"].pop("text_vocab_size"), "text_vocab_size"),
    (lambda c: c["talker_config"].update(num_key_value_heads=3), "num_key_value_heads"),
    (lambda c: c["talker_config"]["spk_is_dialect"].update(vivian="klingon_dialect"), "klingon_dialect"),
    (lambda c: c["talker_config"].update(use_sliding_window=True), "sliding-window"),
    (lambda c: c["talker_config"]["rope_scaling"].update(rope_type="yarn"), "yarn"),
])
def test_bad_configs_are_rejected_clearly(mutate, match):
    raw = model_config_dict("tiny", "custom_voice")
    mutate(raw)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_generation_defaults_read_as_the_official_wrapper_does(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 7, "max_new_tokens": 100}))
    d = GenerationDefaults.from_dir(tmp_path)
    assert (d.top_k, d.max_new_tokens, d.repetition_penalty, d.subtalker_temperature) == (7, 100, 1.05, 0.9)


def test_load_tiny_checkpoint_matches_the_file(tiny):
    tts = Qwen3TTS.load(tiny, dtype="float32")
    state = load_file(str(tiny / "model.safetensors"))
    ours = tts.model.state_dict()
    assert set(ours) == set(state)
    for name, tensor in state.items():
        assert torch.equal(ours[name], tensor), name
    assert tts.cfg.task == "custom_voice" and tts.defaults.max_new_tokens == 8192


def test_sharded_checkpoint_loads_identically(tiny, tmp_path):
    sharded = _copy_without_weights(tiny, tmp_path / "sharded")
    state = load_file(str(tiny / "model.safetensors"))
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(sharded / fname))
        weight_map.update({k: fname for k in keys})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    tts = Qwen3TTS.load(sharded, dtype="float32")
    for name, tensor in state.items():
        assert torch.equal(tts.model.state_dict()[name], tensor), name


def _broken(tiny: Path, tmp_path: Path, edit) -> Path:
    broken = _copy_without_weights(tiny, tmp_path / "broken")
    state = load_file(str(tiny / "model.safetensors"))
    edit(state)
    save_file(state, str(broken / "model.safetensors"))
    return broken


@pytest.mark.parametrize("edit,messages", [
    (lambda s: s.pop("talker.codec_head.weight"), ["missing tensors: talker.codec_head.weight"]),
    (lambda s: s.update({"talker.model.extra.weight": torch.zeros(2)}), ["unexpected tensors: talker.model.extra.weight"]),
    (lambda s: s.update({"talker.model.norm.weight": torch.zeros(65)}),
     ["talker.model.norm.weight has shape [65], the config implies [64]"]),
    (lambda s: (s.pop("talker.model.layers.1.mlp.up_proj.weight"), s.update({"speaker_encoder.fc.weight": torch.zeros(1)})),
     ["missing tensors: talker.model.layers.1.mlp.up_proj.weight", "unexpected tensors: speaker_encoder.fc.weight"]),
])
def test_mismatched_tensors_are_named(tiny, tmp_path, edit, messages):
    broken = _broken(tiny, tmp_path, edit)
    with pytest.raises(WeightsError) as err:
        Qwen3TTS.load(broken, dtype="float32")
    for message in messages:
        assert message in str(err.value)


def test_missing_weights_and_bad_arguments(tiny, tmp_path):
    empty = _copy_without_weights(tiny, tmp_path / "noweights")
    with pytest.raises(WeightsError, match="no model.safetensors"):
        Qwen3TTS.load(empty)
    with pytest.raises(FileNotFoundError):
        Qwen3TTS.load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="dtype"):
        Qwen3TTS.load(tiny, dtype="int8")
    with pytest.raises(ValueError, match="load_format"):
        Qwen3TTS.load(tiny, load_format="gguf")


def test_dummy_weights_and_half_precision(tiny):
    dummy = Qwen3TTS.load(tiny, load_format="dummy", dtype="bfloat16")
    assert dummy.model.talker.codec_head.weight.dtype == torch.bfloat16
    assert torch.isfinite(dummy.model.talker.codec_head.weight.float()).all()
    real = load_file(str(tiny / "model.safetensors"))["talker.codec_head.weight"]
    assert not torch.equal(dummy.model.talker.codec_head.weight.float(), real)
    out = dummy.generate("Hello there.", speaker="aiden", max_new_tokens=4, seed=3)
    assert out.codes.shape == (3, 16) and out.audio.shape == (3 * 1920,)
    half = Qwen3TTS.load(tiny, dtype="float16")
    assert half.model.talker.model.text_embedding.weight.dtype == torch.float16


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_full_size_06b_dummy_checkpoint_loads_and_generates_a_frame(tmp_path):
    path = write_checkpoint(tmp_path / "full_06b", size="0.6B", model_type="custom_voice", seed=0)
    assert (path / "model.safetensors").stat().st_size > 1.5e9  # ~0.9B bf16 parameters
    tts = Qwen3TTS.load(path, dtype="bfloat16")
    t = tts.model.talker
    assert t.model.layers[0].self_attn.q_proj.weight.shape == (2048, 1024)  # head_dim 128 > hidden / heads
    assert len(t.model.layers) == 28 and t.code_predictor.small_to_mtp_projection is None
    assert tts.speech_tokenizer.decoder.samples_per_frame == 1920
    frames = list(tts.iter_frames("Hello.", speaker="vivian", language="english", max_new_tokens=2, seed=0))
    assert len(frames) == 1 and frames[0].shape == (16,)
    assert 0 <= int(frames[0][0]) < 2048 and int(frames[0][1:].max()) < 2048
    audio = tts.decode(torch.stack(frames))
    assert audio.shape == (1920,) and abs(audio).max() <= 1.0
