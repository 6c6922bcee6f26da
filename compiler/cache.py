"""A persistent compile cache: one file of torch.compiler cache artifacts per key.

Note [Compile cache]

Background
    Inductor keeps its FX graph cache and AOTAutograd's cache in a local directory
    (``TORCHINDUCTOR_CACHE_DIR``, ``/tmp/torchinductor_<user>`` by default); a new
    machine, container or tmp cleanup starts cold. ``torch.compiler.save_cache_artifacts``
    serialises every cache artifact this process created (Inductor graphs, AOTAutograd
    entries, autotuning results) into one blob, and ``load_cache_artifacts`` writes
    such a blob back into the local caches, where the next compile finds it.
    The AOTAutograd entries only exist for split partitions because
    ``compiler.partition`` compiles them without ``fakify_first_call`` (see
    Note [Lazy partition compile]).

Algorithm
    - A :class:`CacheKey` is a sha256 over everything that changes what gets
      compiled: the model's structure (module tree, parameter names, shapes,
      dtypes), the compile settings, the world size, the torch and python
      versions, the device type and capability. Ranks of one job share a key.
    - An entry is ``<cache_dir>/<label>-<key[:16]>.pt2cache``: a magic line, a JSON
      header (format version, the key and its parts, payload length and sha256)
      and the payload from ``save_cache_artifacts``.
    - :meth:`CompileCache.load` checks, in order: magic and header parse
      (corrupt), format/torch/python/device (stale), the key (foreign: an entry
      for another model or config), payload length and checksum (corrupt), and
      only then hands the payload to ``load_cache_artifacts``. Any failure gives
      one warning naming the file and the reason, and the job compiles from
      scratch; the entry is overwritten at the next save. It never raises.
    - :meth:`CompileCache.save` writes atomically: a temporary file in the same
      directory, ``fsync``, ``os.replace``. A reader sees the old entry or the new
      one, never a partial file; a crash mid-write leaves the old entry.

Notes
    - Loading a cache is loading code: Inductor's artifacts are Python and
      compiled kernels that run in the training process. The cache directory must
      be as trusted as the training code itself (not world-writable, not shared
      with untrusted jobs). The checksum detects corruption, not tampering.
    - Our key decides which file is read; Inductor's and AOTAutograd's own keys
      (over the graph, its inputs and configs) decide which artifact a graph uses.
      An entry that passed our checks but holds other graphs only adds unused
      cache entries: a graph never runs code compiled for another graph.
    - Only local rank 0 saves (the other ranks compiled the same artifacts);
      every rank loads.
    - The artifact file bundles Inductor's generated code and, on GPU, its Triton
      kernels, but not the C++ kernels Inductor builds on CPU: those are rebuilt
      from the cached source. ``compile_ddp(cache_dir=...)`` therefore also puts
      Inductor's local cache under ``cache_dir/inductor`` when the process has not
      chosen one (``TORCHINDUCTOR_CACHE_DIR`` unset or at Inductor's default), so a restart on the same
      machine finds the built kernels too. :meth:`CompileCache.load` removes the
      damaged kernels there first (Note [Damaged cache artifacts] in
      ``compiler.artifacts``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .artifacts import remove_damaged_kernels

log = logging.getLogger(__name__)

__all__ = ["FORMAT_VERSION", "CacheKey", "CompileCache", "LoadResult", "model_fingerprint", "runtime_fingerprint"]

FORMAT_VERSION = 1
MAGIC = b"distcompile-cache\n"
SUFFIX = ".pt2cache"


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
    def for_model(cls, model: torch.nn.Module, settings: dict[str, Any], *, world_size: int = 1,
                  device: torch.device | str | None = None) -> CacheKey:
        """The key of ``model`` compiled with ``settings`` (any JSON-able values) on ``world_size`` ranks."""
        parts = {
            "model": model_fingerprint(model),
            "settings": json.dumps(settings, sort_keys=True, default=repr),
            "world_size": str(world_size),
        }
        return cls(label=type(model).__name__, parts=parts, runtime=runtime_fingerprint(device))


@dataclass
class LoadResult:
    """What :meth:`CompileCache.load` did. ``status``: loaded, missing, stale,
    foreign or corrupt; ``reason``: the detail the warning gave."""

    status: str
    path: Path
    reason: str = ""

    @property
    def loaded(self) -> bool:
        return self.status == "loaded"


class CompileCache:
    """The entry for one :class:`CacheKey` in ``cache_dir`` (see Note [Compile cache]).

    The directory must be trusted: loading an entry runs the code in it.
    """

    def __init__(self, cache_dir: str | os.PathLike, key: CacheKey) -> None:
        self.dir = Path(cache_dir)
        self.key = key
        self.path = self.dir / f"{key.label}-{key.digest[:16]}{SUFFIX}"
        self.last_load: LoadResult | None = None
        self.saved = False

    # -- reading ----------------------------------------------------------------

    def _check(self) -> tuple[str, str, bytes | None]:
        """(status, reason, payload) for the entry on disk, without loading it."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return "missing", "no entry yet", None
        except OSError as e:
            return "corrupt", f"cannot be read ({e})", None
        if not raw.startswith(MAGIC):
            return "corrupt", "not a compile-cache file (bad magic line)", None
        head_end = raw.find(b"\n", len(MAGIC))
        try:
            header = json.loads(raw[len(MAGIC):head_end].decode())
            if head_end < 0 or not isinstance(header, dict):
                raise ValueError("no header line")
        except (ValueError, UnicodeDecodeError) as e:
            return "corrupt", f"unreadable header ({e})", None
        runtime = header.get("runtime", {})
        for name, want in self.key.runtime.items():
            if runtime.get(name) != want:
                return "stale", f"written for {name} {runtime.get(name)!r}, this job has {want!r}", None
        if header.get("key") != self.key.digest:
            differ = sorted(k for k in self.key.parts if header.get("parts", {}).get(k) != self.key.parts[k])
            return "foreign", (f"written for another model or config (key {str(header.get('key'))[:16]}, "
                               f"this job {self.key.digest[:16]}; differs in {', '.join(differ) or 'key'})"), None
        payload = raw[head_end + 1:]
        if len(payload) != header.get("payload_bytes"):
            return "corrupt", f"truncated payload ({len(payload)} of {header.get('payload_bytes')} bytes)", None
        if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
            return "corrupt", "payload checksum mismatch", None
        return "ok", "", payload

    def load(self) -> LoadResult:
        """Load the entry into torch's local compile caches if it is valid.

        Never raises: a stale, foreign or corrupt entry gives one warning that
        names the file and the reason, and the job compiles from scratch.
        """
        remove_damaged_kernels(self.dir / "inductor")  # Note [Damaged cache artifacts]
        status, reason, payload = self._check()
        if status == "ok":
            try:
                torch.compiler.load_cache_artifacts(payload)
                status = "loaded"
            except Exception as e:  # noqa: BLE001 - a bad entry must never fail the job
                status, reason = "corrupt", f"torch.compiler.load_cache_artifacts failed ({type(e).__name__}: {e})"
        if status in ("stale", "foreign", "corrupt"):
            log.warning(
                "Compile cache entry %s is %s: %s. Ignoring it and compiling from scratch; the entry will be "
                "overwritten after the first step.", self.path, status, reason,
            )
        elif status == "loaded":
            log.info("Compile cache: loaded %s", self.path)
        self.last_load = LoadResult(status, self.path, reason)
        return self.last_load

    # -- writing ----------------------------------------------------------------

    def header(self, payload: bytes) -> dict[str, Any]:
        return {
            "key": self.key.digest, "label": self.key.label, "parts": self.key.parts, "runtime": self.key.runtime,
            "payload_bytes": len(payload), "payload_sha256": hashlib.sha256(payload).hexdigest(),
        }

    def write(self, payload: bytes) -> Path:
        """Write ``payload`` as this key's entry, atomically (tmp file, fsync, os.replace)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        data = MAGIC + json.dumps(self.header(payload), sort_keys=True).encode() + b"\n" + payload
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return self.path

    def save(self) -> Path | None:
        """Save this process's compile artifacts (``torch.compiler.save_cache_artifacts``).

        Returns the entry's path, or None when there was nothing to save (e.g. a
        backend without Inductor) or the write failed (logged; the job goes on).
        """
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None or not artifacts[0]:
            log.info("Compile cache: nothing to save (no Inductor/AOTAutograd artifacts in this process)")
            return None
        try:
            path = self.write(artifacts[0])
        except OSError as e:
            log.warning("Compile cache: could not write %s (%s); the next restart compiles from scratch.",
                        self.path, e)
            return None
        self.saved = True
        log.info("Compile cache: saved %s (%d bytes)", path, len(artifacts[0]))
        return path
