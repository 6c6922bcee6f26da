"""The persistent compile cache (Note [Compile cache]): entries that are stale,
foreign or corrupt are ignored with one warning, writes are atomic, and a warm
restart in a new process is served from the cache (small inductor jobs, after one cold run
that the restart tests share)."""

import copy
import dataclasses
import logging
import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _cache_job import run_job as _run_job
from _dist import single_rank_group
from _jobs import TINY_GPT as TINY
from compiler.cache.store import MAGIC, CacheKey, CompileCache
from ddp_opt import compile_ddp
from launch.models import GPT, GPTConfig



def artifact_payload(*keys: str, kind: str = "inductor", content: bytes | None = None) -> bytes:
    """A ``save_cache_artifacts`` payload in torch's format: one artifact of ``kind`` per key, its
    content ``content`` or the key (these tests stub the load, so nothing is unpickled)."""
    from torch.compiler._cache import CacheArtifactFactory, CacheArtifactManager, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    CacheArtifactManager._ensure_cache_artifacts_registered()
    out = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    out.extend([(kind, [CacheArtifactFactory.create(kind, k, content or k.encode()) for k in keys])])
    return out.to_bytes()


ARTIFACTS = artifact_payload("fartifacts")


def _key(**settings):
    return CacheKey.for_model(GPT(GPTConfig(**TINY)), {"backend": "inductor", **settings})


@pytest.fixture
def loaded(monkeypatch):
    """Payloads handed to torch.compiler.load_cache_artifacts (replaced: these tests are about files)."""
    seen = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda payload: seen.append(payload))
    return seen


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "compiler.cache.store" and r.levelno >= logging.WARNING]


def test_an_entry_round_trips_and_a_missing_entry_is_silent(tmp_path, loaded, caplog):
    cache = CompileCache(tmp_path, _key())
    assert cache.load().status == "missing" and loaded == []
    cache.write(ARTIFACTS)
    assert cache.path.name.startswith("GPT-") and cache.path.suffix == ".pt2cache"
    assert CompileCache(tmp_path, _key()).load().status == "loaded"
    assert loaded == [ARTIFACTS]
    assert _warnings(caplog) == []


def _corrupt_truncated(path):
    path.write_bytes(path.read_bytes()[:-3])


def _corrupt_flipped(path):
    raw = bytearray(path.read_bytes())
    raw[-2] ^= 0xFF
    path.write_bytes(bytes(raw))


def _corrupt_garbage(path):
    path.write_bytes(b"\x00\x01 not a cache file")


def _corrupt_header(path):
    path.write_bytes(MAGIC + b"{not json\n" + b"payload")


@pytest.mark.parametrize("damage, reason", [
    (_corrupt_truncated, f"is corrupt: truncated payload ({len(ARTIFACTS) - 3} of {len(ARTIFACTS)} bytes)"),
    (_corrupt_flipped, "is corrupt: payload checksum mismatch"),
    (_corrupt_garbage, "is corrupt: not a compile-cache file (bad magic line)"),
    (_corrupt_header, "is corrupt: unreadable header"),
])
def test_a_corrupt_entry_gives_one_warning_and_is_not_loaded(tmp_path, loaded, caplog, damage, reason):
    cache = CompileCache(tmp_path, _key())
    cache.write(ARTIFACTS)
    damage(cache.path)
    result = CompileCache(tmp_path, _key()).load()
    assert result.status == "corrupt" and loaded == []
    (msg,) = _warnings(caplog)
    assert str(cache.path) in msg and reason in msg
    assert "Ignoring it and compiling from scratch" in msg


def test_a_stale_entry_from_another_torch_version_gives_one_warning(tmp_path, loaded, caplog):
    key = _key()
    old = dataclasses.replace(key, runtime={**key.runtime, "torch": "2.0.0"})
    stale = CompileCache(tmp_path, old)
    stale.path = CompileCache(tmp_path, key).path  # the same file name, as after a torch upgrade in place
    stale.write(ARTIFACTS)
    assert CompileCache(tmp_path, key).load().status == "stale" and loaded == []
    (msg,) = _warnings(caplog)
    assert f"is stale: written for torch '2.0.0', this job has '{torch.__version__}'" in msg


def test_a_foreign_entry_for_another_model_gives_one_warning(tmp_path, loaded, caplog):
    ours = CompileCache(tmp_path, _key())
    other_model = GPT(GPTConfig(**{**TINY, "n_embd": 64}))
    foreign = CompileCache(tmp_path, CacheKey.for_model(other_model, {"backend": "inductor"}))
    foreign.path = ours.path  # another model's entry where ours should be (copied, or a name clash)
    foreign.write(artifact_payload("fother"))
    assert ours.load().status == "foreign" and loaded == []
    (msg,) = _warnings(caplog)
    assert "is foreign: written for another model or config" in msg and "differs in model" in msg


