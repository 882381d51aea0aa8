"""Per-request random streams on the device: Exp(1) noise from a counter-based hash of (seed, frame, group, id).

A shared torch.Generator would make each request's draws depend on which other requests share its batch.
Hashing the coordinates instead gives every request its own stream, so a seeded request yields the same
codes alone or in any batch, and the noise costs a few elementwise integer ops with no host sync (the
whole step stays capturable in a CUDA graph).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Chris Wellons' integer hash) on uint32 values held in int64; products stay below 2**63."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = ((x & 0xFFFF) * 0x7FEB352D + (((x >> 16) * 0x7FEB352D) & 0xFFFF) * 65536) & _MASK32
    x = x ^ (x >> 15)
    x = ((x & 0xFFFF) * 0x846CA68B + (((x >> 16) * 0x846CA68B) & 0xFFFF) * 65536) & _MASK32
    return x ^ (x >> 16)


def exponential_noise(seed_b: torch.Tensor, frame_b: torch.Tensor, group: int, vocab: int) -> torch.Tensor:
    """Exp(1) draws [B, vocab] (float32) for codebook `group` of frame `frame_b` [B] of requests `seed_b` [B]."""
    ids = torch.arange(vocab, device=seed_b.device, dtype=torch.int64)
    return exponential_noise_at(seed_b, frame_b, group, ids[None, :])


def exponential_noise_at(seed_b: torch.Tensor, frame_b: torch.Tensor, group: int, ids: torch.Tensor) -> torch.Tensor:
    """The draws of exponential_noise at token ids [B, K] (or [1, K]) only: the same value for the same id, so a
    sampler that looks at a few candidate tokens draws exactly what the full-vocabulary one would."""
    h = _mix32(seed_b & _MASK32) ^ _mix32((seed_b >> 32) + 0x9E3779B9)
    h = _mix32(h ^ _mix32(frame_b * 64 + group))
    bits = _mix32(h[:, None] ^ _mix32(ids + 0x632BE5AB))
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)  # 24 bits in (0, 1)
    return -torch.log(uniform)
