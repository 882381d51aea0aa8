"""A CUDA stream whose kernels may use only some of the GPU's SMs (a CUDA green context).

The talker's frame is ~1,600 small dependent kernels. Beside the codec's large convolutions each of them waits
for SMs that the codec's blocks hold, and a 128-row step took 3x as long (7 -> 21 ms on an H100; stream
priorities changed nothing, since a running block is never preempted: docs/performance.md, twelfth pass).
Confining the codec to part of the GPU keeps the rest free for the talker's kernels, at some codec speed.
"""

from __future__ import annotations

import torch


def confined_stream(device: torch.device, sms: int) -> tuple[object | None, torch.cuda.Stream]:
    """(green context, a stream of it) for `sms` SMs of `device`; all of them or more: no context, a plain stream.
    CUDA rounds `sms` up to its partition granularity (8 SMs on Hopper). Keep the context as long as the stream."""
    props = torch.cuda.get_device_properties(device)
    if sms >= props.multi_processor_count:
        return None, torch.cuda.Stream(device)
    from torch.cuda import green_contexts

    if not green_contexts.SUPPORTED:
        raise ValueError("--codec-sms needs PyTorch built with CUDA green contexts (CUDA 12.4 or later)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    context = green_contexts.GreenContext.create(num_sms=sms, device_id=index)
    return context, context.Stream()
