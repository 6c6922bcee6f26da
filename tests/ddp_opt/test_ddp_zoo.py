"""A model zoo on two gloo ranks: for each tiny ``transformers`` architecture, with the
loss computed outside the model and by the model (``labels=``), compile_ddp with
``aot_eager`` trains like eager DDP, every partition of every graph is compiled, and
DDP's runtime buckets are exactly the partitions.

All architectures run in one spawned 2-rank job (spawning and the process group are
the costly part); each (architecture, loss) pair is then checked by its own test.
"""

import pytest

import _zoo

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def zoo(run_ranks):
    """Each rank's results, keyed by (architecture, variant)."""
    return run_ranks(_zoo.zoo_rank, list(_zoo.ARCHS), timeout=900)


def _graphs(r):
    """One line on the captured graphs: partitions and parameters per graph, and the breaks."""
    graphs = r["graphs"]
    at = [g["break_at"] for g in graphs if g["break_at"]]
    reasons = sorted({reason.splitlines()[0] for reason in r["break_reasons"]})
    return (f"{len(graphs)} graph(s), partitions {[g['partitions'] for g in graphs]}, "
            f"parameters {[len(g['params']) for g in graphs]}, "
            + (f"graph breaks at {at}: {reasons}" if at or reasons else "no graph break"))


@pytest.mark.parametrize("variant", _zoo.VARIANTS)
@pytest.mark.parametrize("arch", list(_zoo.ARCHS))
def test_compiled_ddp_trains_like_eager_ddp_on_aligned_buckets(zoo, arch, variant):
    for rank, results in enumerate(zoo):
        r = results[arch, variant]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        where = f"{arch}, loss {variant}, rank {rank} ({_graphs(r)})"
        for step, (loss, ref_loss) in enumerate(r["losses"]):
            assert loss == pytest.approx(ref_loss, rel=_zoo.RTOL, abs=_zoo.ATOL), f"{where}: loss at step {step}"
        assert not r["params_beyond_tolerance"], (
            f"{where}: parameters after {_zoo.STEPS} steps differ from eager DDP's: {r['params_beyond_tolerance']} "
            f"(max {r['max_param_diff']:.2e} on {r['worst_param']})")
        eager = [(i, s) for i, g in enumerate(r["graphs"]) for s in g["statuses"] if s != "compiled"]
        errors = [e for g in r["graphs"] for e in g["errors"]]
        assert not eager, f"{where}: partitions not compiled (graph, status): {eager}; errors: {errors}"
        assert r["runtime_buckets"] >= 2, f"{where}: bucket_cap_mb={_zoo.BUCKET_CAP_MB} should give several buckets"
        if _zoo.ARCHS[arch].params_outside_graphs:
            # Parameters of frames dynamo runs eagerly are in no partition: realignment cannot reach 1.0,
            # and the warning names them.
            assert r["params_outside_graphs"] and r["alignment"] < 1.0, where
            (warning,) = r["realign_warnings"]
            assert "are in no compiled graph" in warning and r["params_outside_graphs"][0] in warning, warning
            continue
        assert not r["realign_warnings"], f"{where}: {r['realign_warnings']}"
        assert r["partitions_with_params"] == r["runtime_buckets"], (
            f"{where}: compiled.buckets has {r['partitions_with_params']} partition(s) with parameters "
            f"({r['partitions']} in all), DDP {r['runtime_buckets']} runtime bucket(s)")
        assert r["alignment"] == 1.0, (
            f"{where}: DDP's runtime buckets are not the partitions (alignment {r['alignment']}, "
            f"parameters in no graph: {r['params_outside_graphs']})")
    # The ranks saw different data: the parameters equal to eager DDP's are DDP's doing.
    assert zoo[0][arch, variant]["losses"][0] != zoo[1][arch, variant]["losses"][0]
