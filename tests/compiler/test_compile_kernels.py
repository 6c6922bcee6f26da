"""Kernels in the compile cache (Note [Kernels in the compile cache]): collected from one
Inductor directory, installed into another at the same paths, never overwriting; an entry
that carries them installs them at load; a save after a load writes only what is new."""

import logging
import os

import pytest
import torch

from compiler.cache.store import MAGIC, CacheKey, CompileCache
from compiler.cache.kernels import (KernelBlobError, collect_kernels, install_kernels, kernel_names, kernel_snapshot,
                              merge_kernels)
from test_compile_cache import ARTIFACTS, artifact_payload

ELF = open(torch._C.__file__, "rb").read()  # a real shared library, to pass the damaged-kernel check
K1, K2 = "cabcdef0123", "cxyz9876543"


def _inductor_dir(root, keys=(K1, K2)):
    for key in keys:
        d = root / key[1:3]
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{key}.main.so").write_bytes(ELF + key.encode())
        (d / f"{key}.main.cpp").write_text("// source: not carried, Inductor writes it itself")
    return root


def test_kernels_round_trip_into_a_fresh_directory_at_the_same_paths(tmp_path):
    src = _inductor_dir(tmp_path / "src")
    blob = collect_kernels(src)
    assert kernel_names(blob) == {f"ab/{K1}.main.so", f"xy/{K2}.main.so"}  # no sources
    written = install_kernels(blob, tmp_path / "fresh")
    assert sorted(p.relative_to(tmp_path / "fresh").as_posix() for p in written) == sorted(kernel_names(blob))
    for rel in kernel_names(blob):
        assert (tmp_path / "fresh" / rel).read_bytes() == (src / rel).read_bytes()
    assert install_kernels(blob, tmp_path / "fresh") == []  # all there: nothing written


def test_install_never_overwrites_an_existing_file(tmp_path):
    blob = collect_kernels(_inductor_dir(tmp_path / "src"))
    mine = tmp_path / "dst" / "ab" / f"{K1}.main.so"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"the local build")
    written = install_kernels(blob, tmp_path / "dst")
    assert mine.read_bytes() == b"the local build" and [p.name for p in written] == [f"{K2}.main.so"]


def test_collect_takes_the_given_keys_and_the_files_built_since_a_snapshot(tmp_path):
    src = _inductor_dir(tmp_path / "src", keys=(K1,))
    before = kernel_snapshot(src)
    _inductor_dir(src, keys=(K2, "cprobe55555"))  # built after the snapshot
    (src / "ab" / "cabold.so").write_bytes(ELF)  # neither a key nor new
    before.add("ab/cabold.so")
    assert kernel_names(collect_kernels(src, keys=[K1])) == {f"ab/{K1}.main.so"}
    assert kernel_names(collect_kernels(src, keys=[K1], since=before)) == {
        f"ab/{K1}.main.so", f"xy/{K2}.main.so", "pr/cprobe55555.main.so"}


def test_a_damaged_kernel_is_not_collected(tmp_path):
    src = _inductor_dir(tmp_path / "src")
    (src / "ab" / f"{K1}.main.so").write_bytes(ELF[:100])  # cut short
    assert kernel_names(collect_kernels(src)) == {f"xy/{K2}.main.so"}
    assert collect_kernels(tmp_path / "nothing_here") == b""


def test_a_blob_naming_a_path_outside_the_directory_is_refused_before_writing(tmp_path):
    good = collect_kernels(_inductor_dir(tmp_path / "src"))
    evil = good.replace(f"ab/{K1}.main.so".encode(), f"../{K1}.main.so".encode())
    with pytest.raises(KernelBlobError, match=r"is not a kernel file's path inside the cache directory"):
        install_kernels(evil, tmp_path / "dst")
    assert not (tmp_path / "dst").exists() and not (tmp_path / f"{K1}.main.so").exists()
    with pytest.raises(KernelBlobError, match="does not match its checksum"):
        install_kernels(good[:-1] + b"!", tmp_path / "dst")


