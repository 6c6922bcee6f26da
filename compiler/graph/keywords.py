"""Entry points whose keywords are the fields of their settings dataclass: the signature
that ``help()`` and ``inspect.signature`` show, and the refusal of a keyword that is no field.

Note [Keywords from a config]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Background
    ``compile_ddp`` and ``fsdp_opt.apply`` take their settings either as one frozen
    dataclass (``config=``) or as keywords. A keyword list written by hand beside the
    dataclass drifts from it: a new field needs a second edit to become a keyword, and
    a default can differ between the two.

Algorithm
    The entry point takes ``**settings`` and builds the dataclass from them; its
    ``__signature__`` is made here from the dataclass's fields, each a keyword-only
    parameter with the field's default and annotation, between the parameters the
    entry point names itself (the model, ``config``, a mesh) and an optional
    ``**more``. A keyword that is no field is refused with the closest field and
    the list of all of them.

Notes
    A field that is not a user setting (how messages spell a setting) is left out by
    name (``skip``). The signature is what tools show; the dataclass stays the one
    place where a setting, its default and its check are written.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import MISSING, fields
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["keyword_signature", "setting_names", "refuse_unknown_keywords"]


def setting_names(config_cls: type, skip: Iterable[str] = ()) -> list[str]:
    """The fields of ``config_cls`` that are keywords of its entry point, in field order."""
    skipped = set(skip)
    return [f.name for f in fields(config_cls) if f.name not in skipped]


def keyword_signature(config_cls: type, leading: Sequence[inspect.Parameter] = (),
                      trailing: Sequence[inspect.Parameter] = (), skip: Iterable[str] = ()) -> inspect.Signature:
    """``leading``, then every field of ``config_cls`` (but ``skip``) as a keyword-only
    parameter with its default, then ``trailing`` (Note [Keywords from a config])."""
    skipped = set(skip)
    keyword = inspect.Parameter.KEYWORD_ONLY
    settings = [inspect.Parameter(f.name, keyword, annotation=f.type,
                                  default=f.default if f.default_factory is MISSING else f.default_factory())
                for f in fields(config_cls) if f.name not in skipped]
    return inspect.Signature([*leading, *settings, *trailing])


def refuse_unknown_keywords(entry: str, given: Mapping[str, Any], config_cls: type, skip: Iterable[str] = ()) -> None:
    """Raise for the first keyword in ``given`` that is no field of ``config_cls``.

    Raises:
        TypeError: naming the keyword, the closest field and every field.
    """
    known = setting_names(config_cls, skip)
    for name in given:
        if name in known:
            continue
        near = difflib.get_close_matches(name, known, n=1)
        raise TypeError(
            f"{entry}() got an unexpected keyword argument {name!r}: it is not a setting of {entry}, whose "
            f"keywords are the fields of {config_cls.__module__.split('.')[0]}.{config_cls.__name__} "
            f"({', '.join(known)}), so nothing would read it."
            + (f" Did you mean {near[0]}=?" if near else " Drop it or pass one of those."))
