"""Small host values onto a device without waiting for the device's queue."""

from __future__ import annotations

import torch
from torch import Tensor


def to_device_without_waiting(host: Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> Tensor:
    """A small host tensor onto ``device`` (as ``dtype``) WITHOUT waiting for the device's queue.

    ``tensor.to("cuda")`` copies from pageable memory and synchronises the stream: the host would wait
    for the previous forward before launching what follows. From pinned memory the copy is asynchronous,
    and torch's caching host allocator keeps the pinned block until the copy has run.
    """
    if torch.device(device).type != "cuda":
        return host.to(device=device, dtype=dtype)
    return host.pin_memory().to(device=device, dtype=dtype, non_blocking=True)


__all__ = ["to_device_without_waiting"]
