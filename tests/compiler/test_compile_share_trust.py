"""What a shared compile and the compile cache trust (docs/trust.md): a publication is loaded
only with a MAC made from the job's secret (Note [Share secret]), every artifact key is checked
before anything is written (Note [Checked artifact keys]), and a compile-cache folder others
can write is not loaded. The last test is a real job whose store a forger writes into."""

import hashlib
import json
import logging
import os
import re
import threading

import pytest
import torch
import torch.distributed as dist

from compiler.cache.artifact_keys import artifact_problem
from compiler.cache.store import CompileCache
from compiler.ranks.share import CompileShare, Pending
from compiler.ranks.share_secret import ShareSecret, ShareSecretError, job_secret, node_secret
from test_compile_cache import ARTIFACTS, _key, artifact_payload
from test_compile_share import FakeBackend, _gm, _header_key

SECRET = ShareSecret(b"a secret of this job", "env")
OTHER = ShareSecret(b"another job's secret", "env")


@pytest.fixture
def artifacts(monkeypatch):
    """torch.compiler's artifact save/load replaced: ``saved`` is what the next compile saves."""
    seen = {"saved": ARTIFACTS, "loaded": []}
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (seen["saved"], None))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda payload: seen["loaded"].append(payload))
    return seen


def _pair(store, secrets=(SECRET, SECRET)):
    return [CompileShare(store, r, [0, 1], prefix="t", grace_s=5.0, timeout_s=5.0, secret=s)
            for r, s in enumerate(secrets)]


def _forge(store, key, payload, secret=None, owner="0"):
    """A store client's publication under ``key``: the checksum matches; signed with ``secret`` if given."""
    header = {"failed": False, "bytes": len(payload), "artifacts": len(payload),
              "sha256": hashlib.sha256(payload).hexdigest(), "parts": 1}
    if secret is not None:
        header["mac"] = secret.mac(key, header, payload)
    store.set(f"{key}/part0", payload)
    store.set(f"{key}/owner", owner)
    store.set(key, json.dumps(header))


def _warnings(caplog, name):
    return [r.getMessage() for r in caplog.records if r.name == name and r.levelno >= logging.WARNING]


def test_the_mac_covers_the_key_the_header_and_every_byte_of_the_payload():
    header = {"failed": False, "bytes": 3, "parts": 1}
    signed = {**header, "mac": SECRET.mac("k", header, b"abc")}
    assert SECRET.verify("k", signed, b"abc")
    assert not OTHER.verify("k", signed, b"abc")  # signed with another secret
    assert not SECRET.verify("k", signed, b"abd")  # one byte altered
    assert not SECRET.verify("k2", signed, b"abc") and not SECRET.verify("k", {**signed, "parts": 2}, b"abc")
    assert not SECRET.verify("k", header, b"abc")  # no MAC at all


@pytest.mark.parametrize("signer", [None, OTHER], ids=["unsigned", "another_secret"])
def test_a_publication_not_signed_by_a_rank_of_the_job_is_rejected_in_one_line(artifacts, caplog, signer):
    store = dist.HashStore()
    ranks = _pair(store)
    ranks[0].wrap_compile(FakeBackend())(_gm("add"), [torch.ones(2)])
    key = _header_key(ranks[0])
    _forge(store, key, artifact_payload("fforged"), secret=signer, owner="0")  # over rank 0's, checksum right
    with caplog.at_level(logging.WARNING, "compiler.ranks.share"):
        ranks[1].wrap_compile(FakeBackend())(_gm("add"), [torch.ones(2)]).resolve()
    (msg,) = _warnings(caplog, "compiler.ranks.share")
    assert re.search(r"the compile artifacts for \w{12}#0, claimed by rank 0, are not signed by a rank of this job "
                     r"\(their MAC does not verify: .*\); nothing loaded, compiling it on this rank", msg), msg
    assert artifacts["loaded"] == [] and ranks[1].stats.rejected == 1 and ranks[1].stats.compiled == 1


