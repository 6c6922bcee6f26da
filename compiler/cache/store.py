"""A persistent compile cache: one file of torch.compiler cache artifacts per key.

Note [Compile cache]

Background
    Inductor keeps its FX graph cache and AOTAutograd's cache in a local directory; a
    new machine, container or tmp cleanup starts cold. ``save_cache_artifacts``
    serialises every cache artifact this process created into one blob, and
    ``load_cache_artifacts`` writes it back where the next compile finds it. Split
    partitions have AOTAutograd entries because ``compiler.graph.partition`` compiles them
    without ``fakify_first_call`` (Note [Lazy partition compile]).

Algorithm
    - A :class:`CacheKey` is a sha256 over what changes what gets compiled: model
      structure, compile settings, world size, torch and python versions, device.
      Where the graphs hold no collective (``open_cache(..., any_world_size=True)``:
      DDP's split, whole and regional strategies) the key says ``world_size: any``, so
      an elastic restart with the same per-rank batch loads the entry; the load says
      which world size wrote it (measured: docs/compile-time.md).
    - An entry is ``<cache_dir>/<label>-<key[:16]>.pt2cache``: a magic line, a JSON
      header (format, key parts, lengths, sha256), the artifacts and, on CPU, the C++
      kernels (Note [Kernels in the compile cache]).
    - :meth:`CompileCache.load` checks, in order: the folder (``unsafe_folder``), magic
      and header (corrupt), format/torch/python/device (stale), the key (foreign),
      lengths and checksum (corrupt), every artifact key and kernel path (Note [Checked
      artifact keys]); only then installs kernels (never overwriting a file) and loads
      the payload. A failure is one warning and a compile from scratch; it never raises.
    - :meth:`CompileCache.save` (local rank 0 only) writes atomically (temporary file,
      ``fsync``, ``os.replace``) the union of the loaded entry and this process's
      artifacts and kernels, and nothing when that adds nothing.

Notes
    - Loading a cache is loading code, so an entry is read only from a folder no other
      user can write; the checksum detects corruption, not tampering, and the key check
      keeps a tampered entry inside Inductor's cache directory (docs/trust.md).
    - Our key picks the file; Inductor's and AOTAutograd's own keys pick the artifact,
      so a graph never runs code compiled for another graph.
    - :func:`open_cache` puts Inductor's cache under ``cache_dir/inductor`` when the
      process has not chosen one, and the load removes damaged kernels there (Note
      [Damaged cache artifacts]). The kernels carried include the libraries
      ``pick_vec_isa`` builds to probe the CPU, which otherwise dominate a warm start on
      a fresh directory (measured: docs/compile-time.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._torch_internals import cpp_kernel_keys, inductor_default_cache_dir, merge_artifact_payloads
from .artifact_keys import artifact_problem
from .artifacts import inductor_cache_dir, remove_damaged_kernels
from .cache_key import FORMAT_VERSION, CacheKey, model_fingerprint, runtime_fingerprint
from .kernels import KernelBlobError, collect_kernels, install_kernels, kernel_names, kernel_snapshot, merge_kernels
from .trust import unsafe_folder

log = logging.getLogger(__name__)

__all__ = ["FORMAT_VERSION", "CacheKey", "CompileCache", "LoadResult", "inductor_dir_is_default", "model_fingerprint",
           "open_cache", "runtime_fingerprint", "save_on_local_rank0"]

MAGIC = b"distcompile-cache\n"
SUFFIX = ".pt2cache"


@dataclass
class LoadResult:
    """What :meth:`CompileCache.load` did. ``status``: loaded, missing, stale,
    foreign, corrupt or unsafe; ``reason``: the detail the warning gave."""

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

    def __init__(self, cache_dir: str | os.PathLike, key: CacheKey, world_size: int = 1) -> None:
        self.dir = Path(cache_dir)
        self.key = key
        self.world_size = world_size  # this run's, kept in the header (the key may say "any")
        self.written_on: int | None = None  # the world size of the run that wrote the loaded entry
        self.path = self.dir / f"{key.label}-{key.digest[:16]}{SUFFIX}"
        self.last_load: LoadResult | None = None
        self.saved = False
        self.installed: list[Path] = []  # kernel files the last load installed
        self._before: set[str] | None = None  # Inductor's kernel files after the load: later ones were built here
        # What the entry holds (loaded or last written): artifact payload, its (type, key) pairs, kernels.
        self._held: tuple[bytes, set[tuple[str, str]], bytes] = (b"", set(), b"")

    # -- reading ----------------------------------------------------------------

    def _check(self) -> tuple[str, str, bytes | None]:
        """(status, reason, payload) for the entry on disk, without loading it; the
        payload is the artifacts followed by the kernels (``header["artifacts_bytes"]``)."""
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
        split = header.get("artifacts_bytes")
        if not isinstance(split, int) or not 0 <= split <= len(payload):
            return "corrupt", f"bad artifacts_bytes {split!r} in the header", None
        self._split = split
        self.written_on = header.get("world_size")
        return "ok", "", payload

    def load(self) -> LoadResult:
        """Load the entry into torch's local compile caches if it is valid, and install
        its kernels into Inductor's cache directory (existing files are kept).

        Never raises: a stale, foreign, corrupt or unsafe entry gives one warning
        that names the file and the reason, and the job compiles from scratch.
        """
        self.installed = []
        unsafe = unsafe_folder(self.dir)
        if unsafe is not None:
            log.warning("Compile cache: not loading %s: %s, so another user could put code there that this job "
                        "would run. Run chmod go-w on that folder, or choose another compile.cache_dir "
                        "(compile.cache_dir=null turns the cache off); compiling from scratch.", self.path, unsafe)
            with contextlib.suppress(OSError):
                self._before = kernel_snapshot(inductor_cache_dir())
            self.last_load = LoadResult("unsafe", self.path, unsafe)
            return self.last_load
        status, reason, payload = self._check()
        if status == "ok":
            artifacts, kernels = payload[:self._split], payload[self._split:]
            try:
                kernel_names(kernels)  # the format and the paths, before anything is written
                problem = artifact_problem(artifacts)
                if problem is not None:
                    status, reason = "unsafe", f"it holds {problem}"
                else:
                    torch.compiler.load_cache_artifacts(artifacts)
                    status = "loaded"
            except KernelBlobError as e:
                status, reason = "corrupt", f"bad kernel section ({e})"
            except Exception as e:  # noqa: BLE001 - a bad entry must never fail the job
                status, reason = "corrupt", f"torch.compiler.load_cache_artifacts failed ({type(e).__name__}: {e})"
            if status == "loaded":
                try:
                    self.installed = install_kernels(kernels, inductor_cache_dir())
                except OSError as e:
                    log.warning("Compile cache: could not install the kernels of %s into %s (%s); Inductor "
                                "builds the missing ones.", self.path, inductor_cache_dir(), e)
                self._held = (artifacts, _artifact_keys(artifacts), kernels)
        removed = remove_damaged_kernels(self.dir / "inductor")  # Note [Damaged cache artifacts]
        if removed and status == "loaded":  # whole copies from the entry where it has them
            with contextlib.suppress(OSError):
                self.installed += install_kernels(payload[self._split:], inductor_cache_dir())
        with contextlib.suppress(OSError):
            self._before = kernel_snapshot(inductor_cache_dir())
        if status in ("stale", "foreign", "corrupt", "unsafe"):
            log.warning(
                "Compile cache entry %s is %s: %s. Ignoring it and compiling from scratch; the entry will be "
                "overwritten after the first step.", self.path, status, reason,
            )
        elif status == "loaded":
            log.info("Compile cache: loaded %s (%d kernel files installed)", self.path, len(self.installed))
        self.last_load = LoadResult(status, self.path, reason)
        return self.last_load

    # -- writing ----------------------------------------------------------------

    def header(self, payload: bytes, artifacts_bytes: int | None = None) -> dict[str, Any]:
        return {
            "key": self.key.digest, "label": self.key.label, "parts": self.key.parts, "runtime": self.key.runtime,
            "payload_bytes": len(payload), "payload_sha256": hashlib.sha256(payload).hexdigest(),
            "artifacts_bytes": len(payload) if artifacts_bytes is None else artifacts_bytes,
            "world_size": self.world_size,
        }

    def write(self, artifacts: bytes, kernels: bytes = b"") -> Path:
        """Write ``artifacts`` and ``kernels`` as this key's entry, atomically (tmp file,
        fsync, os.replace)."""
        self.dir.mkdir(mode=0o755, parents=True, exist_ok=True)  # not group-writable under umask 002: load refuses that
        payload = artifacts + kernels
        data = MAGIC + json.dumps(self.header(payload, len(artifacts)), sort_keys=True).encode() + b"\n" + payload
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
        """Save this process's compile artifacts (``torch.compiler.save_cache_artifacts``)
        and the C++ kernels it built or loaded, merged with what the entry already
        holds (after a load, or an earlier save).

        Returns the entry's path, or None when there was nothing (new) to save (e.g. a
        backend without Inductor, or a warm start that compiled nothing new) or
        the save failed (logged; the job goes on). Never raises.
        """
        try:
            result = torch.compiler.save_cache_artifacts()
            held_artifacts, held_keys, held_kernels = self._held
            artifacts, keys = held_artifacts, held_keys
            if result is not None and result[0]:
                artifacts, keys = _merge(held_artifacts, result[0])
            built = collect_kernels(inductor_cache_dir(), cpp_kernel_keys(), since=self._before)
            kernels = merge_kernels(held_kernels, built)
        except Exception as e:  # noqa: BLE001 - saving the cache must never fail the job
            log.warning("Compile cache: could not collect this process's artifacts for %s (%s: %s); the next "
                        "restart compiles from scratch.", self.path, type(e).__name__, e)
            return None
        if not artifacts:
            log.info("Compile cache: nothing to save (no Inductor/AOTAutograd artifacts in this process)")
            return None
        if keys <= held_keys and kernel_names(kernels) <= kernel_names(held_kernels):
            log.info("Compile cache: %s already holds every artifact and kernel of this process", self.path)
            return None
        if self.last_load is not None and self.last_load.loaded and not keys <= held_keys:
            log.info("Compile cache: this run compiled %d graph artifact(s) that the loaded entry %s lacked (written "
                     "by a run on %s rank(s), this one on %d): their keys differ from that run's, as another per-rank "
                     "batch or sequence length makes them differ (and, measured, a one-rank run after a multi-rank "
                     "one does for AOTAutograd's); they are added to the entry.", len(keys - held_keys),
                     self.path.name, self.written_on if self.written_on is not None else "?", self.world_size)
        try:
            path = self.write(artifacts, kernels)
        except OSError as e:
            log.warning("Compile cache: could not write %s (%s); the next restart compiles from scratch.",
                        self.path, e)
            return None
        self._held = (artifacts, keys, kernels)
        self.saved = True
        log.info("Compile cache: saved %s (%d bytes of artifacts, %d of kernels)", path, len(artifacts),
                 len(kernels))
        return path


def _artifact_keys(payload: bytes) -> set[tuple[str, str]]:
    return _merge(b"", payload)[1] if payload else set()


def _merge(held: bytes, new: bytes) -> tuple[bytes, set[tuple[str, str]]]:
    """``merge_artifact_payloads(held, new)``; a payload torch cannot read (a test's
    stub) counts as one artifact, and replaces ``held``."""
    try:
        return merge_artifact_payloads(*(p for p in (held, new) if p))
    except Exception:  # noqa: BLE001
        return new, {("payload", hashlib.sha256(new).hexdigest())}


def inductor_dir_is_default() -> bool:
    """True unless the user chose Inductor's cache directory. Importing torch._dynamo
    already sets ``TORCHINDUCTOR_CACHE_DIR`` to Inductor's default, so a value equal
    to that default counts as not chosen."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return current is None or os.path.abspath(current) == os.path.abspath(inductor_default_cache_dir())


