"""Build both stages from a checkpoint directory: devices, dtype, weights, KV slots from the memory budget."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from serving.engine.codec_graphs import make_batch_buckets, make_frame_buckets
from serving.engine.codec_stage import CodecRunner
from serving.engine.scheduler import make_buckets
from serving.engine.talker_stage import TalkerRunner

log = logging.getLogger("serving.engine")

TASK_TYPES = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}
CPU_KV_BUDGET_BYTES = 2 * 1024**3
GPU_KV_BUDGET_SHARE = 0.4


def resolve_device(name: str, fallback: torch.device | None = None) -> torch.device:
    if name == "auto":
        if fallback is not None:
            return fallback
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} was asked for, but this machine has no CUDA GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} GPU(s) here")
    elif device.type != "cpu":
        raise ValueError(f"device {name!r} is not supported; use cpu or cuda[:N]")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    from serving.model.weights import resolve_dtype as model_dtype

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return model_dtype(name)


def check_placement(config) -> None:
    """Raise ValueError now for devices or a dtype that cannot work, instead of failing during loading."""
    talker = resolve_device(config.talker_device)
    resolve_device(config.codec_device, fallback=talker)
    resolve_dtype(config.dtype, talker)
    resolve_dtype(config.codec_dtype, talker)


def slot_bytes(model_cfg, max_model_len: int, dtype: torch.dtype) -> int:
    """Memory one KV slot takes: talker keys + values over max_model_len, its trailing-text buffer, CP cache."""
    t, cp = model_cfg.talker.transformer, model_cfg.talker.code_predictor
    size = torch.tensor([], dtype=dtype).element_size()
    kv = 2 * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * max_model_len
    trailing = t.hidden_size * max_model_len
    cp_kv = 2 * cp.num_hidden_layers * cp.num_key_value_heads * cp.head_dim * model_cfg.talker.num_code_groups
    return (kv + trailing + cp_kv) * size


def count_slots(config, model_cfg, device: torch.device, dtype: torch.dtype) -> int:
    per_slot = slot_bytes(model_cfg, config.max_model_len, dtype)
    if config.kv_cache_gb is not None:
        budget = int(config.kv_cache_gb * 1024**3)
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * GPU_KV_BUDGET_SHARE)
    else:
        budget = CPU_KV_BUDGET_BYTES
    slots = min(config.max_batch_size, budget // per_slot)
    if slots < 1:
        raise ValueError(f"a KV budget of {budget / 1024**3:.2f} GiB cannot hold one request of --max-model-len "
                         f"{config.max_model_len} ({per_slot / 1024**2:.0f} MiB per slot); lower --max-model-len "
                         "or raise --kv-cache-gb")
    if slots < config.max_batch_size:
        log.warning("KV budget holds %d slots, fewer than --max-batch-size %d", slots, config.max_batch_size)
    return slots


def codec_graph_buckets(config, codec_device: torch.device) -> tuple[tuple[int, int], ...]:
    """(batch, frames) shapes of the codec calls to capture: none on a CPU or with --enforce-eager."""
    if codec_device.type != "cuda" or config.enforce_eager:
        return ()
    frames = make_frame_buckets(config.first_chunk_frames, config.chunk_frames)
    return tuple((b, f) for b in make_batch_buckets(config.max_codec_batch, config.codec_graph_batches)
                 for f in frames)


def load_stages(config):
    """(TalkerRunner, CodecRunner, EngineInfo) for an EngineConfig. Raises ValueError for unusable options."""
    from serving.engine.engine import EngineInfo
    from serving.engine.prompts import PromptBuilder
    from serving.model.config import GenerationDefaults, ModelConfig
    from serving.model.model import Qwen3TTSModel
    from serving.model.speech_tokenizer import SpeechTokenizer
    from serving.model.weights import init_dummy_, load_safetensors_, materialize, safetensors_files

    path = Path(config.model)
    model_cfg = ModelConfig.from_dir(path)
    talker_device = resolve_device(config.talker_device)
    codec_device = resolve_device(config.codec_device, fallback=talker_device)
    dtype = resolve_dtype(config.dtype, talker_device)
    torch.manual_seed(0)

    with torch.device("meta"):
        model = Qwen3TTSModel(model_cfg)
    model = materialize(model, dtype, talker_device)
    if config.load_format == "dummy":
        init_dummy_(model, seed=0)
    else:
        load_safetensors_(model, safetensors_files(path), source=str(path))
    model.eval()
    if model.speaker_encoder is not None:
        model.speaker_encoder.float()  # mel statistics and pooling are sensitive; the encoder is small

    codec = SpeechTokenizer.load(path / "speech_tokenizer", dtype="float32", device="cpu",
                                 load_format=config.load_format)
    decoder = codec.decoder.to(codec_device, resolve_dtype(config.codec_dtype, codec_device)).eval()
    encoder = codec.encoder.to(talker_device).eval() if model_cfg.tts_model_type == "base" else None

    num_slots = count_slots(config, model_cfg, talker_device, dtype)
    buckets = make_buckets(num_slots)
    generation = GenerationDefaults.from_dir(path)
    prompts = PromptBuilder(path, model, model_cfg, generation, encoder, talker_device)
    graphs = talker_device.type == "cuda" and not config.enforce_eager
    runner = TalkerRunner(model, prompts, num_slots=num_slots, max_model_len=config.max_model_len,
                          buckets=buckets, device=talker_device, dtype=dtype, cuda_graphs=graphs,
                          max_graph_batch=config.max_graph_batch,
                          compile_layers=graphs if config.compile is None else config.compile,
                          ignore_eos=config.ignore_eos, length_policy=config.length_policy)
    # a codec slot per talker slot, and some for streams whose talker is done but whose audio is not yet out
    codec_runner = CodecRunner(decoder, codec_device, model_cfg.talker.num_code_groups,
                               num_slots=num_slots + config.max_codec_batch,
                               graph_buckets=codec_graph_buckets(config, codec_device),
                               graph_budget_bytes=None if config.codec_graph_memory_gb is None
                               else int(config.codec_graph_memory_gb * 1024**3))
    task_type = TASK_TYPES[model_cfg.tts_model_type]
    info = EngineInfo(
        model_name=config.model_name or path.name,
        model_path=str(path),
        task_type=task_type,
        speakers=tuple(model_cfg.speakers) if task_type == "CustomVoice" else (),
        languages=tuple(model_cfg.languages),
        speaker_embedding_dim=(model.speaker_encoder.config.enc_dim if model.speaker_encoder is not None else None),
        supports_instructions=task_type == "VoiceDesign" or (task_type == "CustomVoice" and not model_cfg.drops_instruct),
        chunk_frames=config.chunk_frames,
        num_slots=num_slots,
        generation=generation,
    )
    log.info("loaded %s (%s) on %s/%s, %s; %d KV slots, buckets %s; codec %s, state %d slots x %.1f MB, %d graph "
             "buckets to capture", path, task_type, talker_device, codec_device, dtype, num_slots, list(buckets),
             config.codec_dtype, codec_runner.num_slots, codec_runner.pool.state_bytes_per_slot / 2**20,
             len(codec_runner.graphs.buckets) if codec_runner.graphs is not None else 0)
    return runner, codec_runner, info
