"""compiler.graph.backend_chain.build_backend (Note [Backend wrapping order]): the layers stacked
in one order, with a recording stand-in for CompileShare; no process group, nothing compiled."""

from torch._functorch import config as functorch_config

from compiler.graph.backend_chain import build_backend


class _Share:
    """Records the wrappers CompileShare would add, by the same public methods."""

    def __init__(self, calls):
        self.calls, self.barrier_if = calls, "unset"

    def wrap_compile(self, backend):
        return _layer(self.calls, "share.wrap_compile", backend)

    def wrap_graph(self, backend, barrier_if=None):
        self.barrier_if = barrier_if
        return _layer(self.calls, "share.wrap_graph", backend)


def _layer(calls, name, backend):
    def run(gm, example_inputs):
        calls.append(name)
        return backend(gm, example_inputs)

    return run


def _plain(calls):
    def backend(gm, example_inputs):
        calls.append(f"backend(lazy_backward={not functorch_config.force_non_lazy_backward_lowering})")
        return "compiled"

    return backend


def test_the_layers_run_outermost_first_in_the_documented_order():
    calls = []
    share = _Share(calls)

    def when(inputs):
        return True

    backend = build_backend(_plain(calls), share=share, transform=lambda b: _layer(calls, "transform", b),
                            wrap_backend=lambda b: _layer(calls, "wrap_backend", b), barrier_if=when)
    assert backend("gm", []) == "compiled"
    assert calls == ["share.wrap_graph", "wrap_backend", "transform", "share.wrap_compile",
                     "backend(lazy_backward=True)"]
    assert share.barrier_if is when


def test_without_a_share_only_the_backward_is_compiled_with_its_forward_when_asked():
    calls = []
    build_backend(_plain(calls), backward_with_forward=True, transform=lambda b: _layer(calls, "transform", b))("gm", [])
    build_backend(_plain(calls))("gm", [])
    assert calls == ["transform", "backend(lazy_backward=False)", "backend(lazy_backward=True)"]


def test_a_share_is_not_asked_to_compile_backward_again():
    calls = []
    build_backend(_plain(calls), share=_Share(calls), backward_with_forward=True)("gm", [])
    assert calls == ["share.wrap_graph", "share.wrap_compile", "backend(lazy_backward=True)"]