def test_a_publication_of_the_job_loads_and_one_altered_byte_with_its_checksum_fixed_does_not(artifacts, caplog):
    store = dist.HashStore()
    ranks = _pair(store)
    ranks[0].wrap_compile(FakeBackend())(_gm("add"), [torch.ones(2)])
    ranks[0].wrap_compile(FakeBackend())(_gm("mul"), [torch.ones(2)])
    ranks[1].wrap_compile(FakeBackend())(_gm("add"), [torch.ones(2)]).resolve()
    assert artifacts["loaded"] == [ARTIFACTS] and ranks[1].stats.loaded == 1
    key = [k for k in ranks[0]._published if "/part" not in k][1]
    header, part = json.loads(store.get(key)), store.get(f"{key}/part0")
    altered = part[:-1] + bytes([part[-1] ^ 1])
    store.set(f"{key}/part0", altered)
    store.set(key, json.dumps({**header, "sha256": hashlib.sha256(altered).hexdigest()}))
    with caplog.at_level(logging.WARNING, "compiler.ranks.share"):
        ranks[1].wrap_compile(FakeBackend())(_gm("mul"), [torch.ones(2)]).resolve()
    assert "are not signed by a rank of this job" in "".join(_warnings(caplog, "compiler.ranks.share"))
    assert artifacts["loaded"] == [ARTIFACTS] and ranks[1].stats.rejected == 1


@pytest.mark.parametrize("payload, why", [
    (artifact_payload("/tmp/elsewhere"), r"the inductor artifact key '/tmp/elsewhere', which is not a relative path"),
    (artifact_payload("a/../../../x", kind="aot_autograd"), r"the aot_autograd artifact key 'a/../../../x'"),
    (artifact_payload("fpgo", kind="pgo"), r"an artifact of type 'pgo', which the toolkit does not produce"),
    (b"not torch's format", r"a payload that is not torch's artifact format"),
], ids=["absolute", "dotdot", "unknown_type", "garbage"])
def test_artifact_keys_outside_the_cache_or_of_unknown_types_reject_the_payload(tmp_path, monkeypatch, payload, why):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert re.search(why, artifact_problem(payload))
    assert artifact_problem(ARTIFACTS) is None
    assert artifact_problem(artifact_payload("ab/cdef.best_config", kind="autotune")) is None


def test_a_signed_publication_with_an_absolute_key_is_refused_before_anything_is_written(artifacts, caplog):
    artifacts["saved"] = artifact_payload("/tmp/elsewhere")  # a rank of the job (a bug, or a stolen secret)
    ranks = _pair(dist.HashStore())
    ranks[0].wrap_compile(FakeBackend())(_gm("add"), [torch.ones(2)])
    with caplog.at_level(logging.WARNING, "compiler.ranks.share"):
        ranks[1].wrap_compile(FakeBackend())(_gm("add"), [torch.ones(2)]).resolve()
    (msg,) = _warnings(caplog, "compiler.ranks.share")
    assert re.search(r"rank 0's compile artifacts for \w{12}#0 are refused: they hold the inductor artifact key "
                     r"'/tmp/elsewhere', which is not a relative path inside the cache directory; nothing loaded", msg)
    assert artifacts["loaded"] == [] and ranks[1].stats.rejected == 1


def test_a_cache_entry_with_an_absolute_key_is_not_loaded(tmp_path, artifacts, caplog):
    cache = CompileCache(tmp_path / "cache", _key())
    cache.write(artifact_payload("fgood", "/tmp/elsewhere"))
    assert CompileCache(tmp_path / "cache", _key()).load().status == "unsafe" and artifacts["loaded"] == []
    (msg,) = _warnings(caplog, "compiler.cache.store")
    assert "is unsafe: it holds the inductor artifact key '/tmp/elsewhere'" in msg and "compiling from scratch" in msg


def test_a_cache_folder_others_can_write_is_not_loaded(tmp_path, artifacts, caplog):
    folder = tmp_path / "cache"
    CompileCache(folder, _key()).write(ARTIFACTS)
    folder.chmod(0o777)
    assert CompileCache(folder, _key()).load().status == "unsafe" and artifacts["loaded"] == []
    (msg,) = _warnings(caplog, "compiler.cache.store")
    assert (f"not loading {folder}/" in msg and f"{folder} is writable by everyone (mode 777), so another user could "
            "put code there that this job would run. Run chmod go-w on that folder, or choose another "
            "compile.cache_dir" in msg), msg
    folder.chmod(0o755)
    assert CompileCache(folder, _key()).load().status == "loaded" and artifacts["loaded"] == [ARTIFACTS]


