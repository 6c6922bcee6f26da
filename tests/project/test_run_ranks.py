"""The test helper ``run_ranks`` (Note [Ranks forked from a server that imported torch]): its
ranks come from a fork server started once per session, yet each rank sees the test's
environment, temporary folder and working directory as of the call, and a rank's failure
reaches the test with its traceback."""

import os
import tempfile

import pytest


def _what_the_rank_sees(rank, world_size):
    import torch.distributed as dist

    return dict(mark=os.environ.get("DISTCOMPILE_RUN_RANKS_MARK"), tmp=tempfile.gettempdir(), cwd=os.getcwd(),
                rank=dist.get_rank(), world=dist.get_world_size(), pid=os.getpid())


def _rank_1_reads_the_store_after_rank_0_returned(rank, world_size):
    import time

    from compiler._torch_internals import default_store

    store = default_store()  # hosted by rank 0's process (a tcp:// rendezvous)
    if rank == 0:
        store.set("left", b"rank 0 returned")
        return "returned"
    time.sleep(2)  # rank 0's function has returned by now; its process must still serve the store
    return store.get("left").decode()


def _fails_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 was told to fail")
    return rank


@pytest.mark.parametrize("mark", ["first", "second"])  # the second call reuses the server the first started
def test_each_rank_sees_the_tests_environment_tmpdir_and_folder_at_the_call(run_ranks, tmp_path, monkeypatch, mark):
    monkeypatch.setenv("DISTCOMPILE_RUN_RANKS_MARK", mark)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    seen = run_ranks(_what_the_rank_sees)
    assert [s["rank"] for s in seen] == [0, 1] and {s["world"] for s in seen} == {2}
    assert {s["mark"] for s in seen} == {mark}
    assert {s["tmp"] for s in seen} == {str(tmp_path)} and {s["cwd"] for s in seen} == {str(tmp_path)}
    assert len({s["pid"] for s in seen} | {os.getpid()}) == 3


def test_a_failing_rank_reaches_the_test_with_its_traceback(run_ranks):
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed:.*ValueError: rank 1 was told to fail"):
        run_ranks(_fails_on_rank_1)


def test_a_group_that_fails_to_form_is_started_once_more_and_the_function_runs_once(run_ranks, tmp_path,
                                                                                    monkeypatch):
    flag = tmp_path / "failed-once"
    monkeypatch.setenv("DISTCOMPILE_TEST_FAIL_INIT_ONCE", str(flag))
    seen = run_ranks(_what_the_rank_sees)
    assert flag.exists() and [s["rank"] for s in seen] == [0, 1]


def test_rank_0_hosts_the_store_until_every_rank_is_done_with_it(run_ranks):
    # Before, rank 0 left as soon as its function returned, and a peer still reading the store had its
    # connection reset (Note [Ranks forked from a server that imported torch])
    assert run_ranks(_rank_1_reads_the_store_after_rank_0_returned) == ["returned", "rank 0 returned"]