def test_the_key_covers_model_settings_and_world_size():
    base = _key()
    assert _key().digest == base.digest
    assert _key(mode="max-autotune").digest != base.digest
    assert CacheKey.for_model(GPT(GPTConfig(**TINY)), {"backend": "inductor"}, world_size=2).digest != base.digest
    assert CacheKey.for_model(GPT(GPTConfig(**{**TINY, "n_layer": 3})), {"backend": "inductor"}).digest != base.digest


def test_an_entry_of_graphs_free_of_the_world_size_loads_on_another_world_size(tmp_path, loaded, caplog,
                                                                               monkeypatch):
    from compiler.cache.store import open_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # chosen: left where it is
    model = GPT(GPTConfig(**TINY))
    assert CacheKey.for_model(model, {}, world_size=None).parts["world_size"] == "any"
    written = open_cache(model, tmp_path, {"backend": "inductor"}, world_size=2, any_world_size=True)
    assert written.last_load.status == "missing"
    written.write(ARTIFACTS)
    caplog.set_level(logging.INFO, logger="compiler.cache.store")
    for world_size in (1, 4):
        cache = open_cache(model, tmp_path, {"backend": "inductor"}, world_size=world_size, any_world_size=True)
        assert cache.path == written.path and cache.last_load.status == "loaded" and cache.written_on == 2
        assert (f"loaded {cache.path.name}, written by a run on 2 rank(s), into this run on {world_size} (its graphs "
                "do not depend on the world size)") in caplog.text
    # Keyed by the world size (the traced strategy's graphs hold the group's all-reduces): another entry.
    keyed = open_cache(model, tmp_path, {"backend": "inductor"}, world_size=4)
    assert keyed.path != written.path and keyed.last_load.status == "missing"
    assert loaded == [ARTIFACTS] * 2


def test_a_write_that_fails_before_the_rename_leaves_the_old_entry(tmp_path, loaded, monkeypatch):
    cache = CompileCache(tmp_path, _key())
    cache.write(old := artifact_payload("fold"))

    def crash(src, dst):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        cache.write(artifact_payload("fnew"))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [cache.path.name]  # no partial or temporary file
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda payload: loaded.append(payload))
    assert CompileCache(tmp_path, _key()).load().loaded and loaded == [old]


def test_save_does_not_fail_the_job_when_the_write_fails(tmp_path, monkeypatch, caplog):
    cache = CompileCache(tmp_path / "cache", _key())
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (ARTIFACTS, None))
    monkeypatch.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError("disk full")))
    assert cache.save() is None
    (msg,) = _warnings(caplog)
    assert "could not write" in msg and "disk full" in msg


def test_a_payload_torch_rejects_is_reported_as_corrupt(tmp_path, monkeypatch, caplog):
    cache = CompileCache(tmp_path, _key())
    cache.write(ARTIFACTS)

    def reject(payload):
        raise RuntimeError("unpickling failed")

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", reject)
    assert CompileCache(tmp_path, _key()).load().status == "corrupt"
    (msg,) = _warnings(caplog)
    assert "load_cache_artifacts failed (RuntimeError: unpickling failed)" in msg


@pytest.mark.parametrize("handle", ["compiled", "ddp"])  # either handle saves: a hook on DDP's forward
def test_compile_ddp_ignores_a_corrupt_entry_recompiles_and_overwrites_it(tmp_path, caplog, monkeypatch, clean_dynamo,
                                                                          handle):
    # aot_eager records no cache artifacts, so the saved payload is stubbed; the
    # compile and its parity with eager are real.
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (artifact_payload("ffresh"), None))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "placeholder")  # restored after the test
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    with single_rank_group():
        torch.manual_seed(0)
        model = GPT(GPTConfig(**TINY))
        ref = DDP(copy.deepcopy(model), bucket_cap_mb=0.01)
        ddp = DDP(model, bucket_cap_mb=0.01)
        compiled = compile_ddp(ddp, backend="aot_eager", cache_dir=tmp_path)
        path = compiled.compile_cache.path
        assert compiled.compile_cache.last_load.status == "missing"
        # No Inductor cache dir chosen yet: Inductor's local cache goes under cache_dir too.
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
        torch._dynamo.reset()
        ddp2 = DDP(copy.deepcopy(ref.module), bucket_cap_mb=0.01)
        path.write_bytes(MAGIC + b"garbage")
        compiled = compile_ddp(ddp2, backend="aot_eager", cache_dir=tmp_path)
        assert compiled.compile_cache.path == path
        (msg,) = _warnings(caplog)
        assert f"Compile cache entry {path} is corrupt" in msg
        call = compiled if handle == "compiled" else ddp2
        for step in range(2):
            x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
            loss, ref_loss = call(x, x)[1], ref(x, x)[1]
            loss.backward(), ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss)
            for p, q in zip(ddp2.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad)
        # Saved automatically at the start of the second call: the corrupt entry is replaced.
        assert CompileCache(tmp_path, compiled.compile_cache.key)._check()[0] == "ok"


