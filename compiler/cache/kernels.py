"""Inductor's built C++ kernels as one blob: collected from one Inductor cache
directory, installed into another at the same relative paths.

Note [Kernels in the compile cache]

Background
    On CPU, Inductor builds each kernel into a shared library under its cache
    directory, at ``<dir>/<key[1:3]>/<key>.so`` or ``<key>.main.so`` (``.o`` files
    next to it when the kernel is compiled in two parts), where ``key`` hashes the
    kernel's source and its compile command (``torch._inductor.codecache.write``
    and ``CppCodeCache.load_async``). Before it builds, Inductor looks for the
    target file and loads it when present. ``torch.compiler.save_cache_artifacts``
    holds the generated code, not these libraries, so without them a warm start in a
    fresh Inductor directory would rebuild every kernel with the C++ compiler.

Algorithm
    - :func:`collect_kernels` packs the ``*.so`` and ``*.o`` files under a root
      (with ``keys``/``since``: those of the given kernel keys, and those created
      after a :func:`kernel_snapshot`, such as the libraries Inductor builds once
      per process to probe the CPU's vector ISA) into a blob: a
      magic line, a JSON index (relative path, size, sha256 per file) and the
      files' bytes. A damaged library (Note [Damaged cache artifacts]) is left out.
    - :func:`install_kernels` writes each file of a blob under another root at its
      relative path, atomically, skipping files that exist (never overwriting).
      Inductor then finds them where it would have built them.
    - A blob names only relative paths inside the root, with a kernel suffix;
      anything else (absolute, ``..``) makes :func:`install_kernels` raise
      :class:`KernelBlobError` before writing anything.

Notes
    Installing kernels is installing code that the training process will load:
    a blob is installed only from a compile-cache folder no other user can write
    (Note [Compile cache]) or from a publication signed by a rank of this job
    (Note [Share secret]), and its paths are checked before anything is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path, PurePosixPath
from typing import Iterable

from .artifacts import _elf_problem

__all__ = ["KERNEL_SUFFIXES", "KernelBlobError", "collect_kernels", "install_kernels", "kernel_files", "kernel_names",
           "kernel_snapshot", "merge_kernels"]

KERNEL_SUFFIXES = (".so", ".o")
_MAGIC = b"distcompile-kernels 1\n"


class KernelBlobError(ValueError):
    """A kernel blob that is not in :func:`collect_kernels`' format."""


def kernel_snapshot(root: str | os.PathLike) -> set[str]:
    """The relative paths of the kernel files under ``root`` now (for ``collect_kernels(since=...)``)."""
    root = Path(root)
    if not root.is_dir():
        return set()
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.suffix in KERNEL_SUFFIXES}


def kernel_files(root: str | os.PathLike, keys: Iterable[str] | None = None,
                 since: set[str] | None = None) -> list[Path]:
    """The whole kernel files under ``root``, sorted: all of them; or, with ``keys`` or
    ``since``, those of the kernel ``keys`` and those not in the snapshot ``since``."""
    root = Path(root)
    if not root.is_dir():
        return []
    if keys is None and since is None:
        found = {p for p in root.rglob("*") if p.suffix in KERNEL_SUFFIXES}
    else:
        found = {p for key in set(keys or ()) if len(key) >= 3 for p in (root / key[1:3]).glob(f"{key}.*")
                 if p.suffix in KERNEL_SUFFIXES}
        if since is not None:
            found |= {root / rel for rel in kernel_snapshot(root) - since}
    return sorted(p for p in found if p.is_file() and (p.suffix != ".so" or _elf_problem(p) is None))


def collect_kernels(root: str | os.PathLike, keys: Iterable[str] | None = None, since: set[str] | None = None
                    ) -> bytes:
    """The kernel files under ``root`` as one blob (see :func:`kernel_files` for which);
    ``b""`` when there are none."""
    root = Path(root)
    index, datas = [], []
    for path in kernel_files(root, keys, since):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        index.append([path.relative_to(root).as_posix(), len(data), hashlib.sha256(data).hexdigest()])
        datas.append(data)
    if not index:
        return b""
    return _MAGIC + json.dumps(index).encode() + b"\n" + b"".join(datas)


def _parse(blob: bytes) -> list[tuple[str, bytes]]:
    if not blob:
        return []
    if not blob.startswith(_MAGIC):
        raise KernelBlobError("not a kernel blob (bad magic line)")
    end = blob.find(b"\n", len(_MAGIC))
    try:
        index = json.loads(blob[len(_MAGIC):end].decode()) if end > 0 else None
        if not isinstance(index, list):
            raise ValueError("no index line")
    except (ValueError, UnicodeDecodeError) as e:
        raise KernelBlobError(f"unreadable index ({e})") from None
    files, offset = [], end + 1
    for entry in index:
        rel, size, digest = entry
        rel_path = PurePosixPath(rel)
        if rel_path.is_absolute() or ".." in rel_path.parts or rel_path.suffix not in KERNEL_SUFFIXES:
            raise KernelBlobError(f"{rel!r} is not a kernel file's path inside the cache directory")
        data = blob[offset:offset + size]
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            raise KernelBlobError(f"{rel} is truncated or does not match its checksum")
        files.append((rel, data))
        offset += size
    if offset != len(blob):
        raise KernelBlobError(f"{len(blob) - offset} bytes after the last file")
    return files


def kernel_names(blob: bytes) -> set[str]:
    """The relative paths of the files in ``blob``."""
    return {rel for rel, _ in _parse(blob)}


def merge_kernels(*blobs: bytes) -> bytes:
    """One blob with every file of ``blobs`` once (the first blob naming a path wins)."""
    files: dict[str, bytes] = {}
    for blob in blobs:
        for rel, data in _parse(blob):
            files.setdefault(rel, data)
    if not files:
        return b""
    index = [[rel, len(data), hashlib.sha256(data).hexdigest()] for rel, data in sorted(files.items())]
    return _MAGIC + json.dumps(index).encode() + b"\n" + b"".join(files[rel] for rel, _, _ in index)


def install_kernels(blob: bytes, root: str | os.PathLike) -> list[Path]:
    """Write the files of ``blob`` under ``root`` at their relative paths, atomically; a
    file that exists is left as it is. Returns the files written.

    Raises:
        KernelBlobError: ``blob`` is not in :func:`collect_kernels`' format (nothing written).
        OSError: a file could not be written (those written before stay).
    """
    root = Path(root)
    written = []
    for rel, data in _parse(blob):
        path = root / rel
        if path.exists():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o755)
            if path.exists():  # another process installed it meanwhile
                os.unlink(tmp)
                continue
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        written.append(path)
    return written
