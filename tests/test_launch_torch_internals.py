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
