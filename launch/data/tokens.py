"""Real data: a flat file of token ids (``data=tokens``), read a window at a time.

Note [Token files]

Background
    nanoGPT's data format: one flat array of token ids (``uint16`` when the vocabulary
    fits in 65,536 ids, else ``uint32``), no header, read without loading it up front.
    ``python -m launch.prepare_data`` writes one, with a sidecar ``PATH.json`` (dtype,
    vocab_size, tokens, tokenizer) that this module reads.

Algorithm
    - Split: the last ``floor(n * data.val_fraction)`` ids are validation, the rest
      train; no window crosses the boundary, so no validation token is trained on.
    - Train: the train region is cut into ``world_size`` contiguous slices, one per
      rank. Rank ``r``'s batch at ``step`` is ``batch_size`` windows of ``seq_len + 1``
      ids with starts drawn in its slice by a generator seeded with
      ``stream_seed(seed, r, step)``. Validation (:meth:`TokenFile.eval_batch`) draws
      the same way over the whole validation region with a salted seed.
    - So a batch is a pure function of (seed, step, rank, world size): no loader state
      to checkpoint, and a resumed run replays exactly the batches it would have seen.

Notes
    - Windows are read with ``os.pread`` from a descriptor opened once, and the size is
      checked before each batch: a file rewritten under a running job stops it with
      :class:`TokenFileChanged`, where a shrunk memory map would kill the workers with
      SIGBUS and no word. A file replaced by a rename keeps being read as it was.
    - :func:`fingerprint` (size and a sha256 of :data:`SAMPLE_CHUNKS` sampled blocks)
      goes into each checkpoint's identity; a resume on a changed file is refused
      unless ``train.allow_data_change=true``. The mtime is left out, so a copy resumes.
    - :func:`check_token_data` refuses a bad file before any process group starts
      (missing, empty, a partial id, too short for one window, ids past
      ``model.vocab_size``, a sidecar that disagrees with the settings). The id scan
      samples files past :data:`SCAN_LIMIT` ids; every batch checks its own ids too.
    - A file whose dtype nothing declares is read as ``uint16`` unless it looks like
      ``uint32`` (Note [Undeclared dtype]).

Note [Undeclared dtype]

Background
    A token file has no header, and the same bytes read with the wrong width are valid
    ids of garbage. A little-endian ``uint32`` file read as ``uint16`` gives each id's
    low half, then its high half: for ids below 65,536 every other id is 0, all ids fit
    the vocabulary, and the job would train on it and exit 0.

Algorithm
    Only when neither a sidecar nor ``data.dtype`` names the dtype. A size that is not a
    multiple of 4 is ``uint16``. Else the file is sampled as :func:`fingerprint` does, as
    ``uint16`` pairs (low, high), and refused as ``uint32`` when every high half is at
    most ``max(3, (model.vocab_size - 1) >> 16)`` while at least :data:`MIN_PAIRS` low
    halves are larger (a ``uint32`` id's high half is at most 3 for tokenizers up to
    262,144 ids).

Notes
    Text tokenized to ``uint16`` spreads its ids over the vocabulary, so every odd id
    being 3 or less does not happen; a near-empty file shows fewer than
    :data:`MIN_PAIRS` and stays ``uint16``. A refusal names both fixes, so a rare false
    one costs one setting.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np
import torch

from ..config.schema import ConfigError, JobConfig
from .source import stream_seed

__all__ = ["DTYPES", "SCAN_LIMIT", "SAMPLE_CHUNKS", "MIN_PAIRS", "TokenFile", "TokenFileChanged", "fingerprint",
           "read_sidecar", "max_id", "check_token_data"]

DTYPES = ("uint16", "uint32")
SCAN_LIMIT = 1 << 28  # ids scanned in full (512 MiB of uint16); past it, a sample
SAMPLE_CHUNKS = 64
MIN_PAIRS = 8  # pairs with a low half above the bound before small high halves count as a uint32 sign
_HIGH_HALF = 3  # the high halves of uint32 ids of tokenizers up to 262,144 ids
_CHUNK = 1 << 22  # ids per read of the scan
_EVAL_SALT = 0x5DEECE66D  # keeps the validation draws apart from the training draws of the same step
_BLOCK = 1 << 16  # bytes per sampled block of the fingerprint


class TokenFileChanged(RuntimeError):
    """The token file changed size under the running job; one line on every rank, exit 1."""

    exit_code = 1
    every_rank = True


def fingerprint(path: str) -> str:
    """``"<bytes> bytes, sampled sha256 <16 hex>"``: the size and a hash of SAMPLE_CHUNKS
    evenly spaced 64 KiB blocks (the first and the last included)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for i in range(SAMPLE_CHUNKS):
            f.seek(max(0, (size - _BLOCK) * i // max(SAMPLE_CHUNKS - 1, 1)))
            h.update(f.read(_BLOCK))
    return f"{size} bytes, sampled sha256 {h.hexdigest()[:16]}"


def read_sidecar(path: str) -> dict[str, Any] | None:
    """``PATH.json`` as written by ``launch.prepare_data``; None when there is none."""
    side = path + ".json"
    if not os.path.exists(side):
        return None
    try:
        with open(side) as f:
            meta = json.load(f)
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.path={path!r}: its sidecar {side} cannot be read ({type(e).__name__}: {e}); it "
                          "holds the file's dtype and vocabulary. Write it again with python -m launch.prepare_data, "
                          "or delete it and set data.dtype.") from None
    return meta


class TokenFile:
    """The token file ``path``: per-rank training batches and validation batches
    (Note [Token files]).

    Args:
        path: the flat file of ids.
        seed: ``train.seed``.
        dtype: ``uint16`` or ``uint32``; None: the sidecar's, else ``uint16`` unless the
            file looks like ``uint32`` (Note [Undeclared dtype]).
        val_fraction: the share of the file, at its end, kept for validation.
        vocab_size: when given, every batch is checked to hold ids below it.

    Raises:
        ConfigError: the file is missing or empty, its size is not a whole number of
            ids, the dtype disagrees with the sidecar or is not one of :data:`DTYPES`, or
            nothing declares it and the file looks like ``uint32``.
    """

    def __init__(self, path: str, *, seed: int, dtype: str | None = None, val_fraction: float = 0.1,
                 vocab_size: int | None = None) -> None:
        self.path, self.seed, self.vocab_size = path, seed, vocab_size
        self.meta = read_sidecar(path)
        self.dtype = _dtype(path, dtype, self.meta) or _undeclared_dtype(path, vocab_size)
        self.tokens = _count(path, self.dtype)
        self.val_tokens = int(self.tokens * val_fraction)
        self.train_tokens = self.tokens - self.val_tokens
        self._ids: np.ndarray | None = None
        self._fd: int | None = None
        self._bytes = self.tokens * np.dtype(self.dtype).itemsize

    @property
    def ids(self) -> np.ndarray:
        """The whole file as a read-only memmap (opened on first use)."""
        if self._ids is None:
            self._ids = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._ids

    def train_slice(self, rank: int, world_size: int) -> tuple[int, int]:
        """``[start, end)`` of rank's slice of the train region."""
        size = self.train_tokens // world_size
        return rank * size, (rank + 1) * size

    def batch(self, step: int, rank: int, world_size: int, batch_size: int, seq_len: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank's training batch at ``step``: (inputs, targets), int64 ``(batch_size, seq_len)``."""
        lo, hi = self.train_slice(rank, world_size)
        return self._windows(stream_seed(self.seed, rank, step), lo, hi, batch_size, seq_len)

    def eval_batch(self, step: int, rank: int, world_size: int, batch_size: int, seq_len: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """A validation batch from the region at the end of the file, a pure function of its arguments."""
        return self._windows(stream_seed(self.seed ^ _EVAL_SALT, rank, step), self.train_tokens, self.tokens,
                             batch_size, seq_len)

    def _windows(self, seed: int, lo: int, hi: int, batch_size: int, seq_len: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if hi - lo < seq_len + 1:
            raise ValueError(f"{self.path}: a region of {hi - lo} ids holds no window of seq_len + 1 = {seq_len + 1}")
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(lo, hi - seq_len, (batch_size,), generator=g).tolist()
        rows = torch.from_numpy(np.stack([self._read(s, seq_len + 1) for s in starts]).astype(np.int64))
        if self.vocab_size is not None and int(rows.max()) >= self.vocab_size:
            raise _past_vocab(self.path, int(rows.max()), None, self.vocab_size, self.meta)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


    def _read(self, start: int, count: int) -> np.ndarray:
        """``count`` ids from ``start``, read with ``os.pread``; :class:`TokenFileChanged` when the
        file is not the size it had when the job opened it."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        item = np.dtype(self.dtype).itemsize
        size = os.fstat(self._fd).st_size
        data = os.pread(self._fd, count * item, start * item) if size == self._bytes else b""
        if len(data) != count * item:
            raise TokenFileChanged(
                f"data.path={self.path!r} changed under the running job: it had {self._bytes} bytes when the job "
                f"started and has {size} now. A token file must not be rewritten while a job reads it (write the "
                "new one elsewhere and rename it into place). Restart the job; a resume on the changed file is "
                "refused unless train.allow_data_change=true.")
        return np.frombuffer(data, dtype=self.dtype)


def _dtype(path: str, dtype: str | None, meta: dict[str, Any] | None) -> str | None:
    """The dtype the settings or the sidecar declare; None when neither does."""
    side = (meta or {}).get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"data.dtype={dtype!r} is not one of {', '.join(DTYPES)}: a token file holds unsigned "
                          "16-bit ids (vocabularies up to 65,536) or 32-bit ones. Use data.dtype=uint16 or "
                          "data.dtype=uint32, or leave it null to take the sidecar's.")
    if dtype is not None and side is not None and dtype != side:
        raise ConfigError(f"data.dtype={dtype} but the sidecar {path}.json says the file holds {side} ids: read "
                          f"with the wrong dtype every id is garbage. Set data.dtype={side}, or leave it null.")
    chosen = dtype or side
    if chosen is not None and chosen not in DTYPES:
        raise ConfigError(f"the sidecar {path}.json says dtype {chosen!r}, not one of {', '.join(DTYPES)}. Write the "
                          "file again with python -m launch.prepare_data.")
    return chosen


def _undeclared_dtype(path: str, vocab_size: int | None) -> str:
    """``uint16`` for a file whose dtype nothing declares, unless it looks like ``uint32``
    (Note [Undeclared dtype]): then :class:`ConfigError` with the fix."""
    _count(path, "uint16")  # missing, empty, an odd size: refused as before
    size = os.path.getsize(path)
    if size % 4:
        return "uint16"  # not whole uint32 ids
    pairs = _sample(path, size).reshape(-1, 2).astype(np.int64)  # little-endian uint32: (low, high)
    low, high = pairs[:, 0], pairs[:, 1]
    bound = max(_HIGH_HALF, 0 if vocab_size is None else (vocab_size - 1) >> 16)
    top = int(high.max())
    if top > bound or int(np.count_nonzero(low > bound)) < MIN_PAIRS:
        return "uint16"
    sign = ("every other id is 0 (the high halves of uint32 ids below 65,536)" if top == 0 else
            f"every other id is at most {top} (the high halves of uint32 ids below {(top + 1) << 16:,})")
    raise ConfigError(f"data.path={path!r} does not say its dtype (no sidecar {path}.json, data.dtype=null) and looks "
                      f"like uint32 ids, not nanoGPT's uint16: read as uint16, {sign}, so the job would train on "
                      "garbage. Set data.dtype=uint32 (or data.dtype=uint16 if it does hold 16-bit ids), or prepare it "
                      "again with python -m launch.prepare_data, which writes the sidecar with its dtype.")


def _sample(path: str, size: int) -> np.ndarray:
    """The file as uint16, or SAMPLE_CHUNKS evenly spaced blocks of it (the first and the
    last included, each a whole number of uint32 ids) when it is larger than their sum."""
    with open(path, "rb") as f:
        if size <= SAMPLE_CHUNKS * _BLOCK:
            return np.frombuffer(f.read(), dtype=np.uint16)
        blocks = []
        for i in range(SAMPLE_CHUNKS):
            f.seek((size - _BLOCK) * i // (SAMPLE_CHUNKS - 1) // 4 * 4)
            blocks.append(f.read(_BLOCK))
    return np.frombuffer(b"".join(blocks), dtype=np.uint16)


def _count(path: str, dtype: str) -> int:
    """The number of ids in the file, after the checks that need only its size."""
    if not os.path.isfile(path):
        why = "is a folder" if os.path.isdir(path) else "does not exist"
        raise ConfigError(f"data.path={path!r} {why}: data=tokens reads a flat file of token ids. Make one with "
                          "`python -m launch.prepare_data INPUT.txt OUT` and set data.path=OUT (relative paths are "
                          "from the folder the job starts in), or use data=synthetic.")
    size, width = os.path.getsize(path), np.dtype(dtype).itemsize
    if size == 0:
        raise ConfigError(f"data.path={path!r} is empty: there are no tokens to train on. Prepare it again from a "
                          "non-empty text with python -m launch.prepare_data.")
    if size % width:
        raise ConfigError(f"data.path={path!r} has {size} bytes, not a multiple of {width} (the size of one "
                          f"{dtype} id): the file was written with another dtype, or cut short. Set data.dtype to "
                          "the one it was written with (uint16 or uint32), or prepare it again.")
    return size // width


def max_id(ids: np.ndarray, limit: int = SCAN_LIMIT, chunks: int = SAMPLE_CHUNKS, chunk: int = _CHUNK
           ) -> tuple[int, int, bool]:
    """The largest id and its position, over the whole array when it holds at most
    ``limit`` ids, else over ``chunks`` evenly spaced chunks of ``chunk`` ids.

    Returns:
        (largest id, its index, whether every id was read).
    """
    n = len(ids)
    chunk = max(1, min(chunk, n))
    if n <= limit:
        starts, full = range(0, n, chunk), True
    else:
        starts, full = sorted({int(i) for i in np.linspace(0, n - chunk, chunks)}), False
    best, where = -1, 0
    for s in starts:
        part = ids[s:s + chunk]
        i = int(np.argmax(part))
        if int(part[i]) > best:
            best, where = int(part[i]), s + i
    return best, where, full


def _past_vocab(path: str, top: int, where: int | None, vocab: int, meta: dict[str, Any] | None) -> ConfigError:
    at = f" (at id position {where:,})" if where is not None else ""
    known = f" The sidecar says the tokenizer has {meta['vocab_size']:,} ids." if meta and "vocab_size" in meta else ""
    return ConfigError(f"data.path={path!r} holds token id {top:,}{at}, but model.vocab_size={vocab}: the embedding "
                       f"has no row for ids past {vocab - 1}.{known} Set model.vocab_size to at least {top + 1} (the "
                       "tokenizer's vocabulary), or prepare the file with the tokenizer the model is sized for.")


def check_token_data(cfg: JobConfig, world_size: int) -> None:
    """``data=tokens``: the file against the settings, before any process group starts
    (Note [Token files]). Raises :class:`ConfigError` naming what is wrong."""
    d, t, vocab = cfg.data, cfg.train, cfg.model.vocab_size
    if d.name != "tokens" or d._target_:
        return
    if not d.path:
        raise ConfigError("data=tokens needs data.path, the token file to train on. Make one with `python -m "
                          "launch.prepare_data INPUT.txt OUT` and set data.path=OUT, or use data=synthetic.")
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={d.val_fraction} is not in (0, 1): it is the share of the file, at its "
                          "end, kept for validation, and both regions need tokens. Use e.g. data.val_fraction=0.1.")
    f = TokenFile(d.path, seed=t.seed, dtype=d.dtype, val_fraction=d.val_fraction, vocab_size=vocab)
    need = t.seq_len + 1
    per_rank = f.train_tokens // world_size
    if per_rank < need:
        raise ConfigError(f"data.path={d.path!r} holds {f.tokens:,} ids: its train region ({f.train_tokens:,}, with "
                          f"data.val_fraction={d.val_fraction}) gives each of {world_size} rank(s) a slice of "
                          f"{per_rank:,}, shorter than one window of train.seq_len + 1 = {need}. Use a longer file, "
                          "a lower train.seq_len or fewer ranks.")
    if f.val_tokens < need:
        raise ConfigError(f"data.path={d.path!r} holds {f.tokens:,} ids: its validation region (the last "
                          f"{f.val_tokens:,}, data.val_fraction={d.val_fraction}) is shorter than one window of "
                          f"train.seq_len + 1 = {need}. Raise data.val_fraction, use a longer file or a lower "
                          "train.seq_len.")
    side_vocab = (f.meta or {}).get("vocab_size")
    if isinstance(side_vocab, int) and side_vocab > vocab:
        raise ConfigError(f"data.path={d.path!r} was tokenized with a vocabulary of {side_vocab:,} ids (its sidecar "
                          f"{d.path}.json), more than model.vocab_size={vocab}: ids past {vocab - 1} have no row in "
                          f"the embedding. Set model.vocab_size={side_vocab} (or larger), or prepare the file with "
                          "the tokenizer the model is sized for.")
    side_tokens = (f.meta or {}).get("tokens")
    if isinstance(side_tokens, int) and side_tokens != f.tokens:
        raise ConfigError(f"data.path={d.path!r} holds {f.tokens:,} {f.dtype} ids but its sidecar says {side_tokens:,}: "
                          "the file was changed or cut short after it was written. Prepare it again with "
                          "python -m launch.prepare_data.")
    top, where, _ = max_id(f.ids)
    if top >= vocab:
        raise _past_vocab(d.path, top, where, vocab, f.meta)