def open_cache(model: torch.nn.Module, cache_dir: str | os.PathLike, settings: dict[str, Any], *,
               world_size: int | None = None, any_world_size: bool = False) -> CompileCache:
    """The compile cache entry of ``model`` compiled with ``settings`` on ``world_size`` ranks
    (the default group's size by default); loaded now, before the first compile.
    ``any_world_size``: the graphs do not depend on the world size, so the entry is shared by
    runs of every world size (Note [Compile cache]).

    Unless the user chose Inductor's cache directory, Inductor's local caches go to
    ``cache_dir/inductor`` too. This sets ``TORCHINDUCTOR_CACHE_DIR`` for the rest of
    the process, on purpose: Inductor reads it whenever it compiles or loads a
    kernel, and a compiled model compiles long after this call (each backward at the
    first backward pass, every recompile later), so a variable scoped to this call
    would send those kernels back to the default directory. Inductor has no config
    setting for the directory, only the variable. Set ``TORCHINDUCTOR_CACHE_DIR``
    yourself to keep Inductor's cache elsewhere; it is then left alone."""
    if inductor_dir_is_default():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(os.path.join(cache_dir, "inductor"))
    if world_size is None:
        dist = torch.distributed
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    param = next(model.parameters(), None)
    device = param.device if param is not None and param.device.type != "meta" else None
    key = CacheKey.for_model(model, settings, world_size=None if any_world_size else world_size, device=device)
    cache = CompileCache(cache_dir, key, world_size)
    result = cache.load()
    if result.loaded and cache.written_on is not None and cache.written_on != world_size:
        log.info("Compile cache: loaded %s, written by a run on %d rank(s), into this run on %d (its graphs do not "
                 "depend on the world size)", cache.path.name, cache.written_on, world_size)
    return cache


def local_rank() -> int:
    """``LOCAL_RANK``, else the rank in the default group, else 0."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save_on_local_rank0(cache: CompileCache | None) -> Path | None:
    """``cache.save()`` on local rank 0 (the other ranks compiled the same artifacts);
    None elsewhere, without a cache, or when nothing was written. Never raises."""
    if cache is None or local_rank() != 0:
        return None
    return cache.save()
