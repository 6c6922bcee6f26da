"""Whether a checkpoint folder holds every file it should, with the bytes it was written with.

Note [Checkpoint integrity]

Background
    A published checkpoint (Note [Write, then publish]) can still be damaged later: a
    file deleted by a cleanup script, a shard truncated by a copy, bytes flipped by a bad
    disk. Loading it fails deep in DCP on every rank or, worse, trains on silently from
    wrong weights. "Legacy" must not be decided from one missing file: a checkpoint that
    lost its ``identity.json`` would then resume with no manifest check at all.

Algorithm
    - A checkpoint holds DCP's ``.metadata`` and shards, ``train_state.json``,
      ``identity.json`` and, written last, ``manifest.json`` (every other file's size and
      checksum). :func:`missing_files` reads only names: *legacy* has neither identity
      nor manifest; *damaged* lacks ``.metadata`` or ``train_state.json`` or has only
      one of the two, and is never a candidate.
    - :func:`verify_manifest` recomputes sizes (first, so a truncated file is named
      without reading it) and checksums, with the algorithm each entry names
      (:data:`ALGORITHMS`), so older manifests still verify.
    - The checksum guards against corruption, not tampering: whoever can write the
      folder can rewrite the manifest, which is why such folders are refused up front
      (Note [Trusted folders]). So CRC-32 is enough: it finds every burst up to 32 bits
      and misses random corruption with probability 2**-32 per file (the choices
      measured: docs/reliability.md). The job makes the folder 0700, so its own folder
      is never refused on resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zlib
from typing import Any, Callable

log = logging.getLogger(__name__)

__all__ = ["ALGORITHMS", "CHECKSUM", "IDENTITY_FILE", "MANIFEST_FILE", "METADATA_FILE", "TRAIN_STATE_FILE",
           "checksum", "missing_files", "is_legacy", "write_manifest", "verify_manifest", "write_json"]

IDENTITY_FILE = "identity.json"
MANIFEST_FILE = "manifest.json"
METADATA_FILE = ".metadata"  # DCP's: which tensors, in which shard, at which offset
TRAIN_STATE_FILE = "train_state.json"
_CHUNK = 1 << 22


class _Crc32:
    """zlib.crc32 behind hashlib's update/hexdigest."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


# The checksums a manifest entry may name (its key beside "bytes"), each a hashlib-like factory.
ALGORITHMS: dict[str, Callable[[], Any]] = {
    "crc32": _Crc32,
    "blake2b": lambda: hashlib.blake2b(digest_size=16),
    "sha256": hashlib.sha256,
}
CHECKSUM = "crc32"  # what new manifests record (Note [Checkpoint integrity])


def checksum(path: str, algorithm: str = CHECKSUM) -> str:
    """The hex checksum ``algorithm`` (a key of :data:`ALGORITHMS`) of the file at ``path``."""
    h = ALGORITHMS[algorithm]()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def missing_files(folder: str) -> str | None:
    """What a published checkpoint folder lacks, or None; reads names only.

    A folder with neither identity nor manifest is legacy (:func:`is_legacy`), not damaged.
    """
    has = {name: os.path.isfile(os.path.join(folder, name))
           for name in (METADATA_FILE, TRAIN_STATE_FILE, IDENTITY_FILE, MANIFEST_FILE)}
    lost = [name for name in (METADATA_FILE, TRAIN_STATE_FILE) if not has[name]]
    if has[IDENTITY_FILE] != has[MANIFEST_FILE]:
        lost.append(IDENTITY_FILE if has[MANIFEST_FILE] else MANIFEST_FILE)
    if not lost:
        return None
    why = {METADATA_FILE: "DCP's index of the shards", TRAIN_STATE_FILE: "the step",
           IDENTITY_FILE: "the run that wrote it", MANIFEST_FILE: "the checksums of its files"}
    return "it has no " + ", no ".join(f"{name} ({why[name]})" for name in lost) + ": deleted or lost after writing"


def is_legacy(folder: str) -> bool:
    """Whether ``folder`` was written before checkpoints carried an identity and a manifest:
    it has neither file (one without the other is damaged: :func:`missing_files`)."""
    return not any(os.path.exists(os.path.join(folder, name)) for name in (IDENTITY_FILE, MANIFEST_FILE))


def _files(folder: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), folder)
            if rel != MANIFEST_FILE:
                out.append(rel)
    return sorted(out)


def write_manifest(folder: str, algorithm: str = CHECKSUM) -> None:
    """Record the size and checksum of every file in ``folder`` (rank 0, after every rank wrote)."""
    files = {rel: {"bytes": os.path.getsize(os.path.join(folder, rel)),
                   algorithm: checksum(os.path.join(folder, rel), algorithm)} for rel in _files(folder)}
    write_json(os.path.join(folder, MANIFEST_FILE), {"version": 1 if algorithm == "sha256" else 2, "files": files})


def _entry(e: dict) -> tuple[int, str, str]:
    algorithm = next(a for a in ALGORITHMS if a in e)  # StopIteration: no known checksum
    return int(e["bytes"]), algorithm, str(e[algorithm])


def verify_manifest(folder: str) -> str | None:
    """Check ``folder`` against its manifest. Returns None when every file is intact, else
    what is wrong (a missing manifest included)."""
    path = os.path.join(folder, MANIFEST_FILE)
    if not os.path.exists(path):
        return f"it has no {MANIFEST_FILE}"
    try:
        with open(path) as f:
            files = json.load(f)["files"]
        expected = {str(rel): _entry(e) for rel, e in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, StopIteration) as e:
        return f"its {MANIFEST_FILE} cannot be read ({type(e).__name__}: {e})"
    for rel, (size, algorithm, digest) in sorted(expected.items()):
        full = os.path.join(folder, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        actual = os.path.getsize(full)
        if actual != size:
            return f"{rel} has {actual} bytes, the manifest says {size} (truncated or overwritten)"
        if checksum(full, algorithm) != digest:
            return f"{rel} does not match its {algorithm} in the manifest (the bytes changed after writing)"
    return None


def write_json(path: str, data: Any) -> None:
    """``data`` as JSON at ``path``, atomically (a temporary file, fsync, ``os.replace``)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
