"""python -m launch.prepare_data: a local text file into a token file and its sidecar
(bytes, or a local Hugging Face tokenizer), and the main job trained on the result."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from launch import prepare_data
from launch.data.tokens import TokenFile

TEXT = "".join(f"the quick brown fox jumps over the lazy dog {i % 10}.\n" for i in range(400))


def _cli(cwd, *args: str, module: str = "launch.prepare_data", timeout: float = 120):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_bytes_by_default_with_progress_and_a_summary(tmp_path, capsys, monkeypatch):
    (tmp_path / "in.txt").write_text(TEXT)
    monkeypatch.chdir(tmp_path)
    assert prepare_data.main(["in.txt", "data/out.bin", "--chunk-mb", "0.005"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("prepare_data:") and "% read (" in lines[0] and len(lines) > 3
    size = len(TEXT.encode())
    assert lines[-1].startswith(f"prepare_data: wrote data/out.bin: {size:,} tokens (uint16, vocab 256, tokenizer "
                                f"bytes) from in.txt ({size:,} bytes)")
    ids = np.fromfile(tmp_path / "data/out.bin", dtype=np.uint16)
    assert bytes(ids.astype(np.uint8)) == TEXT.encode()
    meta = json.loads((tmp_path / "data/out.bin.json").read_text())
    assert meta == {"dtype": "uint16", "vocab_size": 256, "tokens": size, "tokenizer": "bytes",
                    "source": str(tmp_path / "in.txt")}


@pytest.mark.parametrize("what,match", [
    ("missing", r"^error: the input 'in\.txt' does not exist: prepare_data reads a local text file\."),
    ("empty", r"^error: the input 'in\.txt' is empty: there is nothing to tokenize, and an empty token file cannot "
              r"train\. Give a text file with content\."),
])
def test_a_missing_or_empty_input_exits_2_with_the_reason(tmp_path, capsys, monkeypatch, what, match):
    if what == "empty":
        (tmp_path / "in.txt").write_text("")
    monkeypatch.chdir(tmp_path)
    assert prepare_data.main(["in.txt", "out.bin"]) == 2
    err = capsys.readouterr().err
    assert re.match(match, err), err
    assert not list(tmp_path.glob("out.bin*"))


def test_a_tokenizer_folder_that_is_not_there_exits_2(tmp_path, capsys):
    (tmp_path / "in.txt").write_text(TEXT)
    assert prepare_data.main([str(tmp_path / "in.txt"), str(tmp_path / "out.bin"), "--tokenizer",
                              str(tmp_path / "nope")]) == 2
    assert "is not a folder: it must be a local folder holding a saved Hugging Face tokenizer" in capsys.readouterr().err


def test_a_local_hf_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT], tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    hf.save_pretrained(tmp_path / "tok")
    (tmp_path / "in.txt").write_text(TEXT)
    meta = prepare_data.prepare(str(tmp_path / "in.txt"), str(tmp_path / "out.bin"), str(tmp_path / "tok"),
                                chunk_mb=0.005, log=lambda line: None)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == len(hf) and meta["tokenizer"] == str(tmp_path / "tok")
    ids = np.fromfile(tmp_path / "out.bin", dtype=np.uint16)
    assert ids.tolist() == hf.encode(TEXT, add_special_tokens=False)  # chunks end at line breaks: same ids
    assert meta["tokens"] == len(ids) and TokenFile(str(tmp_path / "out.bin"), seed=0).dtype == "uint16"


def test_a_vocabulary_past_65536_ids_is_written_as_uint32(tmp_path, monkeypatch):
    # A stand-in for a large HF tokenizer: one id per line, past the uint16 range.
    monkeypatch.setattr(prepare_data, "_hf_encoder",
                        lambda folder: (lambda text: [70_000 + len(line) for line in text.splitlines()], 80_000, "big"))
    (tmp_path / "in.txt").write_text(TEXT)
    meta = prepare_data.prepare(str(tmp_path / "in.txt"), str(tmp_path / "out.bin"), "big", log=lambda line: None)
    assert (meta["dtype"], meta["vocab_size"], meta["tokens"]) == ("uint32", 80_000, 400)
    f = TokenFile(str(tmp_path / "out.bin"), seed=0)  # the dtype comes from the sidecar
    assert f.dtype == "uint32" and f.tokens == 400 and int(f.ids.min()) >= 70_000


# --- the main job on a prepared file ---------------------------------------------------------


@pytest.mark.slow
def test_the_main_job_trains_on_a_prepared_file_and_the_loss_falls(tmp_path):
    (tmp_path / "in.txt").write_text(TEXT)
    assert _cli(tmp_path, "in.txt", "tokens.bin").returncode == 0
    proc = _cli(tmp_path, "compile=eager", "parallel=none", "data=tokens", "data.path=tokens.bin",
                "model.vocab_size=256", "model.n_layer=2", "model.n_embd=64", "model.n_head=2", "train.steps=30",
                "train.seq_len=32", "hydra.run.dir=run", module="launch.train", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "data       tokens path=tokens.bin val_fraction=0.1" in proc.stdout
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    losses = [loss for _, loss in metrics["losses"]]
    assert len(losses) == 30 and losses[0] > 5.0 and min(losses[-5:]) < losses[0] - 1.5, losses


@pytest.mark.slow
def test_the_main_job_refuses_a_bad_token_file_with_exit_2(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\0" * 4001)
    proc = _cli(tmp_path, "compile=eager", "data=tokens", "data.path=odd.bin", "hydra.run.dir=run",
                module="launch.train")
    assert proc.returncode == 2, proc.stderr
    assert "error: data.path='odd.bin' has 4001 bytes, not a multiple of 2" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