# -- inductor: restarts in new processes, from one cold run -----------------------------------------


@pytest.fixture(scope="module")
def cold_run(tmp_path_factory):
    """One cold run of the job, its Inductor cache under cache_dir/inductor as the launcher puts it:
    (its folder, its result). The restart tests each start from a copy of that folder."""
    folder = tmp_path_factory.mktemp("cold")
    return folder, _run_job(folder / "cache", folder / "cache" / "inductor")


def _copy_of(cold_run, tmp_path):
    import shutil

    folder, cold = cold_run
    shutil.copytree(folder / "cache", tmp_path / "cache", symlinks=True)
    return tmp_path / "cache", cold


@pytest.mark.slow
def test_a_restart_in_a_new_process_loads_every_partition_and_kernel_from_the_cache(tmp_path, cold_run):
    cache, cold = _copy_of(cold_run, tmp_path)
    assert cold["load"] == "missing" and cold["saved"] and cold["partitions"] >= 2
    assert cold["aot"].get("autograd_cache_hit", 0) == 0
    assert cold["aot"].get("autograd_cache_bypass", 0) == 0  # split partitions are cacheable
    assert cold["so_files"] > 0
    # A fresh Inductor cache dir: every hit below comes from the compile-cache file, and
    # every C++ kernel too (Note [Kernels in the compile cache]); then a new shape compiles
    # new graphs after the load, and they are saved into the entry.
    warm = _run_job(cache, tmp_path / "inductor_warm", then_seq=8)
    assert warm["load"] == "loaded" and not warm["saved"]  # the first save found nothing new
    assert warm["installed"] == cold["so_files"]
    assert warm["aot"].get("autograd_cache_hit", 0) == warm["partitions"] == cold["partitions"]
    assert warm["aot"].get("autograd_cache_miss", 0) > 0  # the new shape's graphs
    assert warm["saved_again"] and warm["entry_bytes"] > cold["entry_bytes"]
    assert warm["losses"] == pytest.approx(cold["losses"], rel=1e-5)
    assert warm["losses"] == pytest.approx(cold["eager_losses"], rel=1e-4)
    # Both shapes from the entry, in another fresh dir: no miss, no C++ kernel built.
    again = _run_job(cache, tmp_path / "inductor_again", then_seq=8)
    assert again["load"] == "loaded" and again["aot"].get("autograd_cache_miss", 0) == 0
    assert again["aot"].get("autograd_cache_hit", 0) == warm["aot"]["autograd_cache_hit"] + warm["aot"]["autograd_cache_miss"]
    assert again["so_files"] == again["installed"] == warm["so_files"], "a C++ kernel was rebuilt"
    assert not again["saved"] and not again["saved_again"]


@pytest.mark.slow
def test_a_restart_with_damaged_kernels_in_the_cache_rebuilds_them_and_stays_compiled(tmp_path, cold_run):
    # Inductor's cache under cache_dir/inductor, as the launcher puts it (Note [Damaged cache artifacts]).
    from compiler.cache.artifacts import damaged_kernels

    cache, cold = _copy_of(cold_run, tmp_path)
    inductor = cache / "inductor"
    kernels = sorted(inductor.rglob("*.so"))
    assert cold["statuses"] == ["compiled"] * cold["partitions"] and kernels
    for path in kernels:  # a copy cut short: each file keeps its first 100 bytes
        path.write_bytes(path.read_bytes()[:100])
    assert len(damaged_kernels(inductor)) == len(kernels)
    warm = _run_job(cache, inductor)
    assert warm["statuses"] == ["compiled"] * cold["partitions"], "a partition fell back to eager"
    assert warm["load"] == "loaded" and warm["aot"].get("autograd_cache_hit", 0) == warm["partitions"]
    assert damaged_kernels(inductor) == [] and sorted(inductor.rglob("*.so")) == kernels  # rebuilt in place
    assert warm["losses"] == pytest.approx(cold["losses"], rel=1e-5)


def test_inductor_cache_moves_under_cache_dir_only_when_the_user_did_not_choose_one(monkeypatch):
    # Importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR to Inductor's default, so
    # "unset" and "the default" both count as not chosen; any other value is the user's.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from compiler.cache.store import inductor_dir_is_default as _inductor_dir_is_default

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert _inductor_dir_is_default()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert _inductor_dir_is_default()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/the/user/chose")
    assert not _inductor_dir_is_default()
