"""The job's config composed in this process with Hydra's compose API, as ``python -m
launch.train`` composes it, each failure as one :class:`ConfigError` in the toolkit's words.

``distcompile-train`` (``launch.launcher``) composes here before any rank starts; the Hydra
shell (``launch.config.shell``) composes here before ``hydra.main`` does, so that a value Hydra
cannot take is one line also under torchrun.

Note [Hydra's errors in our words]

Background
    Every field of the job is typed (``launch.config.schema``). A value of the wrong type
    (``train.steps=abc``) fails while Hydra composes, and Hydra printed its own report: the
    override, OmegaConf's ``Value 'abc' of type 'str' could not be converted to Integer`` with
    the schema's class names, and ``Set the environment variable HYDRA_FULL_ERROR=1``: seven
    lines that name no fix, once per rank under torchrun.

Algorithm
    Compose with ``hydra.compose`` on the job's config folder (or the ``--config-path`` and
    ``--config-name`` given, the job's folder on the search path as
    Note [Command line before Hydra] puts it) and turn what it raises into one line:

    - a value of the wrong type (OmegaConf's ``ValidationError`` under Hydra's
      ``ConfigCompositionException``): the key, the type the schema gives it in words ("an
      integer", "true or false", "a list of numbers"), and an example value, the field's
      default where it has one;
    - an option a config group does not have (``model=gpt_huge``): the group's options;
    - an override Hydra cannot parse (``train.steps=[1``): the override and the parser's
      first line;
    - anything else Hydra or OmegaConf raises while composing: its first line.

Notes
    Only Hydra's and OmegaConf's exceptions are turned into lines; any other error is a
    bug and keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Sequence

from .argv import check_argv, hydra_flags
from .location import CONFIG_DIR
from .schema import ConfigError, JobConfig, register_configs, to_job_config

__all__ = ["compose", "compose_job", "type_error"]

_SHELL_DIR = Path(__file__).resolve().parent  # a relative --config-path is relative to the shell's package


def compose_job(argv: Sequence[str]) -> JobConfig:
    """The :class:`JobConfig` that ``python -m launch.train ARGV`` would run (not validated).

    Raises:
        ConfigError: the command line (Note [Command line before Hydra]) or a value Hydra
            cannot compose (see the Note), in one message with the fix.
    """
    argv, problem = check_argv(argv)
    if problem is not None:
        raise ConfigError(problem)
    return to_job_config(compose(argv))


def compose(argv: Sequence[str]) -> Any:
    """Hydra's composed config (a ``DictConfig``) for ``argv`` as :func:`check_argv` returns it:
    its overrides, ``--config-path``/``--config-dir``/``--config-name`` honoured, other flags
    ignored.

    Raises:
        ConfigError: what Hydra or OmegaConf refused, in one line (see the Note).
    """
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    flags = hydra_flags(argv)
    overrides = _overrides(argv)
    folder = Path(flags["path"]) if "path" in flags else CONFIG_DIR
    if not folder.is_absolute():
        folder = _SHELL_DIR / folder
    if "dir" in flags:
        overrides.append(f"hydra.searchpath=['file://{Path(flags['dir']).resolve()}']")
    register_configs()
    try:
        with initialize_config_dir(config_dir=str(folder), version_base="1.3"):
            return hydra_compose(config_name=flags.get("name", "config"), overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_in_our_words(e)) from None


def _overrides(argv: Sequence[str]) -> list[str]:
    """The overrides of ``argv``: what is not a flag nor a flag's value."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = "=" not in arg and arg in ("--config-path", "-cp", "--config-dir", "-cd", "--config-name", "-cn")
        else:
            out.append(arg)
    return out


def _in_our_words(e: Exception) -> str:
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ValidationError

    cause = e.__cause__
    override = str(e).removeprefix("Error merging override ").strip() if str(e).startswith("Error merging") else ""
    if isinstance(cause, ValidationError) and cause.full_key and override:
        return type_error(override, cause.full_key)
    if isinstance(e, MissingConfigException) and e.missing_cfg_file and e.options is not None:
        group, _, option = e.missing_cfg_file.rpartition("/")
        if group and e.options:
            options = sorted(e.options)
            close = difflib.get_close_matches(option, options, n=1, cutoff=0.0)
            return (f"{group}={option}: the config group {group} has no option {option!r}, so there is nothing to "
                    f"compose. Pick one of its options: {', '.join(options)} (e.g. {group}={close[0]}).")
    if isinstance(e, OverrideParseException):
        return (f"{e.override!r} cannot be parsed as an override: {e.message.splitlines()[0]}. Write it as "
                "key=value; quote a value with spaces or brackets for the shell, e.g. 'profile.steps=[2,3]'.")
    first = str(cause if cause is not None and str(cause) else e).strip().splitlines()[0]
    where = f"{override}: " if override else ""
    return f"{where}the config could not be composed: {first}. Check the override against python -m launch.train --help."


def type_error(override: str, full_key: str) -> str:
    """The one line for ``override`` whose value the schema's type at ``full_key`` cannot take."""
    key, _, value = override.partition("=")
    key = key.lstrip("+~")
    field_key = full_key.split("[", 1)[0]
    hint, default = _field(field_key)
    words, example = _words(hint, default)
    return (f"{key}={value} is not valid: {field_key} is {words} (every setting is typed: "
            f"launch/config/schema.py), and {value!r} cannot be read as that. Give {words}, e.g. {field_key}={example}"
            + (" (the default)." if default is not None and example == _yaml(default) else "."))


def _field(full_key: str) -> tuple[Any, Any]:
    """The type hint and default of the JobConfig field at ``full_key`` (``train.steps``)."""
    cls: Any = JobConfig
    hint: Any = None
    default: Any = None
    for name in full_key.split("."):
        if not dataclasses.is_dataclass(cls):
            return None, None
        hints = typing.get_type_hints(cls)
        f = next((f for f in dataclasses.fields(cls) if f.name == name), None)
        if f is None:
            return None, None
        hint = hints[name]
        default = f.default if f.default is not dataclasses.MISSING else None
        cls = f.default_factory if f.default_factory is not dataclasses.MISSING else hint
    return hint, default


_WORDS = {int: ("an integer", "1"), float: ("a number", "1.0"), bool: ("true or false", "true"), str: ("a string", "x")}


def _words(hint: Any, default: Any) -> tuple[str, str]:
    """``hint`` in words, and an example value: ``default`` where there is one."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = typing.get_origin(hint) is typing.Union and len(args) < len(typing.get_args(hint))
    if optional and len(args) == 1:
        words, example = _words(args[0], default)
        return f"{words.replace(' or ', ', ')} or null", example
    if typing.get_origin(hint) in (list, typing.List):
        inner = args[0] if args else Any
        words = {int: "integers", float: "numbers", bool: "booleans", str: "strings"}.get(inner, "values")
        return f"a list of {words}", _yaml(default) if default is not None else "[1,2]"
    words, example = _WORDS.get(hint, ("a value of its type", "..."))
    return words, _yaml(default) if default is not None else example


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_yaml(v) for v in value) + "]"
    return str(value)
