"""Backend resolution: names, modes, options, callables, and the errors for bad ones."""

import pytest
import torch

from compiler import CompileOptions, resolve_backend
from compiler.graph.backends import valid_backend_names, valid_modes


def test_known_names_resolve_to_callables():
    for name in ("eager", "aot_eager", "inductor"):
        assert callable(resolve_backend(name))
    assert {"eager", "aot_eager", "inductor"} <= set(valid_backend_names())


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"Unknown compile backend 'indcutor'.*Valid names: .*aot_eager.*inductor"):
        resolve_backend("indcutor")


def test_mode_and_options_reach_inductor_config():
    fn = resolve_backend("inductor", mode="max-autotune-no-cudagraphs", options={"shape_padding": True})
    assert fn.config["shape_padding"] is True
    assert fn.config["max_autotune"] is True


def test_unknown_mode_lists_valid_modes():
    assert "reduce-overhead" in valid_modes()
    with pytest.raises(ValueError, match=r"Unknown inductor mode 'fast'.*Valid modes: .*max-autotune"):
        resolve_backend("inductor", mode="fast")


def test_unknown_inductor_option_is_a_value_error():
    with pytest.raises(ValueError, match=r"Inductor rejected options .*not_an_option"):
        resolve_backend("inductor", options={"not_an_option": 1})


def test_mode_with_non_inductor_backend_is_refused():
    with pytest.raises(ValueError, match=r"inductor settings, but backend='aot_eager'"):
        resolve_backend("aot_eager", mode="max-autotune")


def test_callable_passes_through_and_refuses_mode():
    def my_backend(gm, example_inputs):
        return gm.forward

    assert resolve_backend(my_backend) is my_backend
    with pytest.raises(ValueError, match=r"backend callable .*my_backend.*silently dropped"):
        resolve_backend(my_backend, options={"shape_padding": True})


def test_non_callable_non_string_is_a_type_error():
    with pytest.raises(TypeError, match=r"backend must be a dynamo backend name or a callable"):
        resolve_backend(42)


def test_backend_spec_resolves_and_compiles():
    fn = CompileOptions("aot_eager").resolve_backend()
    model = torch.nn.Linear(3, 2)
    compiled = torch.compile(model, backend=fn)
    x = torch.randn(4, 3)
    torch.testing.assert_close(compiled(x), model(x))
