"""Which torch device to run on, checked against this machine before anything uses it.

A CUDA device that torch cannot use (a CPU-only torch build, no GPU, an index past the
last GPU) fails deep inside torch with a long traceback, or, in the daemon, only when the
first client's layout opens a store (issue #37, item 6). Checking the name up front turns
that into one :class:`~tierkv.errors.DeviceUnavailableError` with a hint.
"""
from __future__ import annotations

from .errors import ConfigError, DeviceUnavailableError


def resolve_device(device: str | None) -> str:
    """``device`` checked against this machine; None picks ``cuda`` when torch can use a
    GPU, else ``cpu``. Raises DeviceUnavailableError for a CUDA device torch cannot use and
    ConfigError for a name torch does not know. Other torch devices (``mps``, ...) pass
    through unchecked."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"unknown device {device!r}: {exc}", hint="pass --device cpu, cuda or cuda:N") from None
    if parsed.type != "cuda":
        return device
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "torch sees no GPU on this machine"
        raise DeviceUnavailableError(f"device {device!r} is not available: {why}")
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise DeviceUnavailableError(f"device {device!r} is not available: this machine has {count} GPU(s), "
                                     f"cuda:0 to cuda:{count - 1}", hint=f"pass --device cuda:0 to cuda:{count - 1}")
    return device
