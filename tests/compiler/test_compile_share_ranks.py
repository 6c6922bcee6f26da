"""Shared compile (Note [Shared compile]) in real 2-rank jobs: the first rank to reach a compile does
it and the others load its artifacts, with results equal to an unshared run; a rank that cannot load,
or a damaged publication, makes that rank compile for itself; kernels travel to a rank with an
Inductor directory of its own; a slow-compiling rank does not make the first all-reduce time out.
The protocol on one in-memory store: tests/compiler/test_compile_share.py."""

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_ranks
from _jobs import TINY_GPT as TINY


# --- real ranks ---------------------------------------------------------------------------------



def _train(rank, share, inductor_dir, break_load=False, damage=False, per_rank=False, steps=3):
    """3 SGD steps of the tiny GPT under compile_ddp(inductor), in a fresh Inductor dir
    (``per_rank``: one per rank, as on separate machines); counts C++ kernel builds."""
    from torch._inductor.cpp_builder import CppBuilder

    from compiler._torch_internals import aot_counts
    from ddp_opt import compile_ddp
    from launch.models import GPT, GPTConfig

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(inductor_dir, f"rank{rank}") if per_rank else inductor_dir
    torch._dynamo.reset()
    builds, build = [], CppBuilder.build
    CppBuilder.build = lambda self: builds.append(1) or build(self)
    if break_load and rank == 1:
        torch.compiler.load_cache_artifacts = lambda payload: (_ for _ in ()).throw(OSError("disk full"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    compiled = compile_ddp(DDP(model, bucket_cap_mb=0.01), backend="inductor", share=share)
    if damage:  # every part of every publication of every rank is damaged on its way into the store
        compiled.share.store = _DamagingStore(compiled.share.store)
    hits0 = aot_counts()[1]
    losses = sgd_steps(compiled, model, rank, steps)
    CppBuilder.build = build
    n_parts = len(compiled.splitter.records)
    stats = compiled.share.stats if compiled.share is not None else SimpleNamespace(
        compiled=n_parts, loaded=0, fell_back=0, kernels_installed=0)
    return {"builds": len(builds),"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            "partitions": len(compiled.splitter.records), "hits": aot_counts()[1] - hits0,
            "compiled": stats.compiled, "loaded": stats.loaded, "fell_back": stats.fell_back,
            "installed": stats.kernels_installed,
            "statuses": {r.status for r in compiled.splitter.records}}


def sgd_steps(compiled, model, rank, steps):
    """``steps`` SGD steps of the tiny GPT (vocabulary 64) on this rank's own batches; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = torch.nn.functional.cross_entropy(compiled(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


class _DamagingStore:
    """A store whose publication parts arrive with their last byte flipped (before the header
    that announces them: a peer never sees an intact part)."""

    def __init__(self, store):
        self._store = store

    def set(self, key, value):
        if "/part" in key:
            value = bytes(value)[:-1] + b"X"
        self._store.set(key, value)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _share_scenarios(rank, world_size, tmp):
    results = {}
    for name, kw in (("unshared", dict(share=False)), ("shared", dict(share=True)),
                     ("cannot_load", dict(share=True, break_load=True)), ("damaged", dict(share=True, damage=True))):
        results[name] = _train(rank, inductor_dir=os.path.join(tmp, name), **kw)
        dist.barrier()
    return results


@pytest.mark.slow
def test_two_ranks_share_the_compile_and_train_as_an_unshared_run(tmp_path):
    ranks = run_ranks(_share_scenarios, str(tmp_path), timeout=900)
    n = ranks[0]["unshared"]["partitions"]
    for r, res in enumerate(ranks):
        base = res["unshared"]
        assert n >= 4 and base["partitions"] == n and base["compiled"] == n and base["loaded"] == 0
        for name in ("shared", "cannot_load", "damaged"):
            got = res[name]
            assert got["statuses"] == {"compiled"}, name
            assert got["losses"] == pytest.approx(base["losses"], abs=1e-6), name
            for p, q in zip(got["params"], base["params"]):
                torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
        shared = res["shared"]
        assert (shared["compiled"] + shared["loaded"], shared["fell_back"]) == (n, 0)
        assert shared["hits"] >= shared["loaded"]  # every loaded partition was an AOTAutograd cache hit
    # One compile per partition for the job, each by whichever rank reached it first.
    assert ranks[0]["shared"]["compiled"] + ranks[1]["shared"]["compiled"] == n
    # Rank 1 cannot load: it compiles what rank 0 compiled too; rank 0 still loads rank 1's compiles.
    claimed_by_0 = ranks[0]["cannot_load"]["compiled"]
    assert (ranks[1]["cannot_load"]["compiled"], ranks[1]["cannot_load"]["fell_back"]) == (n, claimed_by_0)
    assert ranks[0]["cannot_load"]["loaded"] == n - claimed_by_0
    # Every publication damaged: every rank compiles every partition, and says why for each it did not claim.
    for res in ranks:
        assert (res["damaged"]["compiled"], res["damaged"]["loaded"]) == (n, 0)
    assert sum(res["damaged"]["fell_back"] for res in ranks) == n


def _apart(rank, world_size, tmp):
    res = _train(rank, share=True, inductor_dir=tmp, per_rank=True)
    res["so_files"] = len(list(Path(tmp, f"rank{rank}").rglob("*.so")))
    return res


@pytest.mark.slow
def test_kernels_travel_to_a_rank_with_an_inductor_dir_of_its_own(tmp_path):
    # One Inductor directory per rank, as on separate machines, in fresh processes (the kernels
    # loaded in a process stay in its memory). Kernels a rank lacked arrive with the other rank's
    # artifacts and are installed, not built: its directory holds more libraries than it built.
    ranks = run_ranks(_apart, str(tmp_path), timeout=600)
    for res in ranks:
        assert res["loaded"] > 0 and res["statuses"] == {"compiled"} and res["so_files"] >= res["builds"]
    assert sum(r["installed"] for r in ranks) > 0
    assert sum(r["so_files"] for r in ranks) > sum(r["builds"] for r in ranks)


def _slow_rank_step(rank, world_size, ours, delay_s):
    """One step of a small DDP model whose compile on rank 1 takes ``delay_s`` longer."""
    from ddp_opt import compile_ddp

    def slow_aot_eager(gm, example_inputs):
        if rank == 1:
            time.sleep(delay_s)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(2)])
    ddp = DDP(model, bucket_cap_mb=1)
    if ours:
        step = compile_ddp(ddp, backend=slow_aot_eager, share=True)
    else:
        torch._dynamo.config.optimize_ddp = True  # PyTorch's own splitter, the same slow backend
        model.forward = torch.compile(model.forward, backend=slow_aot_eager)
        step = ddp
    try:
        step(torch.randn(8, 512)).sum().backward()
    except RuntimeError as e:
        return f"failed: {e}"
    return "ok"


@pytest.mark.slow
@pytest.mark.alone  # a 3 s collective timeout: a loaded machine could reach it where the test means it not to
def test_a_slow_compiling_rank_does_not_time_out_the_first_all_reduce():
    # The process group times out collectives after 3 s; rank 1 compiles each graph 5 s longer.
    assert run_ranks(_slow_rank_step, True, 5.0, pg_timeout_s=3.0, timeout=300) == ["ok", "ok"]
    # The control: PyTorch's splitter with the same backend times out on the rank that waited.
    results = run_ranks(_slow_rank_step, False, 5.0, pg_timeout_s=3.0, timeout=300)
    assert results[0].startswith("failed") and "timed out" in results[0].lower(), results
