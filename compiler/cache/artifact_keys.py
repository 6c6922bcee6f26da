"""Whether a ``save_cache_artifacts`` payload may be loaded: every artifact's key checked
before ``torch.compiler.load_cache_artifacts`` writes anything.

Note [Checked artifact keys]

Background
    ``load_cache_artifacts`` writes each artifact of a payload at a path made from its key:
    Inductor's FX graph entries in ``<dir>/fxgraph/<key[1:3]>/<key>/``, AOTAutograd's in
    ``<dir>/aotautograd/<key>/``, Triton's autotuning results at ``<dir>/<key>`` (``<dir>``:
    Inductor's cache directory). ``os.path.join`` drops everything before an absolute key and
    a ``..`` climbs out, so the payload, not the job, would choose where files go (and
    Inductor may unpickle an entry's content as it loads it). torch also
    registers artifact types the toolkit never produces (PGO's code states, precompiled
    frames), which are read back with pickle.

Algorithm
    :func:`artifact_problem` reads the payload's (type, key) pairs without creating or
    unpickling anything (``compiler._torch_internals.artifact_entries``) and accepts it only
    when every artifact

    - is of a type the toolkit's compiles produce (:data:`ARTIFACT_TYPES`: Inductor's and
      AOTAutograd's cache entries, and autotuning results on GPU);
    - has a key that is relative, has no ``..`` part and no NUL byte, and whose target
      (``_torch_internals.artifact_target``) resolves inside Inductor's cache directory.

    One bad artifact rejects the whole payload: the caller loads nothing and compiles.
    Where torch's payload format is not the one the reader knows (feature detection), every
    payload is rejected with one warning that says so.

Notes
    The check runs on shared compiles after their MAC verified (Note [Share secret]) and on
    compile-cache entries after their folder was found safe (Note [Compile cache]); the C++
    kernels that travel with both are checked the same way by ``compiler.cache.kernels``.
"""

from __future__ import annotations

import logging
import os
from pathlib import PurePosixPath

from .. import _torch_internals as _ti

log = logging.getLogger(__name__)

__all__ = ["ARTIFACT_TYPES", "artifact_problem"]

ARTIFACT_TYPES = frozenset({"inductor", "aot_autograd", "autotune"})


def artifact_problem(payload: bytes) -> str | None:
    """Why ``payload`` must not be loaded into Inductor's cache directory (where
    ``load_cache_artifacts`` writes: ``TORCHINDUCTOR_CACHE_DIR`` now), or None."""
    if not payload:
        return None
    if not _ti.artifact_format_known():
        _ti.warn_feature_off_once("Loading shared and cached compile artifacts",
                                  ["torch.utils._appending_byte_serializer format 1"],
                                  "every rank compiles for itself and compile-cache entries are not loaded")
        return "torch's artifact format is not one this toolkit can check"
    try:
        entries = _ti.artifact_entries(payload)
    except ValueError as e:
        return f"a payload that is not torch's artifact format ({e})"
    real_root = os.path.realpath(_ti.inductor_cache_dir())
    for kind, key in entries:
        if kind not in ARTIFACT_TYPES:
            return f"an artifact of type {kind!r}, which the toolkit does not produce"
        parts = PurePosixPath(key).parts
        if not key or "\0" in key or os.path.isabs(key) or ".." in parts:
            return f"the {kind} artifact key {key!r}, which is not a relative path inside the cache directory"
        target = os.path.realpath(_ti.artifact_target(kind, key))
        if os.path.commonpath([real_root, target]) != real_root:
            return f"the {kind} artifact key {key!r}, which would be written at {target}, outside {real_root}"
    return None
