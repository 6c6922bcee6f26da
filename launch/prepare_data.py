"""Turn a local text file into a token file for ``data=tokens`` (Note [Token files]
in ``launch.data.tokens``).

    python -m launch.prepare_data INPUT.txt OUT                  # bytes: ids 0..255
    python -m launch.prepare_data INPUT.txt OUT --tokenizer DIR  # a local HF tokenizer

Writes ``OUT``, a flat array of ids (``uint16`` when the vocabulary has at most
65,536 ids, else ``uint32``), and ``OUT.json``: dtype, vocab_size, tokens,
tokenizer and source, which the job reads to check the file against the model.

The default tokenizer is the bytes themselves (ids 0..255, nothing to download).
``--tokenizer DIR`` loads ``transformers.AutoTokenizer.from_pretrained(DIR,
local_files_only=True)``; the text is encoded in chunks that end at a line break
(no special tokens added), so a token never spans two chunks' lines. Input larger
than one chunk prints a progress line per chunk; a summary line ends the run. A
missing or empty input, or a tokenizer that cannot be loaded, prints ``error: ...``
and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Iterator

import numpy as np

from .config.schema import ConfigError

__all__ = ["prepare", "main"]

_UINT16_VOCAB = 1 << 16


def _chunks(path: str, chunk_bytes: int, text: bool) -> Iterator[tuple[bytes | str, int]]:
    """The input in chunks, with the bytes read so far; text chunks end at a line break."""
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            if not block:
                return
            if text:
                block += f.readline()  # finish the line: a token never spans two chunks
                yield block.decode("utf-8", errors="replace"), f.tell()
            else:
                yield block, f.tell()


def _byte_encoder() -> tuple[Callable[[bytes | str], list[int] | np.ndarray], int, str]:
    return (lambda block: np.frombuffer(block, dtype=np.uint8)), 256, "bytes"


def _hf_encoder(folder: str) -> tuple[Callable[[bytes | str], list[int] | np.ndarray], int, str]:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("--tokenizer needs the `transformers` package, which is not installed. Install it with "
                          "`pip install -e .[hf]`, or leave --tokenizer out for the byte-level tokenizer.") from None
    if not os.path.isdir(folder):
        raise ConfigError(f"--tokenizer {folder!r} is not a folder: it must be a local folder holding a saved "
                          "Hugging Face tokenizer (tokenizer.json or the files save_pretrained writes); nothing is "
                          "downloaded. Save one there with tokenizer.save_pretrained(DIR), or leave --tokenizer out.")
    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds: say which and stop
        raise ConfigError(f"--tokenizer {folder!r} cannot be loaded ({type(e).__name__}: {' '.join(str(e).split())}). "
                          "It must hold a tokenizer saved with save_pretrained; nothing is downloaded.") from None
    tok.model_max_length = sys.maxsize  # chunks are long texts, not model inputs: no length warning
    return (lambda block: tok.encode(block, add_special_tokens=False)), len(tok), os.path.abspath(folder)


def prepare(source: str, out: str, tokenizer: str | None = None, chunk_mb: float = 16.0,
            log: Callable[[str], None] = print) -> dict:
    """Tokenize ``source`` into ``out`` and its sidecar ``out.json``; returns the sidecar.

    Raises:
        ConfigError: the input is missing or empty, or the tokenizer cannot be loaded.
    """
    if not os.path.isfile(source):
        why = "is a folder" if os.path.isdir(source) else "does not exist"
        raise ConfigError(f"the input {source!r} {why}: prepare_data reads a local text file. Give the path of one.")
    size = os.path.getsize(source)
    if size == 0:
        raise ConfigError(f"the input {source!r} is empty: there is nothing to tokenize, and an empty token file "
                          "cannot train. Give a text file with content.")
    encode, vocab, name = _hf_encoder(tokenizer) if tokenizer else _byte_encoder()
    dtype = np.uint16 if vocab <= _UINT16_VOCAB else np.uint32
    chunk_bytes = max(1, int(chunk_mb * (1 << 20)))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp, count, t0 = f"{out}.tmp.{os.getpid()}", 0, time.perf_counter()
    try:
        with open(tmp, "wb") as f:
            for block, done in _chunks(source, chunk_bytes, text=tokenizer is not None):
                ids = np.asarray(encode(block), dtype=np.int64)
                if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                    raise ConfigError(f"--tokenizer {tokenizer!r} produced id {int(ids.max())}, outside its own "
                                      f"vocabulary of {vocab}. Check the tokenizer's files.")
                ids.astype(dtype).tofile(f)
                count += ids.size
                if size > chunk_bytes:
                    log(f"prepare_data: {done / size:4.0%} read ({done / 2**20:,.1f} of {size / 2**20:,.1f} MiB), {count:,} tokens, "
                        f"{time.perf_counter() - t0:.1f}s")
        if count == 0:
            raise ConfigError(f"the input {source!r} gave no tokens with {name}: there is nothing to train on. Give "
                              "a text file with content.")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    meta = {"dtype": np.dtype(dtype).name, "vocab_size": vocab, "tokens": count, "tokenizer": name,
            "source": os.path.abspath(source)}
    with open(out + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    log(f"prepare_data: wrote {out}: {count:,} tokens ({meta['dtype']}, vocab {vocab:,}, tokenizer {name}) from "
        f"{source} ({size:,} bytes) in {time.perf_counter() - t0:.1f}s; sidecar {out}.json")
    return meta


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m launch.prepare_data``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m launch.prepare_data",
                                     description="Turn a local text file into a token file for data=tokens.")
    parser.add_argument("input", help="a local text file")
    parser.add_argument("out", help="the token file to write (and OUT.json beside it)")
    parser.add_argument("--tokenizer", metavar="DIR", default=None,
                        help="a local folder with a saved Hugging Face tokenizer (default: bytes, ids 0..255)")
    parser.add_argument("--chunk-mb", type=float, default=16.0,
                        help="MiB read per chunk; a progress line per chunk when the input is larger (default 16)")
    args = parser.parse_args(argv)
    if args.chunk_mb <= 0:
        parser.error(f"--chunk-mb {args.chunk_mb} is not positive: it is how many MiB are read at a time")
    try:
        prepare(args.input, args.out, args.tokenizer, args.chunk_mb)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
