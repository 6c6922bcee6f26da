"""Backend resolution: turn what a user wrote (a name, a mode, options) into one
dynamo backend callable ``(gm, example_inputs) -> callable``.

Every entry point of the toolkit resolves its backend here, so that an unknown
name or mode fails the same way everywhere: early, before any process group or
compile starts, with the list of valid choices.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .. import _torch_internals as _ti
from ..torch_release import warn_if_torch_untested

log = logging.getLogger(__name__)

BackendFn = Callable[[torch.fx.GraphModule, list], Callable[..., Any]]

__all__ = ["BackendFn", "SettingError", "resolve_backend", "valid_backend_names", "valid_modes"]


class SettingError(ValueError):
    """A bad value for one named setting of a library config.

    ``setting`` is the library's name for it (``"backend"``, ``"mode"``,
    ``"options"``, ``"fallback"``, ...), so that an entry point can name the
    setting in its own spelling (the launcher says ``compile.backend=...``).
    """

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


def valid_backend_names() -> list[str]:
    """Names dynamo knows, debug backends included (``aot_eager`` is one)."""
    return _ti.backend_names()


def valid_modes() -> list[str]:
    """Inductor modes accepted by ``torch.compile(mode=...)``."""
    return _ti.inductor_mode_names()


def resolve_backend(
    backend: str | Callable = "inductor",
    *,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    dynamic: bool | None = None,
) -> BackendFn:
    """Resolve a backend name or callable into a dynamo backend callable.

    Args:
        backend: a registered dynamo backend name (``"eager"``, ``"aot_eager"``,
            ``"inductor"``, ...) or a callable ``(gm, example_inputs) -> callable``.
        mode: an inductor mode (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``,
            ``"max-autotune-no-cudagraphs"``). Only the inductor backend takes one.
        options: inductor config options (``{"shape_padding": True}``); inductor only.
        dynamic: forwarded to inductor's mode resolution, as ``torch.compile`` does.

    Returns:
        A callable usable as a dynamo backend.

    Raises:
        ValueError: unknown backend name or mode, or mode/options given to a
            backend that cannot use them.
    """
    warn_if_torch_untested()  # every entry point passes here before its first compile
    if callable(backend) and not isinstance(backend, str):
        _refuse_inductor_settings(
            mode, options,
            f"were given together with a backend callable ({getattr(backend, '__name__', backend)!r}). A callable "
            "backend receives only (gm, example_inputs), so they would be silently dropped. Bake them into the "
            "callable yourself, or pass backend='inductor' to use them.",
        )
        return backend
    if not isinstance(backend, str):
        raise TypeError(
            f"backend must be a dynamo backend name or a callable (gm, example_inputs) -> callable, "
            f"got {type(backend).__name__}."
        )
    names = valid_backend_names()
    if backend not in names:
        raise SettingError(
            "backend",
            f"Unknown compile backend {backend!r}: dynamo has no backend registered under that name. "
            f"Valid names: {', '.join(names)}. Use 'aot_eager' to debug, 'inductor' for speed, "
            "or 'eager' to capture graphs without compiling."
        )
    if backend != "inductor":
        _refuse_inductor_settings(
            mode, options,
            f"are inductor settings, but backend={backend!r}: the {backend!r} backend would reject or ignore them. "
            "Drop mode/options, or use backend='inductor'.",
        )
        return _ti.named_backend(backend, dynamic)
    if mode is not None and mode not in valid_modes():
        raise SettingError(
            "mode",
            f"Unknown inductor mode {mode!r}. Valid modes: {', '.join(valid_modes())}. "
            "Leave mode unset for inductor's default."
        )
    try:
        return _ti.inductor_backend(mode, options or None, dynamic)
    except RuntimeError as e:
        # inductor's own message lists every known option; keep it, add what to do.
        raise SettingError(
            "options",
            f"Inductor rejected options {options!r}: {e}. Fix or remove the option "
            "(see torch._inductor.config for the valid names and types)."
        ) from e


def _refuse_inductor_settings(mode: str | None, options: dict[str, Any] | None, why: str) -> None:
    """Raise when an inductor mode or options were given where they cannot apply."""
    if mode not in (None, "default") or options:
        raise SettingError("mode" if mode not in (None, "default") else "options",
                           f"mode={mode!r} / options={options!r} {why}")
