"""Host↔device copies that never stall a step.

A copy from pageable host memory to the GPU waits for the stream to drain, a host sync in the middle of a step; so
step inputs are built in pinned memory and copied without blocking. The sampled tokens come back the same way, and
waiting for them is the one sync of a step.
"""

from __future__ import annotations

import torch


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(data)`` on ``device``; on CUDA built in pinned memory and copied without blocking."""
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def to_host_list(tensor: torch.Tensor) -> list:
    """``tensor.tolist()``; on CUDA through one pinned, non-blocking copy and a wait for the stream."""
    if tensor.device.type != "cuda":
        return tensor.tolist()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return host.tolist()
