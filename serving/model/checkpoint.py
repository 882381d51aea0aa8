"""Writer of random-weight checkpoints in exactly the official Qwen3-TTS-12Hz directory layout.

    python -m serving.model.checkpoint OUT_DIR --size tiny|0.6B|1.7B --type custom_voice|voice_design|base

Tiny checkpoints (a few tens of MB, fp32) drive the tests and the parity runs against the official package,
which loads the very same directory. Full-size ones (bf16, like the released files) are for performance work
and loader tests without downloading weights. Layout:
config.json, generation_config.json, model.safetensors, vocab.json, merges.txt, tokenizer_config.json,
preprocessor_config.json, speech_tokenizer/{config.json, configuration.json, model.safetensors,
preprocessor_config.json}.

The text tokenizer is in the Qwen2 file format with the Qwen special tokens at their official ids: by default a
small byte-level BPE trained here on a few sentences (the tests' tokenizer: both implementations read these files
through transformers, so they tokenize identically), or with `--text-vocab qwen.tiktoken` the real Qwen
vocabulary, converted from its tiktoken ranks (PyPI's dashscope package ships them as
dashscope/resources/qwen.tiktoken). Benchmarks want the real one: the small BPE splits English into ~0.67 tokens
per character, the real one into ~0.2, so its prompts are ~3x as long as a real checkpoint's.
"""

from __future__ import annotations

import argparse
import base64
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from serving.model.codec_config import released_codec_config, tiny_codec_config
from serving.model.config import ModelConfig
from serving.model.model import Qwen3TTSModel
from serving.model.speaker_encoder import SpeakerEncoderConfig, tiny_speaker_encoder_config
from serving.model.speech_tokenizer import write_random_speech_tokenizer
from serving.model.weights import init_dummy_, materialize

SIZES = ("tiny", "0.6B", "1.7B")
MODEL_TYPES = ("custom_voice", "voice_design", "base")

LANGUAGE_IDS = {"chinese": 2055, "english": 2050, "german": 2053, "italian": 2070, "portuguese": 2071,
                "spanish": 2054, "japanese": 2058, "korean": 2064, "french": 2061, "russian": 2069,
                "beijing_dialect": 2074, "sichuan_dialect": 2062}
SPEAKER_IDS = {"vivian": 3065, "serena": 3066, "uncle_fu": 3010, "dylan": 2878, "eric": 2875, "ryan": 3061,
               "aiden": 2861, "ono_anna": 2873, "sohee": 2864}
SPEAKER_DIALECTS = {"dylan": "beijing_dialect", "eric": "sichuan_dialect"}

# Qwen2/Qwen3 special tokens (151643..151668) and the TTS text-track tokens, at their official ids.
SPECIAL_TOKENS = {
    151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151646: "<|object_ref_start|>",
    151647: "<|object_ref_end|>", 151648: "<|box_start|>", 151649: "<|box_end|>", 151650: "<|quad_start|>",
    151651: "<|quad_end|>", 151652: "<|vision_start|>", 151653: "<|vision_end|>", 151654: "<|vision_pad|>",
    151655: "<|image_pad|>", 151656: "<|video_pad|>", 151657: "<tool_call>", 151658: "</tool_call>",
    151659: "<|fim_prefix|>", 151660: "<|fim_middle|>", 151661: "<|fim_suffix|>", 151662: "<|fim_pad|>",
    151663: "<|repo_name|>", 151664: "<|file_sep|>", 151665: "<tool_response>", 151666: "</tool_response>",
    151667: "<think>", 151668: "</think>", 151669: "<|audio_start|>", 151670: "<|audio_end|>",
    151671: "<tts_pad>", 151672: "<tts_text_bos>", 151673: "<tts_text_eod>", 151674: "<tts_text_bos_single>",
}
TEXT_VOCAB_SIZE = 151936
BPE_CORPUS = [
    "Hello, how are you today? I am fine, thank you very much.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Speech synthesis turns written text into natural sounding audio.",
    "Please speak slowly and clearly, with a warm and friendly voice.",
    "A deep, calm male voice reading the evening news in a studio.",
    "今天天气很好，我们一起去公园散步吧。", "你好，欢迎使用语音合成服务。",
    "Guten Tag! Wie geht es Ihnen? Bonjour, comment allez-vous? Hola, ¿qué tal?",
    "こんにちは、お元気ですか。안녕하세요, 반갑습니다. Привет, как дела?",
    "Numbers 0123456789 and punctuation: ; ' \" ( ) [ ] { } - _ + = / \\ | @ # $ % ^ & * ~ `",
]


