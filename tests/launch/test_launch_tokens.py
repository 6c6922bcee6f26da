"""data=tokens (launch.data.tokens): a flat token file, memory-mapped, read as per-rank
training batches and validation batches that are pure functions of (seed, step,
rank); and every bad file refused before any process group starts, each with a
message that says what, why and how to fix it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from launch.checks.validate import validate
from launch.config.schema import ConfigError, JobConfig
from launch.data.build import build_data
from launch.data.tokens import TokenFile, max_id

from _jobs import composed as _job

N = 20_000  # ids; in a uint16 file of np.arange(N), an id is its own position


def _write(path, ids, dtype="uint16", sidecar: dict | None = None):
    np.asarray(ids, dtype=dtype).tofile(path)
    if sidecar is not None:
        (path.parent / (path.name + ".json")).write_text(json.dumps(sidecar))
    return path


@pytest.fixture
def positions(tmp_path):
    """A file whose ids are their positions (0..N-1)."""
    return _write(tmp_path / "pos.bin", np.arange(N))


# --- the source ---------------------------------------------------------------------------


def test_batches_are_a_pure_function_of_seed_step_rank(positions):
    a, b = TokenFile(str(positions), seed=7), TokenFile(str(positions), seed=7)
    x, y = a.batch(5, 1, 2, 4, 16)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y - x, torch.ones_like(x))  # targets: the next id
    assert all(torch.equal(p, q) for p, q in zip((x, y), b.batch(5, 1, 2, 4, 16)))
    assert not torch.equal(x, a.batch(6, 1, 2, 4, 16)[0])
    assert not torch.equal(x, TokenFile(str(positions), seed=8).batch(5, 1, 2, 4, 16)[0])


def test_a_resumed_run_replays_the_same_batches(positions):
    first = TokenFile(str(positions), seed=1)
    run = {step: first.batch(step, 0, 1, 8, 32) for step in range(1, 11)}
    resumed = TokenFile(str(positions), seed=1)  # a new process after a checkpoint at step 6
    for step in range(7, 11):
        assert all(torch.equal(p, q) for p, q in zip(run[step], resumed.batch(step, 0, 1, 8, 32))), f"step {step}"


def test_each_rank_reads_its_own_slice_of_the_train_region(positions):
    f = TokenFile(str(positions), seed=3, val_fraction=0.1)
    assert (f.train_tokens, f.val_tokens) == (18_000, 2_000)
    seen = []
    for rank in range(4):
        lo, hi = f.train_slice(rank, 4)
        assert (lo, hi) == (rank * 4_500, (rank + 1) * 4_500)
        starts = torch.cat([f.batch(step, rank, 4, 16, 32)[0][:, 0] for step in range(1, 21)])
        assert starts.min() >= lo and starts.max() + 32 < hi, f"rank {rank}: a window leaves [{lo}, {hi})"
        seen.append(set(starts.tolist()))
    assert all(not (seen[i] & seen[j]) for i in range(4) for j in range(i + 1, 4))


def test_validation_batches_come_from_the_region_no_train_window_reaches(positions):
    f = TokenFile(str(positions), seed=3, val_fraction=0.1)
    train_ends = torch.cat([f.batch(s, r, 2, 16, 32)[1][:, -1] for s in range(1, 51) for r in range(2)])
    val_starts = torch.cat([f.eval_batch(s, r, 2, 16, 32)[0][:, 0] for s in range(1, 21) for r in range(2)])
    assert train_ends.max() < f.train_tokens <= val_starts.min() and val_starts.max() + 32 < N
    x, y = f.eval_batch(3, 1, 2, 4, 32)
    assert torch.equal(x, f.eval_batch(3, 1, 2, 4, 32)[0]) and torch.equal(y - x, torch.ones_like(x))
    assert not torch.equal(x, f.eval_batch(3, 0, 2, 4, 32)[0])


def test_uint32_ids_and_the_dtype_from_the_sidecar(tmp_path):
    ids = np.arange(N, dtype=np.int64) + 70_000
    path = _write(tmp_path / "big.bin", ids, "uint32", {"dtype": "uint32", "vocab_size": 90_000, "tokens": N})
    f = build_data(_job("data=tokens", f"data.path={path}").data, seed=0, vocab_size=90_000)
    assert isinstance(f, TokenFile) and f.dtype == "uint32" and f.tokens == N
    assert int(f.batch(1, 0, 1, 2, 8)[0].min()) >= 70_000


def test_a_batch_with_ids_past_the_vocabulary_stops_with_the_fix(positions):
    f = TokenFile(str(positions), seed=0, vocab_size=100)
    with pytest.raises(ConfigError, match=r"holds token id [\d,]+, but model\.vocab_size=100: the embedding has no "
                                          r"row for ids past 99\. Set model\.vocab_size to at least"):
        f.batch(1, 0, 1, 4, 16)


def test_max_id_scans_everything_up_to_the_limit_and_samples_past_it():
    ids = np.zeros(1_000, dtype=np.uint16)
    ids[517] = 9
    assert max_id(ids, limit=1_000, chunk=64) == (9, 517, True)
    top, where, full = max_id(ids, limit=999, chunks=4, chunk=10)  # chunks at 0, 330, 660, 990: 517 unread
    assert (top, full) == (0, False)
    ids[995] = 7
    assert max_id(ids, limit=999, chunks=4, chunk=10) == (7, 995, False)  # the last chunk is always read


# --- bad files, refused before any process group starts ------------------------------------

FIX = r"python -m launch\.prepare_data"


def _tokens(path, *more: str) -> JobConfig:
    return _job("compile=eager", "data=tokens", f"data.path={path}", "train.seq_len=64", *more)


def test_data_tokens_without_a_path_is_refused():
    with pytest.raises(ConfigError, match=rf"^data=tokens needs data\.path, the token file to train on\. .*{FIX}"):
        validate(_job("compile=eager", "data=tokens"), world_size=2)


@pytest.mark.parametrize("what,match", [
    ("missing", r"does not exist: data=tokens reads a flat file of token ids\. Make one with"),
    ("folder", r"is a folder: data=tokens reads"),
    ("empty", r"is empty: there are no tokens to train on\. Prepare it again"),
    ("odd", r"has 4001 bytes, not a multiple of 2 \(the size of one uint16 id\): the file was written with another "
            r"dtype, or cut short\. Set data\.dtype"),
])
def test_a_file_that_is_not_a_token_file_is_refused(tmp_path, what, match):
    path = tmp_path / "t.bin"
    if what == "folder":
        path.mkdir()
    elif what == "empty":
        path.write_bytes(b"")
    elif what == "odd":
        path.write_bytes(b"\0" * 4001)
    with pytest.raises(ConfigError, match=rf"^data\.path='{path}' {match}"):
        validate(_tokens(path), world_size=2)


def test_a_size_that_is_not_whole_uint32_ids_is_refused(tmp_path):
    path = _write(tmp_path / "t.bin", np.zeros(2_001), "uint16")  # 4002 bytes: whole uint16 ids, not uint32
    with pytest.raises(ConfigError, match=r"has 4002 bytes, not a multiple of 4 \(the size of one uint32 id\)"):
        validate(_tokens(path, "data.dtype=uint32"), world_size=2)


def test_a_dtype_other_than_uint16_or_uint32_is_refused(positions):
    with pytest.raises(ConfigError, match=r"^data\.dtype='int32' is not one of uint16, uint32: .* Use "
                                          r"data\.dtype=uint16 or data\.dtype=uint32"):
        validate(_tokens(positions, "data.dtype=int32"), world_size=2)


def test_a_dtype_the_sidecar_contradicts_is_refused(tmp_path):
    path = _write(tmp_path / "t.bin", np.zeros(N), "uint16", {"dtype": "uint16", "vocab_size": 256, "tokens": N})
    with pytest.raises(ConfigError, match=r"^data\.dtype=uint32 but the sidecar .*t\.bin\.json says the file holds "
                                          r"uint16 ids: .* Set data\.dtype=uint16, or leave it null\."):
        validate(_tokens(path, "data.dtype=uint32"), world_size=2)


# --- a file whose dtype nothing declares (Note [Undeclared dtype]) ---------------------------

UNDECLARED = (r"does not say its dtype \(no sidecar .*\.json, data\.dtype=null\) and looks like uint32 ids, not "
              r"nanoGPT's uint16: read as uint16, {sign}, so the job would train on garbage\. Set data\.dtype=uint32 "
              r"\(or data\.dtype=uint16 if it does hold 16-bit ids\), or prepare it again with python -m "
              r"launch\.prepare_data, which writes the sidecar with its dtype\.$")


def _gpt2_ids(n: int) -> np.ndarray:
    """Ids shaped like GPT-2 text: mostly common (small) ids, some up to 50,256."""
    rng = np.random.default_rng(0)
    return np.minimum(rng.zipf(1.3, n) + rng.integers(0, 200, n), 50_256)


@pytest.mark.parametrize("n,vocab,sign", [
    (N, 50_304, r"every other id is 0 \(the high halves of uint32 ids below 65,536\)"),
    (2_200_000, 50_304, r"every other id is 0 \(the high halves of uint32 ids below 65,536\)"),  # sampled blocks
    (N, 100_277, r"every other id is at most 1 \(the high halves of uint32 ids below 131,072\)"),
])
def test_a_uint32_file_without_a_sidecar_is_refused_not_read_as_uint16(tmp_path, n, vocab, sign):
    ids = _gpt2_ids(n) if vocab < 65_536 else _gpt2_ids(n) + 50_000  # a 100k tokenizer's ids past 65,535
    path = _write(tmp_path / "t.bin", ids, "uint32")
    with pytest.raises(ConfigError, match=rf"^data\.path='{path}' " + UNDECLARED.format(sign=sign)):
        validate(_tokens(path, f"model.vocab_size={vocab}"), world_size=2)
    with pytest.raises(ConfigError, match=UNDECLARED.format(sign=sign)):  # also where the ranks build it
        build_data(_tokens(path).data, seed=0, vocab_size=vocab)
    validate(_tokens(path, f"model.vocab_size={vocab}", "data.dtype=uint32"), world_size=2)  # the fix


@pytest.mark.parametrize("n", [N, 2_200_000])  # 4.4 MB: judged on the sampled blocks
def test_a_nanogpt_uint16_file_without_a_sidecar_still_trains(tmp_path, n):
    path = _write(tmp_path / "train.bin", _gpt2_ids(n), "uint16")
    validate(_tokens(path, "model.vocab_size=50304"), world_size=2)
    f = build_data(_tokens(path).data, seed=0, vocab_size=50_304)
    assert f.dtype == "uint16" and f.tokens == n


def test_a_tiny_or_mostly_zero_uint16_file_is_not_taken_for_uint32(tmp_path):
    ids = np.zeros(N)
    ids[[10, 12_344, 12_346]] = 300  # even positions: the high halves are all 0, but too few low halves say so
    validate(_tokens(_write(tmp_path / "zeros.bin", ids), "model.vocab_size=512"), world_size=2)
    short = _write(tmp_path / "short.bin", np.array([464, 0, 2068, 0, 7586, 0, 21831, 0]))  # 4 pairs: too few to tell
    assert TokenFile(str(short), seed=0).dtype == "uint16"


@pytest.mark.parametrize("val,world,match", [
    (0.5, 2, r"holds 200 ids: its train region \(100, with data\.val_fraction=0\.5\) gives each of 2 rank\(s\) a slice "
             r"of 50, shorter than one window of train\.seq_len \+ 1 = 65\. Use a longer file"),
    (0.1, 1, r"holds 200 ids: its validation region \(the last 20, data\.val_fraction=0\.1\) is shorter than one "
             r"window of train\.seq_len \+ 1 = 65\. Raise data\.val_fraction"),
])
def test_a_file_too_short_for_one_window_is_refused(tmp_path, val, world, match):
    path = _write(tmp_path / "t.bin", np.zeros(200))
    with pytest.raises(ConfigError, match=rf"^data\.path='{path}' {match}"):
        validate(_tokens(path, f"data.val_fraction={val}"), world_size=world)


def test_ids_past_the_model_vocabulary_are_refused_with_where(tmp_path):
    ids = np.zeros(N)
    ids[12_345] = 300
    path = _write(tmp_path / "t.bin", ids)
    with pytest.raises(ConfigError, match=r"holds token id 300 \(at id position 12,345\), but model\.vocab_size=256: "
                                          r"the embedding has no row for ids past 255\. Set model\.vocab_size to at "
                                          r"least 301"):
        validate(_tokens(path, "model.vocab_size=256"), world_size=2)


def test_a_sidecar_vocabulary_larger_than_the_model_is_refused(tmp_path):
    path = _write(tmp_path / "t.bin", np.zeros(N), "uint16", {"dtype": "uint16", "vocab_size": 50_257, "tokens": N})
    with pytest.raises(ConfigError, match=r"was tokenized with a vocabulary of 50,257 ids \(its sidecar .*\), more "
                                          r"than model\.vocab_size=512: .* Set model\.vocab_size=50257"):
        validate(_tokens(path), world_size=2)
    validate(_tokens(path, "model.vocab_size=50304"), world_size=2)  # larger (nanoGPT's padding) is fine


def test_a_sidecar_that_disagrees_with_the_file_length_is_refused(tmp_path):
    path = _write(tmp_path / "t.bin", np.zeros(N), "uint16", {"dtype": "uint16", "vocab_size": 256, "tokens": N + 1})
    with pytest.raises(ConfigError, match=r"holds 20,000 uint16 ids but its sidecar says 20,001: the file was changed "
                                          r"or cut short"):
        validate(_tokens(path), world_size=2)


@pytest.mark.parametrize("overrides,match", [
    (["data.val_fraction=0"], r"^data\.val_fraction=0\.0 is not in \(0, 1\): it is the share of the file"),
    (["data.val_fraction=1"], r"^data\.val_fraction=1\.0 is not in \(0, 1\)"),
    (["data=synthetic"], r"^data\.path='.*' is set but data=synthetic: only data=tokens reads a token file"),
    (["data._target_=my_pkg.Data"], r"^data=tokens with data\._target_='my_pkg\.Data': .* Drop data\._target_"),
])
def test_settings_that_cannot_go_with_a_token_file_are_refused(positions, overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(_tokens(positions, *overrides), world_size=2)


def test_a_good_file_passes(positions):
    validate(_tokens(positions, "model.vocab_size=20000"), world_size=2)


# --- resume, end to end -------------------------------------------------------------------


@pytest.mark.slow
def test_a_resumed_run_on_a_token_file_repeats_the_losses(tmp_path, one_thread, clean_dynamo):
    from launch.train import run

    path = _write(tmp_path / "t.bin", np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 200, np.uint8))

    def job(*more: str) -> JobConfig:
        return _job("compile=eager", "parallel=none", "data=tokens", f"data.path={path}", "model.vocab_size=256",
                    "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "train.seq_len=32", "train.steps=6",
                    "train.checkpoint_every=3", f"train.checkpoint_dir={tmp_path / 'ckpt'}", *more)

    whole = run(job())["losses"]
    (tmp_path / "ckpt" / "step_000006").rename(tmp_path / "old_step_6")  # resume from step 3
    resumed = run(job("train.resume=true"))
    assert resumed["start_step"] == 3 and resumed["losses"] == whole[3:], (whole, resumed["losses"])
