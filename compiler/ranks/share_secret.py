"""The job's share secret: the key that signs shared compiles, which never goes through the store.

Note [Share secret]

Background
    A shared compile (Note [Shared compile]) moves compiled code between ranks through the
    store, which anything reaching its port can read and write; a checksum kept there
    proves nothing. A rank loads another rank's compile only with a MAC made with a secret
    the store never sees.

Algorithm
    The secret, first found wins:
    - ``DISTCOMPILE_SHARE_SECRET_FILE``: a regular file of this user, not a link, that no
      group or other may read or write (``compiler.cache.trust.read_secret``); anything else
      raises :class:`ShareSecretError` with the fix, since the job trusts its readers.
    - ``DISTCOMPILE_SHARE_SECRET``: the secret itself.
    - Otherwise the ranks of one node make one: 32 random bytes in ``runtime_dir()``,
      named by a digest of what they share and other jobs do not (torchrun's run id,
      the parent process, the store's address). Each rank writes a candidate with
      ``write_private`` and ``os.link``-s it to that name: the first wins, the others
      read a whole file. No secret within ``timeout_s``: the rank compiles for itself.
    - Scope ``HMAC(secret, "scope")`` is part of every claim and publication key, so only
      ranks of one secret share; without a cluster secret each node is its own scope.
    - The MAC is HMAC-SHA256 over the store key, the header fields and the payload, each
      length-prefixed, so no field can be moved into another.

Notes
    Scope tags are public but one-way. The node's secret file stays in the runtime
    folder; ``DISTCOMPILE_SHARE_SECRET`` is visible to this user's own processes only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from ..cache.trust import UnsafePath, read_private, read_secret, runtime_dir, write_private

log = logging.getLogger(__name__)

__all__ = ["ENV_FILE", "ENV_VALUE", "ShareSecret", "ShareSecretError", "announce_scope", "cluster_secret", "job_secret",
           "node_secret", "note_other_scopes"]

ENV_FILE = "DISTCOMPILE_SHARE_SECRET_FILE"
ENV_VALUE = "DISTCOMPILE_SHARE_SECRET"
SECRET_BYTES = 32


class ShareSecretError(ValueError):
    """The secret the user pointed to cannot be used."""


@dataclass(frozen=True)
class ShareSecret:
    """A job's share secret. ``source``: ``file`` or ``env`` (every rank of the job holds
    it: a cluster secret) or ``node`` (made by the ranks of this node)."""

    key: bytes = field(repr=False)
    source: str

    @property
    def cluster(self) -> bool:
        return self.source != "node"

    @property
    def scope(self) -> str:
        return hmac.new(self.key, b"scope", hashlib.sha256).hexdigest()[:16]

    def mac(self, store_key: str, header: dict[str, Any], payload: bytes) -> str:
        """HMAC-SHA256 of a publication: its store key, its header (without ``mac``), its payload."""
        fields = {k: v for k, v in header.items() if k != "mac"}
        h = hmac.new(self.key, digestmod=hashlib.sha256)
        for part in (store_key.encode(), json.dumps(fields, sort_keys=True).encode(), payload):
            h.update(len(part).to_bytes(8, "big"))
            h.update(part)
        return h.hexdigest()

    def verify(self, store_key: str, header: dict[str, Any], payload: bytes) -> bool:
        """Whether ``header["mac"]`` was made with this secret for this key, header and payload."""
        got = header.get("mac")
        return isinstance(got, str) and hmac.compare_digest(got, self.mac(store_key, header, payload))


def job_secret(store: Any = None, timeout_s: float = 10.0) -> ShareSecret | None:
    """This rank's share secret (see the Note): the cluster's, else this node's; None when
    neither can be had (the rank then compiles for itself).

    Raises:
        ShareSecretError: ``DISTCOMPILE_SHARE_SECRET_FILE`` names a file that cannot be used.
    """
    return cluster_secret() or node_secret(store, timeout_s)


def cluster_secret() -> ShareSecret | None:
    """The secret every rank of the job holds (``DISTCOMPILE_SHARE_SECRET_FILE``, else
    ``DISTCOMPILE_SHARE_SECRET``); None when neither is set.

    Raises:
        ShareSecretError: ``DISTCOMPILE_SHARE_SECRET_FILE`` names a file that cannot be used.
    """
    path = os.environ.get(ENV_FILE)
    if path:
        try:
            key = read_secret(path)
        except UnsafePath as e:
            raise ShareSecretError(
                f"{ENV_FILE}={path}: {e}: every rank trusts compiled code signed with this secret, so only you may "
                f"read it. Run chmod 600 {path} (and make it a file of yours, not a link), or unset {ENV_FILE} "
                f"(ranks then share within each node only; compile.share=false turns sharing off).") from None
        except OSError as e:
            raise ShareSecretError(
                f"{ENV_FILE}={path} cannot be read ({e.strerror}): the ranks need it to sign and check shared "
                f"compiles. Point it at a private file every node can read, or unset it (ranks then share within "
                f"each node only; compile.share=false turns sharing off).") from None
        if not key.strip():
            raise ShareSecretError(f"{ENV_FILE}={path} is empty: a share secret must be hard to guess. Write 32 "
                                   f"random bytes into it (head -c 32 /dev/urandom > {path}), or unset it.")
        return ShareSecret(key, "file")
    value = os.environ.get(ENV_VALUE)
    return ShareSecret(value.encode(), "env") if value else None


def _node_name(store: Any) -> str:
    """What the ranks of this node, and no other job, have in common (see the Note)."""
    parts = [os.environ.get("TORCHELASTIC_RUN_ID", ""), str(os.getppid()),
             f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"]
    inner = getattr(store, "underlying_store", store)
    for attr in ("host", "port"):
        value = getattr(inner, attr, None)
        if isinstance(value, (str, int)):
            parts.append(str(value))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def node_secret(store: Any = None, timeout_s: float = 10.0) -> ShareSecret | None:
    """The secret of this node's ranks, made by the first of them to get here; None when none
    is readable within ``timeout_s`` (logged)."""
    try:
        path = runtime_dir() / f"share-secret-{_node_name(store)}"
    except OSError as e:
        log.warning("Shared compile: no private folder for this node's share secret (%s); this rank compiles for "
                    "itself. Set %s to a private file (chmod 600), or compile.share=false to stop sharing.", e,
                    ENV_FILE)
        return None
    deadline = time.monotonic() + timeout_s
    while True:
        key = read_private(path)
        if key is not None and len(key) == SECRET_BYTES:
            return ShareSecret(key, "node")
        if not os.path.lexists(path):
            _offer(path)
            if os.path.lexists(path):
                continue  # this rank's secret, or another's: read it now
        if time.monotonic() >= deadline:
            log.warning("Shared compile: the node's share secret %s is not a private %d-byte file of this user after "
                        "%.0fs; this rank compiles for itself. Remove the file, or set %s to a private file "
                        "(chmod 600).", path, SECRET_BYTES, timeout_s, ENV_FILE)
            return None
        time.sleep(0.05)


def _offer(path: os.PathLike) -> None:
    """Write a candidate secret privately and link it to ``path`` unless another rank's is there."""
    candidate = f"{os.fspath(path)}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        write_private(candidate, secrets.token_bytes(SECRET_BYTES))
        os.link(candidate, path)
    except FileExistsError:
        pass  # another rank of this node was first: its secret is read
    except OSError as e:
        log.debug("could not offer a share secret at %s: %s", path, e)
        time.sleep(0.05)
    finally:
        try:
            os.unlink(candidate)
        except OSError:
            pass


def announce_scope(store: Any, prefix: str, rank: int, secret: ShareSecret) -> None:
    """Put this rank's scope under ``prefix`` (scopes are not secret: see the Note)."""
    store.set(f"{prefix}/scope/{rank}", secret.scope)


def note_other_scopes(store: Any, prefix: str, rank: int, ranks: list[int], secret: ShareSecret) -> bool:
    """Once every rank's scope is in the store, one INFO line if some hold another secret
    (another node's, without a cluster secret): sharing across nodes is then off. Returns
    whether the comparison was made (False: a rank has not announced its scope yet)."""
    keys = [f"{prefix}/scope/{r}" for r in ranks]
    if not store.check(keys):
        return False
    others = [r for r, k in zip(ranks, keys) if store.get(k).decode(errors="replace") != secret.scope]
    if others:
        log.info(
            "Shared compile, rank %d: rank(s) %s are on another node, and without a cluster secret each node shares "
            "compiles only within itself; to share across nodes set %s to a private file (chmod 600) on a shared "
            "filesystem, or %s, for every rank", rank, others, ENV_FILE, ENV_VALUE)
    return True