def _transformer_dict(hidden, inter, layers, heads, kv_heads, head_dim, max_pos, vocab) -> dict:
    return {"attention_bias": False, "attention_dropout": 0.0, "head_dim": head_dim, "hidden_act": "silu",
            "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": inter,
            "max_position_embeddings": max_pos, "num_attention_heads": heads, "num_hidden_layers": layers,
            "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
            "use_cache": True, "use_sliding_window": False, "sliding_window": None, "vocab_size": vocab}


def model_config_dict(size: str, model_type: str) -> dict:
    """config.json content for a checkpoint of this size and type (official key layout)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model type must be one of {MODEL_TYPES}, got {model_type!r}")
    if size == "tiny":
        # head_dim != hidden/heads and a narrower code predictor: the tiny model exercises both config traps.
        talker = _transformer_dict(64, 128, 2, 4, 2, 32, 32768, 3072)
        predictor = _transformer_dict(32, 64, 2, 4, 2, 16, 65536, 2048)
        text_hidden, spk = 32, tiny_speaker_encoder_config(64)
    elif size == "0.6B":
        talker = _transformer_dict(1024, 3072, 28, 16, 8, 128, 32768, 3072)
        predictor = _transformer_dict(1024, 3072, 5, 16, 8, 128, 65536, 2048)
        text_hidden, spk = 2048, SpeakerEncoderConfig(enc_dim=1024)
    else:
        talker = _transformer_dict(2048, 6144, 28, 16, 8, 128, 32768, 3072)
        predictor = _transformer_dict(1024, 3072, 5, 16, 8, 128, 65536, 2048)
        text_hidden, spk = 2048, SpeakerEncoderConfig(enc_dim=2048)
    predictor["num_code_groups"] = 16
    talker.update({
        "code_predictor_config": predictor, "num_code_groups": 16, "text_hidden_size": text_hidden,
        "text_vocab_size": TEXT_VOCAB_SIZE, "position_id_per_seconds": 13,
        "rope_scaling": {"interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_pad_id": 2148, "codec_think_id": 2154,
        "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
        "codec_language_id": dict(LANGUAGE_IDS),
        "spk_id": dict(SPEAKER_IDS) if model_type == "custom_voice" else {},
        "spk_is_dialect": ({k: SPEAKER_DIALECTS.get(k, False) for k in SPEAKER_IDS}
                           if model_type == "custom_voice" else {}),
    })
    return {
        "architectures": ["Qwen3TTSForConditionalGeneration"], "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz", "tts_model_size": "0b6" if size == "0.6B" else "1b7",
        "tts_model_type": model_type, "assistant_token_id": 77091, "im_start_token_id": 151644,
        "im_end_token_id": 151645, "tts_pad_token_id": 151671, "tts_bos_token_id": 151672,
        "tts_eos_token_id": 151673, "torch_dtype": "float32" if size == "tiny" else "bfloat16",
        "talker_config": talker, "speaker_encoder_config": spk.to_dict(),
    }


GENERATION_CONFIG = {"do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9, "repetition_penalty": 1.05,
                     "subtalker_dosample": True, "subtalker_top_k": 50, "subtalker_top_p": 1.0,
                     "subtalker_temperature": 0.9, "max_new_tokens": 8192}


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def trained_bpe(vocab_size: int = 1024) -> tuple[dict[str, int], list[str]]:
    """A small byte-level BPE trained on BPE_CORPUS: its vocab.json and merges.txt entries."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(BPE_CORPUS, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = dict(sorted(model["vocab"].items(), key=lambda kv: kv[1]))
    return vocab, [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]


