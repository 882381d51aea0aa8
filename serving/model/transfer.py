"""Host values onto the model's device without waiting for the work already queued there."""

from __future__ import annotations

import torch


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`; on CUDA through pinned memory and a non-blocking copy, since a copy from
    pageable memory may first wait for the stream, i.e. for the kernels queued before it (a decode step in
    flight, earlier prefills)."""
    pinned = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=pinned)
