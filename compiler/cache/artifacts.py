"""Damaged kernels in Inductor's on-disk cache: found, removed, rebuilt.

Note [Damaged cache artifacts]

Background
    On CPU, Inductor builds each kernel into a shared library (``*.so``) in its cache
    directory and, on a later compile, loads the file if it exists, without looking at
    it. A file truncated by a full disk, a killed copy or a broken sync fails to load on
    every compile, and Inductor never rebuilds it: without a check, each partition would
    fall back to eager on every restart.

Algorithm
    - :func:`damaged_kernels` checks every ``*.so`` without loading it: the ELF header,
      the header tables and every loadable segment must lie inside the file.
    - :meth:`compiler.cache.store.CompileCache.load` removes the damaged kernels under
      ``cache_dir/inductor`` before the first compile (one warning), installs the
      entry's copy where it has one, and Inductor rebuilds the others from the source
      it keeps beside them.
    - A compile that still fails naming a damaged or missing kernel under Inductor's
      cache directory (``TORCHINDUCTOR_CACHE_DIR`` chosen by the user, or no
      ``cache_dir``) removes the damaged kernels and falls back to eager; the next start
      rebuilds them (``compiler.graph.partition``).

Notes
    The rebuild happens in a fresh process, not in the one that failed: there,
    Inductor's rebuild from cached source fails with a C++ compile error (the vector
    ISA flags are missing from the command), and a retry with the caches off fails the
    same way at the first backward (seen on torch 2.13, CPU).
"""

from __future__ import annotations

import logging
import os
import re
import struct
import sys
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["damaged_kernels", "remove_damaged_kernels", "damaged_kernel_in", "inductor_cache_dir"]

_ELF = b"\x7fELF"
_PATH = re.compile(r"(/[^\s'\":]+\.so)\b")


def _elf_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a whole shared library, or None if its tables fit."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(64)
            if not head.startswith(_ELF):
                return f"no ELF header ({size} bytes)" if sys.platform.startswith("linux") else None
            if len(head) < 64 or head[4] != 2:  # only 64-bit ELF is checked further
                return None if len(head) == 64 else f"truncated ELF header ({size} bytes)"
            end = "<" if head[5] == 1 else ">"
            phoff, shoff = struct.unpack_from(end + "QQ", head, 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from(end + "HHHH", head, 0x36)
            needed = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
            if needed > size:
                return f"truncated ({size} bytes, its headers reach byte {needed})"
            f.seek(phoff)
            table = f.read(phentsize * phnum)
    except OSError as e:
        return f"unreadable ({e.strerror})"
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from(end + "IIQQQQ", table, i * phentsize)
        if p_type == 1 and p_offset + p_filesz > size:  # PT_LOAD
            return f"truncated ({size} bytes, a segment reaches byte {p_offset + p_filesz})"
    return None


def damaged_kernels(root: str | os.PathLike) -> list[tuple[Path, str]]:
    """Every ``*.so`` under ``root`` that cannot be a whole library, with the reason."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.rglob("*.so")):
        problem = _elf_problem(path)
        if problem is not None:
            found.append((path, problem))
    return found


def remove_damaged_kernels(root: str | os.PathLike) -> list[Path]:
    """Remove the damaged kernels under ``root`` (one warning); Inductor rebuilds them
    from their cached source on the next compile. Returns the removed files."""
    removed = []
    for path, problem in damaged_kernels(root):
        try:
            path.unlink()
        except OSError as e:
            log.warning("Inductor kernel %s is damaged (%s) but could not be removed (%s).", path, problem, e)
            continue
        removed.append((path, problem))
    if removed:
        shown = "; ".join(f"{p.name}: {why}" for p, why in removed[:3])
        more = f"; and {len(removed) - 3} more" if len(removed) > 3 else ""
        log.warning("Removed %d damaged Inductor kernel(s) from %s, to be rebuilt from their cached source: %s%s",
                    len(removed), root, shown, more)
    return [p for p, _ in removed]


def inductor_cache_dir() -> Path:
    """Inductor's cache directory for this process (``TORCHINDUCTOR_CACHE_DIR`` or its default)."""
    from .._torch_internals import inductor_cache_dir as current

    return Path(current())


def damaged_kernel_in(error: BaseException, root: str | os.PathLike | None = None) -> Path | None:
    """The kernel file under ``root`` (Inductor's cache directory by default) that
    ``error`` or an error in its chain names and that is damaged or gone; else None."""
    root = Path(root) if root is not None else inductor_cache_dir()
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for match in _PATH.findall(str(e)):
            path = Path(match)
            try:
                path.resolve().relative_to(root.resolve())
            except ValueError:
                continue
            if not path.exists() or _elf_problem(path) is not None:
                return path
        e = e.__cause__ or e.__context__
    return None
