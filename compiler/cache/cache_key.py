"""What a compile-cache entry is valid for (Note [Compile cache] in ``compiler.cache.store``): the
model's structure, the compile settings, the world size (or ``any``), and the runtime."""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["FORMAT_VERSION", "CacheKey", "model_fingerprint", "runtime_fingerprint"]

FORMAT_VERSION = 2  # 2: the entry carries the C++ kernels


def runtime_fingerprint(device: torch.device | str | None = None) -> dict[str, str]:
    """The environment an entry is only valid in: format, torch, python, device."""
    device = torch.device(device if device is not None else "cpu")
    capability = "cpu"
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        capability = f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"
    return {
        "format": str(FORMAT_VERSION),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": f"{device.type}:{capability}",
    }


def model_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of the module tree and of every parameter's and buffer's name, shape and dtype."""
    h = hashlib.sha256()
    for name, module in model.named_modules():
        h.update(f"m {name} {type(module).__module__}.{type(module).__qualname__} {module.extra_repr()}\n".encode())
    for kind, items in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, t in items:
            h.update(f"{kind} {name} {tuple(t.shape)} {t.dtype} {t.requires_grad}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class CacheKey:
    """What an entry is valid for. ``runtime`` is checked field by field (a
    mismatch is *stale*); ``digest`` covers ``runtime`` and ``parts`` (a
    different digest with the same runtime is *foreign*)."""

    label: str
    parts: dict[str, str]
    runtime: dict[str, str] = field(default_factory=runtime_fingerprint)

    @property
    def digest(self) -> str:
        blob = json.dumps({"parts": self.parts, "runtime": self.runtime}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    @classmethod
    def for_model(cls, model: torch.nn.Module, settings: dict[str, Any], *, world_size: int | None = 1,
                  device: torch.device | str | None = None) -> CacheKey:
        """The key of ``model`` compiled with ``settings`` (any JSON-able values) on
        ``world_size`` ranks; None: graphs that do not depend on the world size."""
        parts = {
            "model": model_fingerprint(model),
            "settings": json.dumps(settings, sort_keys=True, default=repr),
            "world_size": "any" if world_size is None else str(world_size),
        }
        return cls(label=type(model).__name__, parts=parts, runtime=runtime_fingerprint(device))
