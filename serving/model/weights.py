"""Loading model.safetensors (single file or sharded with model.safetensors.index.json) into our modules by
the official tensor names, or filling them with random values (load_format="dummy").

Modules are built on the meta device and materialised directly in the target dtype and device, so a 1.7B
checkpoint never exists twice in memory. Every mismatch is reported at once, by name.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
LOAD_FORMATS = ("auto", "safetensors", "dummy")


class WeightsError(ValueError):
    """The checkpoint's tensors do not fit the model built from its config."""


def weights_stamp(tensors) -> tuple:
    """What identifies tensors' current values for a cache of something computed from them: storage and version
    (a load or an in-place draw bumps the version, a move changes the storage). Tensors made in inference mode keep
    no version: their storage alone stands for them (they cannot change in place outside inference mode)."""
    return tuple((t.data_ptr(), None if t.is_inference() else t._version) for t in tensors)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of float32, bfloat16, float16")
        return dtype
    try:
        return DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(set(DTYPES))}") from None


def safetensors_files(directory: Path, stem: str = "model") -> dict[str, Path]:
    """tensor name -> file holding it, for <stem>.safetensors or a sharded <stem>.safetensors.index.json."""
    single = directory / f"{stem}.safetensors"
    index = directory / f"{stem}.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
        if missing:
            raise WeightsError(f"{index} names shard files that do not exist: {missing}")
        return {name: directory / f for name, f in weight_map.items()}
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise WeightsError(f"no {stem}.safetensors or {stem}.safetensors.index.json in {directory}")


def _summarise(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def materialize(module: nn.Module, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """Allocate a meta-built module on device in dtype (values uninitialised) and rebuild computed buffers."""
    module = module.to_empty(device=device).to(dtype)
    for m in module.modules():
        rebuild = getattr(m, "rebuild_buffers", None)
        if rebuild is not None:
            rebuild()
    return module


def load_safetensors_(module: nn.Module, files: dict[str, Path], prefix: str = "", source: str = "") -> None:
    """Copy tensors named prefix + <module key> into module (cast to each parameter's dtype).

    Raises WeightsError naming every missing, unexpected and wrongly shaped tensor."""
    params = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    persistent = set(module.state_dict().keys())
    expected = {k: v for k, v in params.items() if k in persistent}
    in_file = {name[len(prefix):]: name for name in files if name.startswith(prefix)}
    missing = sorted(set(expected) - set(in_file))
    unexpected = sorted(prefix + k for k in set(in_file) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing tensors: {_summarise([prefix + k for k in missing])}")
    if unexpected:
        problems.append(f"unexpected tensors: {_summarise(unexpected)}")
    by_file: dict[Path, list[str]] = {}
    for key in sorted(set(expected) & set(in_file)):
        by_file.setdefault(files[in_file[key]], []).append(key)
    mismatched = []
    for path, keys in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for key in keys:
                shape = tuple(f.get_slice(in_file[key]).get_shape())
                if shape != tuple(expected[key].shape):
                    mismatched.append(f"{in_file[key]} has shape {list(shape)}, the config implies "
                                      f"{list(expected[key].shape)}")
    if mismatched:
        problems.append("shape mismatches: " + "; ".join(mismatched[:12])
                        + (f"; ... ({len(mismatched) - 12} more)" if len(mismatched) > 12 else ""))
    if problems:
        raise WeightsError(f"{source or 'checkpoint'} does not match the model built from its config: "
                           + " | ".join(problems))
    with torch.no_grad():
        for path, keys in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for key in keys:
                    target = expected[key]
                    target.copy_(f.get_tensor(in_file[key]).to(device=target.device, dtype=target.dtype))


@torch.no_grad()
def init_dummy_(module: nn.Module, seed: int = 0) -> None:
    """Random weights that keep activations O(1): N(0, 1/fan_in) matrices, N(0, 1) embeddings, norms near 1,
    small biases. For performance work and shape checks; the outputs are noise."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("norm.weight") or name.endswith("_norm.weight") or name.endswith("layernorm.weight"):
            values = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith(".bias"):
            values = 0.02 * torch.randn(p.shape, generator=gen)
        elif p.dim() >= 2 and "embedding" not in name:
            values = torch.randn(p.shape, generator=gen) / math.sqrt(p[0].numel())
        else:
            values = torch.randn(p.shape, generator=gen)
        p.copy_(values.to(dtype=p.dtype))
