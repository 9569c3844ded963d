"""Free memory of a device: available RAM on the CPU, free memory on a CUDA device.

``free_memory_bytes`` answers ``None`` when it cannot tell (no ``/proc/meminfo``,
another accelerator); callers then fall back to a fixed value. ``psutil`` is not
consulted: it is no dependency, and ``MemAvailable`` is what it reports on Linux.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["free_memory_bytes"]

_MEMINFO = Path("/proc/meminfo")


def _meminfo_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, ``None`` if absent or unreadable."""
    try:
        text = _MEMINFO.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024  # the value is in kB
    return None


def free_memory_bytes(device: torch.device | str | None = None) -> int | None:
    """Bytes free on ``device`` now (``None``: the CPU), or ``None`` when unknown.

    CPU: ``MemAvailable`` from ``/proc/meminfo``. CUDA: the free bytes of
    ``torch.cuda.mem_get_info(device)``. Any other device type: ``None``.
    """
    device = torch.device("cpu" if device is None else device)
    if device.type == "cpu":
        return _meminfo_available()
    if device.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return None
