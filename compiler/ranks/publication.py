"""A shared compile's publication in the store: written in parts under a signed header, read
back and checked before anything of it is loaded (Note [Shared compile] in ``compiler.ranks.share``,
Note [Share secret], Note [Checked artifact keys]).

A publication under ``key`` is ``key/part0`` ... ``key/partN`` (the payload: the artifacts of
``save_cache_artifacts`` followed by the kernel blob) and the header at ``key`` itself, written
last: ``failed``, ``bytes``, ``artifacts`` (where the kernels start), ``sha256``, ``parts`` and
``mac``. The store is open to anything on the network, so :func:`receive` assumes nothing of
what it reads: any field may be missing, of another type, or written by someone else.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from ..cache.artifact_keys import artifact_problem
from ..cache.kernels import KernelBlobError, kernel_names
from .share_secret import ShareSecret

__all__ = ["CHUNK", "Received", "publish", "receive"]

CHUNK = 4 << 20  # a publication goes in parts: TCPStore's server refuses values over 8 MiB
_MAX_PARTS = 1 << 16


@dataclass
class Received:
    """What :func:`receive` found. ``status``: ``ok`` (``artifacts`` and ``kernels`` may be
    loaded), ``failed`` or ``freed`` (nothing to load), ``damaged`` (checksum), ``unsigned``
    (the MAC does not verify) or ``refused`` (``problem``: an unsafe key or path)."""

    status: str
    artifacts: bytes = b""
    kernels: bytes = b""
    problem: str = ""


def publish(store: Any, key: str, artifacts: bytes, kernels: bytes, secret: ShareSecret,
            failed: bool = False) -> tuple[list[str], Exception | None]:
    """Write a publication under ``key``. Returns the store keys written (to free later) and the
    error that made it publish a ``failed`` header instead of the payload (None when it did not)."""
    payload = artifacts + kernels if artifacts else b""  # kernels without the code that loads them are no use
    parts = [payload[i:i + CHUNK] for i in range(0, len(payload), CHUNK)]
    header: dict[str, Any] = {"failed": failed, "bytes": len(payload), "artifacts": len(artifacts),
                              "sha256": hashlib.sha256(payload).hexdigest(), "parts": len(parts)}
    written: list[str] = []
    error = None
    try:
        for n, part in enumerate(parts):
            written.append(f"{key}/part{n}")
            store.set(f"{key}/part{n}", part)
    except Exception as e:  # noqa: BLE001 - the others must still hear from this rank
        error = e
        header.update(failed=True, parts=0)
    header["mac"] = secret.mac(key, header, payload)
    store.set(key, json.dumps(header))  # last: a rank that sees it finds every part
    written.append(key)
    return written, error


def receive(store: Any, key: str, secret: ShareSecret) -> Received:
    """The publication under ``key`` (its header is there), checked: checksum, then MAC, then
    every artifact key and kernel path; nothing is written or loaded here."""
    try:
        header = json.loads(store.get(key))
    except ValueError:
        header = {}
    header = header if isinstance(header, dict) else {}
    if header.get("failed") or header.get("freed"):
        return Received("failed" if header.get("failed") else "freed")
    n_parts = header.get("parts", 0)
    part_keys = [f"{key}/part{n}" for n in range(n_parts if isinstance(n_parts, int) and n_parts < _MAX_PARTS else 0)]
    present = not part_keys or store.check(part_keys)  # not freed in the meantime
    payload = b"".join(store.get(k) for k in part_keys) if present else None
    if payload is None or len(payload) != header.get("bytes") or hashlib.sha256(
            payload).hexdigest() != header.get("sha256"):
        return Received("damaged")
    if not secret.verify(key, header, payload):
        return Received("unsigned")
    split = header.get("artifacts", len(payload))
    split = split if isinstance(split, int) and 0 <= split <= len(payload) else len(payload)
    artifacts, kernels = payload[:split], payload[split:]
    problem = artifact_problem(artifacts)
    if problem is None:
        try:
            kernel_names(kernels)
        except KernelBlobError as e:
            problem = f"a kernel blob that cannot be installed ({e})"
    if problem is not None:
        return Received("refused", problem=problem)
    return Received("ok", artifacts, kernels)