def tiktoken_bpe(ranks_file: Path) -> tuple[dict[str, int], list[str]]:
    """vocab.json and merges.txt entries of a byte-level BPE given as tiktoken ranks (one "base64(token) rank" per
    line, as qwen.tiktoken). tiktoken merges the adjacent pair whose joined token ranks lowest; the same BPE as
    merges lists every split of each token into two ranked tokens, ordered by the joined token's rank, then by the
    pieces' (the conversion transformers makes of tiktoken files)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ranks = {}
    for line in ranks_file.read_text(encoding="ascii").splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    chars = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    merges = sorted((rank, ranks[token[:i]], ranks[token[i:]], token[:i], token[i:])
                    for token, rank in ranks.items() for i in range(1, len(token))
                    if token[:i] in ranks and token[i:] in ranks)
    vocab = {text(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    return vocab, [f"{text(left)} {text(right)}" for *_, left, right in merges]


def write_tokenizer(out: Path, text_vocab: Path | None = None) -> None:
    """vocab.json + merges.txt + tokenizer_config.json in the Qwen2 format: the BPE of `text_vocab` (tiktoken
    ranks, see tiktoken_bpe) or the small trained one."""
    vocab, merges = tiktoken_bpe(text_vocab) if text_vocab is not None else trained_bpe()
    if max(vocab.values()) >= min(SPECIAL_TOKENS):
        raise ValueError(f"{text_vocab}: token ids up to {max(vocab.values())} run into the special tokens' "
                         f"({min(SPECIAL_TOKENS)}+)")
    # Dense ids up to the special tokens, as in the real vocabulary (tokenizers warns about holes); the
    # fillers are never produced, since BPE only emits tokens reachable through merges.
    used = set(vocab.values())
    vocab.update({f"<|reserved_{i}|>": i for i in range(min(SPECIAL_TOKENS)) if i not in used})
    vocab.update({content: idx for idx, content in SPECIAL_TOKENS.items()})
    _write_json(out / "vocab.json", vocab)
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    added = {str(idx): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True} for idx, content in SPECIAL_TOKENS.items()}
    _write_json(out / "tokenizer_config.json", {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    })


@torch.no_grad()
def write_checkpoint(out: str | Path, size: str = "tiny", model_type: str = "custom_voice", seed: int = 0,
                     text_vocab: Path | None = None) -> Path:
    """Write a random checkpoint; returns its directory. Tiny: fp32. 0.6B/1.7B: bf16 (as released). text_vocab:
    tiktoken ranks of the text tokenizer (see write_tokenizer)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = model_config_dict(size, model_type)
    cfg = ModelConfig.from_dict(raw)
    dtype = torch.float32 if size == "tiny" else torch.bfloat16
    with torch.device("meta"):
        model = Qwen3TTSModel(cfg)
    model = materialize(model, dtype, "cpu")
    init_talker_(model, seed)
    if model.speaker_encoder is not None:
        from serving.model.speaker_encoder import init_random_ as init_speaker_encoder_

        init_speaker_encoder_(model.speaker_encoder, torch.Generator().manual_seed(seed + 1))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    del state, model
    _write_json(out / "config.json", raw)
    _write_json(out / "generation_config.json", GENERATION_CONFIG)
    write_tokenizer(out, text_vocab)
    _write_json(out / "preprocessor_config.json", {"processor_class": "Qwen3TTSProcessor"})
    codec = tiny_codec_config() if size == "tiny" else released_codec_config()
    write_random_speech_tokenizer(out / "speech_tokenizer", codec, seed + 2)
    _write_json(out / "speech_tokenizer" / "configuration.json",
                {"framework": "pytorch", "task": "feature-extraction", "allow_remote": True})
    return out


def init_talker_(model: Qwen3TTSModel, seed: int) -> None:
    """Random talker weights with O(1) activations (weights.init_dummy_), and codec/text embeddings scaled so
    that no single input dominates the summed embeddings."""
    init_dummy_(model.talker, seed)
    model.talker.model.codec_embedding.weight.mul_(0.5)
    for emb in model.talker.code_predictor.model.codec_embedding:
        emb.weight.mul_(0.5)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="directory to write")
    ap.add_argument("--size", choices=SIZES, default="tiny")
    ap.add_argument("--type", dest="model_type", choices=MODEL_TYPES, default="custom_voice")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text-vocab", type=Path, help="the text tokenizer's tiktoken ranks, e.g. Qwen's qwen.tiktoken "
                    "(in PyPI's dashscope package); default: a small BPE trained here (~3x the real token count)")
    args = ap.parse_args(argv)
    if args.text_vocab is not None and not args.text_vocab.is_file():
        ap.error(f"--text-vocab {args.text_vocab}: no such file")
    path = write_checkpoint(args.out, args.size, args.model_type, args.seed, args.text_vocab)
    vocab = f"text vocabulary of {args.text_vocab}" if args.text_vocab else "the small trained text vocabulary"
    print(f"wrote {args.size} {args.model_type} checkpoint with {vocab} to {path}")


if __name__ == "__main__":
    main()