def test_merge_keeps_every_file_once(tmp_path):
    a = collect_kernels(_inductor_dir(tmp_path / "a", keys=(K1,)))
    b = collect_kernels(_inductor_dir(tmp_path / "b", keys=(K1, K2)))
    assert kernel_names(merge_kernels(a, b)) == {f"ab/{K1}.main.so", f"xy/{K2}.main.so"}
    assert merge_kernels(b"", b"") == b""


# -- the cache entry ------------------------------------------------------------------------------


def _key():
    return CacheKey.for_model(torch.nn.Linear(2, 2), {"backend": "inductor"})


@pytest.fixture
def inductor(tmp_path, monkeypatch):
    """A fresh Inductor cache dir for this process; torch.compiler's artifact calls stubbed."""
    d = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(d))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda payload: None)
    return d


def test_a_load_installs_the_entry_kernels_into_the_fresh_inductor_dir(tmp_path, inductor):
    kernels = collect_kernels(_inductor_dir(tmp_path / "machine_a"))
    CompileCache(tmp_path / "cache", _key()).write(ARTIFACTS, kernels)
    cache = CompileCache(tmp_path / "cache", _key())
    assert cache.load().loaded
    assert sorted(p.relative_to(inductor).as_posix() for p in cache.installed) == sorted(kernel_names(kernels))


def test_a_kernel_section_that_is_not_a_blob_is_corrupt_and_installs_nothing(tmp_path, inductor, caplog):
    CompileCache(tmp_path / "cache", _key()).write(ARTIFACTS, b"not kernels")
    assert CompileCache(tmp_path / "cache", _key()).load().status == "corrupt"
    (msg,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "is corrupt: bad kernel section (not a kernel blob" in msg and "compiling from scratch" in msg
    assert not list(inductor.rglob("*.so"))


def test_an_entry_of_format_1_is_stale(tmp_path, inductor, caplog):
    old = CompileCache(tmp_path, _key())
    old.path.write_bytes(MAGIC + b'{"runtime": {"format": "1"}}\n' + b"payload")
    assert CompileCache(tmp_path, _key()).load().status == "stale"
    assert "is stale: written for format '1', this job has '2'" in caplog.text


def test_a_save_after_a_load_writes_only_when_this_process_has_something_new(tmp_path, inductor, monkeypatch):
    kernels = collect_kernels(_inductor_dir(tmp_path / "machine_a", keys=(K1,)))
    CompileCache(tmp_path / "cache", _key()).write(ARTIFACTS, kernels)
    produced = [ARTIFACTS]
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (produced[0], None))
    cache = CompileCache(tmp_path / "cache", _key())
    assert cache.load().loaded
    mtime = cache.path.stat().st_mtime_ns
    assert cache.save() is None and cache.path.stat().st_mtime_ns == mtime  # all hits: the same entry
    _inductor_dir(inductor, keys=(K2,))  # a kernel built after the load (a graph that missed)
    assert cache.save() == cache.path
    assert cache._check()[0] == "ok"
    raw = cache.path.read_bytes()
    assert {f"ab/{K1}.main.so", f"xy/{K2}.main.so"} <= kernel_names(raw[raw.index(b"distcompile-kernels"):])
    assert cache.save() is None  # nothing new since
    produced[0] = artifact_payload("fother")
    assert cache.save() == cache.path


def test_a_save_that_cannot_collect_warns_and_does_not_raise(tmp_path, inductor, monkeypatch, caplog):
    def boom():
        raise RuntimeError("serializer broke")

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", boom)
    assert CompileCache(tmp_path / "cache", _key()).save() is None
    assert "could not collect this process's artifacts" in caplog.text and "serializer broke" in caplog.text
    assert not os.path.exists(tmp_path / "cache")
