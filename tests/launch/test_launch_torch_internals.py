"""One small test per private torch access of the launcher (``launch/runtime/_torch_internals.py``):
if a torch upgrade changes what one relies on, it fails here, by name."""

import pytest
import torch

import launch.runtime._torch_internals as lti


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _counting(graphs: list):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


def test_recompile_limit_is_dynamo_s_setting():
    assert lti.recompile_limit() == torch._dynamo.config.recompile_limit == 8


def test_error_on_recompile_raises_recompile_error_inside_the_block_only():
    fn = torch.compile(lambda x: x * 2, backend=_counting([]), dynamic=False)
    fn(torch.ones(2))
    with pytest.raises(lti.RecompileError), lti.error_on_recompile():
        fn(torch.ones(3))
    fn(torch.ones(4))  # outside the block a new shape recompiles quietly


def test_mark_dynamic_compiles_one_graph_for_every_length():
    graphs = []
    fn = torch.compile(lambda x: x.sum(), backend=_counting(graphs))
    for n in (4, 6, 9):
        x = torch.ones(2, n)
        lti.mark_dynamic(x, 1)
        fn(x)
    assert len(graphs) == 1


# --- torchrun's Python side, which distcompile-train runs in its own process ---------------------


def test_torchruns_parser_has_the_flags_the_launcher_splits_on():
    actions = {opt: a for a in lti.torchrun_parser()._actions for opt in a.option_strings}
    assert actions["--standalone"].nargs == 0 and actions["--no-python"].nargs == 0  # switches
    for flag in ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id",
                 "--max-restarts", "--nproc_per_node"):
        assert actions[flag].nargs != 0, flag  # each takes a value
    assert {"-m", "--module", "--run-path"} <= set(actions)


def test_torchrun_args_puts_the_program_and_its_arguments_after_the_flags():
    args = lti.torchrun_args(["--standalone", "--nproc-per-node", "2", "--no-python", "/bin/prog", "-u", "a=1"])
    assert args.standalone and args.no_python and args.nproc_per_node == "2" and args.max_restarts == 0
    assert args.training_script == "/bin/prog" and args.training_script_args == ["-u", "a=1"]


def test_torchrun_sizes_reads_nnodes_and_nproc_per_node_as_torchrun_does():
    assert lti.torchrun_sizes(lti.torchrun_args(["--nnodes", "1:3", "--nproc-per-node", "2", "p"])) == (1, 3, 2)
    assert lti.torchrun_sizes(lti.torchrun_args(["p"])) == (1, 1, 1)
    with pytest.raises(ValueError, match="--nproc-per-node='two'"):
        lti.torchrun_sizes(lti.torchrun_args(["--nproc-per-node", "two", "p"]))


def test_run_torchrun_returns_the_failed_workers_and_turns_a_signal_into_agent_signalled(tmp_path, monkeypatch):
    import json
    import signal

    import torch.distributed.run as torchrun_module
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {"message": "boom", "extraInfo": {"timestamp": "7"}}}))
    failures = {1: ProcessFailure(local_rank=1, pid=11, exitcode=3, error_file=str(error_file)),
                0: ProcessFailure(local_rank=0, pid=10, exitcode=-15, error_file=str(tmp_path / "none.json"))}

    def fails(args):
        raise ChildFailedError(name="job", failures=failures)

    monkeypatch.setattr(torchrun_module, "run", fails)
    got = sorted(lti.run_torchrun(None), key=lambda w: w.rank)
    assert got[0] == lti.FailedWorker(0, 0, 10, -15, None, {"message": "<NONE>"})
    assert got[1] == lti.FailedWorker(1, 1, 11, 3, str(error_file), json.loads(error_file.read_text()))

    def signalled(args):
        raise SignalException("SIGTERM", signal.SIGTERM)

    monkeypatch.setattr(torchrun_module, "run", signalled)
    with pytest.raises(lti.AgentSignalled) as e:
        lti.run_torchrun(None)
    assert e.value.signum == signal.SIGTERM
    monkeypatch.setattr(torchrun_module, "run", lambda args: None)
    assert lti.run_torchrun(None) == []