def test_a_secret_file_others_can_read_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_bytes(os.urandom(32))
    path.chmod(0o644)
    monkeypatch.setenv("DISTCOMPILE_SHARE_SECRET_FILE", str(path))
    with pytest.raises(ShareSecretError, match=rf"DISTCOMPILE_SHARE_SECRET_FILE={path}: {path} has mode 644, which "
                                               rf"lets its group or others read or write it .* Run chmod 600 {path}"):
        job_secret()
    with pytest.raises(ShareSecretError, match="chmod 600"):  # where the job meets it: making the share
        CompileShare(dist.HashStore(), 0, [0, 1], prefix="t")
    path.chmod(0o600)
    assert job_secret() == ShareSecret(path.read_bytes(), "file") and job_secret().cluster


def test_a_missing_or_empty_secret_file_is_refused_in_one_line(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    monkeypatch.setenv("DISTCOMPILE_SHARE_SECRET_FILE", str(path))
    with pytest.raises(ShareSecretError, match=rf"^DISTCOMPILE_SHARE_SECRET_FILE={path} cannot be read \(No such file "
                                               r"or directory\): .* unset it \(ranks then share within each node"):
        job_secret()
    path.write_bytes(b"")
    path.chmod(0o600)
    with pytest.raises(ShareSecretError, match=r"is empty: a share secret must be hard to guess. Write 32 random bytes"):
        job_secret()


def test_a_rank_without_a_node_secret_compiles_everything_itself_with_one_warning(tmp_path, monkeypatch, caplog,
                                                                                  artifacts):
    import compiler.ranks.share as share
    import compiler.ranks.share_secret as share_secret
    from compiler.cache.trust import UnsafePath

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setattr(share, "job_secret", lambda store: node_secret(store, timeout_s=0.2))
    store = dist.HashStore()
    (runtime / "distcompile").mkdir(mode=0o700)
    (runtime / "distcompile" / f"share-secret-{share_secret._node_name(store)}").write_bytes(b"short")
    with caplog.at_level(logging.WARNING, "compiler"):
        rank = CompileShare(store, 0, [0, 1], prefix="t", grace_s=5.0, timeout_s=5.0)
    assert not rank.share and not isinstance(rank.wrap_compile(FakeBackend())(_gm("add"), [torch.ones(2)]), Pending)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert re.search(r"the node's share secret .*share-secret-\w+ is not a private 32-byte file of this user after 0s; "
                     r"this rank compiles for itself. Remove the file, or set DISTCOMPILE_SHARE_SECRET_FILE", messages[0])
    assert "no share secret (see the line above): this rank compiles every graph itself" in messages[1]
    monkeypatch.setattr(share_secret, "runtime_dir", lambda: (_ for _ in ()).throw(UnsafePath("/x is not yours")))
    caplog.clear()
    with caplog.at_level(logging.WARNING, "compiler.ranks.share_secret"):
        assert node_secret(store) is None
    assert "no private folder for this node's share secret (/x is not yours); this rank compiles for itself" in caplog.text


def test_the_ranks_of_one_node_make_one_secret_between_them(tmp_path, monkeypatch):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    found = [None] * 4
    threads = [threading.Thread(target=lambda i=i: found.__setitem__(i, node_secret())) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert found[0] is not None and found[0].source == "node" and not found[0].cluster
    assert len({s.key for s in found}) == 1 and len(found[0].key) == 32
    (made,) = [p for p in (runtime / "distcompile").iterdir()]  # one file, no candidate left behind
    assert made.stat().st_mode & 0o777 == 0o600 and made.read_bytes() == found[0].key


def test_ranks_of_two_scopes_never_claim_or_load_each_others_compiles(artifacts, caplog):
    node_a, node_b = ShareSecret(b"node a", "node"), ShareSecret(b"node b", "node")
    store = dist.HashStore()
    ranks = _pair(store, (node_a, node_b))
    with caplog.at_level(logging.INFO, "compiler"):
        out = [ranks[r].wrap_compile(FakeBackend())(_gm(op), [torch.ones(2)]) for op in ("add", "mul") for r in (0, 1)]
    assert not any(isinstance(f, Pending) for f in out)  # each compiles: neither waits for the other
    assert artifacts["loaded"] == [] and [r.stats.compiled for r in ranks] == [2, 2]
    assert any(f"/c/{node_a.scope}/" in k for k in ranks[0]._published)
    for rank, other in ((0, 1), (1, 0)):  # each rank says it once, at its first shared compile
        lines = re.findall(rf"rank {rank}: rank\(s\) \[{other}\] are on another node, and without a cluster secret "
                           r"each node shares compiles only within itself; to share across nodes set "
                           r"DISTCOMPILE_SHARE_SECRET_FILE to a private file", caplog.text)
        assert len(lines) == 1, caplog.text


# --- a real job, and a forger on its store ------------------------------------------------------


def _job_rank(rank, world_size, inductor_dir):
    """2 SGD steps of the tiny GPT under compile_ddp(aot_eager) with sharing on; what the rank saw."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from _jobs import TINY_GPT
    from ddp_opt import compile_ddp
    from launch.models import GPT, GPTConfig
    from test_compile_share_ranks import sgd_steps

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_dir
    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("compiler").addHandler(handler)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY_GPT))
    compiled = compile_ddp(DDP(model, bucket_cap_mb=0.01), backend="aot_eager")
    losses = sgd_steps(compiled, model, rank, 2)
    stats = compiled.share.stats
    return {"losses": losses, "warnings": warned, "rejected": getattr(stats, "rejected", 0), "loaded": stats.loaded,
            "compiled": stats.compiled}


def _kernel_blob(rel: str, data: bytes) -> bytes:
    from compiler.cache.kernels import _MAGIC

    return _MAGIC + json.dumps([[rel, len(data), hashlib.sha256(data).hexdigest()]]).encode() + b"\n" + data


@pytest.mark.slow
def _agent_store(monkeypatch, port: int) -> None:
    """The ranks are clients of the store at 127.0.0.1:``port``, as under torchrun's agent store
    (torch 2.15 honours TORCHELASTIC_USE_AGENT_STORE only for MASTER_ADDR:MASTER_PORT)."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))


def test_a_forger_on_the_store_gets_nothing_written_and_the_job_trains_as_undisturbed(tmp_path, monkeypatch, run_ranks):
    # The ranks hold a fixed cluster secret; the forger, a plain client of the job's store, does not.
    # It knows the compiles' keys (list_keys() of an identical earlier run shows them), claims every
    # one before the ranks start, and publishes a payload whose header checksum matches, with an
    # artifact whose key is an absolute path into a folder of this test and a kernel library.
    monkeypatch.setenv("DISTCOMPILE_SHARE_SECRET", "fixed secret of the job")
    scope = ShareSecret(b"fixed secret of the job", "env").scope
    first = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    _agent_store(monkeypatch, first.port)
    undisturbed = run_ranks(_job_rank, str(tmp_path / "inductor0"), port=first.port, timeout=600)
    claims = [k[:-len("/claim")] for k in first.list_keys() if k.endswith("/claim")]
    assert claims and all(f"/c/{scope}/" in k for k in claims)

    target = tmp_path / "forged"
    artifacts = artifact_payload(str(target / "planted"))
    payload = artifacts + _kernel_blob("zz/forged.so", b"\x7fELF not a real library")
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    for key in claims:
        store.add(f"{key}/claim", 1)
        store.set(f"{key}/owner", "1")
        store.set(f"{key}/part0", payload)
        store.set(key, json.dumps({"failed": False, "bytes": len(payload), "artifacts": len(artifacts),
                                   "sha256": hashlib.sha256(payload).hexdigest(), "parts": 1}))
    _agent_store(monkeypatch, store.port)
    forged = run_ranks(_job_rank, str(tmp_path / "inductor1"), port=store.port, timeout=600)

    assert not target.exists() and not list((tmp_path / "inductor1").rglob("forged.so"))
    for rank, (got, base) in enumerate(zip(forged, undisturbed)):
        assert got["losses"] == base["losses"], f"rank {rank}"
        rejections = [w for w in got["warnings"] if "are not signed by a rank of this job" in w]
        assert len(rejections) == len(claims) == got["rejected"], got["warnings"]
        assert all("claimed by rank 1" in w and "nothing loaded" in w for w in rejections)
        assert got["loaded"] == 0 and got["compiled"] == len(claims)
