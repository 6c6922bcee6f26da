"""Turning benchmark results into text: value cells, Markdown and terminal tables,
Docs pages' sections between markers (a study's :class:`DocsBlock`), JSON files, and rank-0
progress lines.

No torch here, so rendering a docs section from committed JSON stays light.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from launch.runtime.dist import print0 as launch_print0

__all__ = ["print0", "fmt", "nan_to_none", "cap_label", "with_iqr", "markdown_table", "terminal_table",
           "replace_section", "update_section", "DocsBlock", "write_json", "write_result"]


def print0(*args, **kwargs) -> None:
    """The launcher's ``print0`` (global rank 0 only, flushed), to stderr so that stdout
    keeps just the table."""
    kwargs.setdefault("file", sys.stderr)
    launch_print0(*args, **kwargs)


def fmt(value: Any, spec: str) -> str:
    """``value`` formatted with ``spec``; ``-`` for a missing (None) or NaN value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def nan_to_none(x: float | None) -> float | None:
    """NaN as None, so that the JSON rows say "not measured" the same way everywhere."""
    return None if x is None or x != x else x


def cap_label(cap: float | str | None) -> str:
    """``4`` for 4.0 MiB, ``auto`` for the cost-model plan."""
    return str(cap) if isinstance(cap, str) or cap is None else f"{cap:g}"


def with_iqr(value: float | None, q1: float | None, q3: float | None, spec: str = ".3f") -> str:
    """``1.020 [0.990, 1.050]``: a median with its interquartile range when that is known."""
    text = fmt(value, spec)
    if q1 is not None and q3 is not None:
        text += f" [{fmt(q1, spec)}, {fmt(q3, spec)}]"
    return text


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table: header line, ``|---|`` line, one line per row."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def terminal_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The same table aligned for a terminal (tabulate's github format)."""
    from tabulate import tabulate

    return tabulate(rows, headers=headers, tablefmt="github")


def replace_section(text: str, body: str, start: str, end: str) -> str:
    """``text`` with everything between the ``start`` and ``end`` markers replaced by ``body``.

    Raises:
        ValueError: a marker is missing, repeated or out of order.
    """
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(
            f"Expected exactly one {start!r} followed by one {end!r} in the file, found "
            f"{text.count(start)} start and {text.count(end)} end marker(s). Add the two markers "
            "where the results belong; nothing outside them is touched."
        )
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{body}\n{end}{tail}"


def update_section(path: str | Path, body: str, start: str, end: str) -> str:
    """Rewrite the marked section of the file at ``path`` with ``body``; return ``body``."""
    path = Path(path)
    path.write_text(replace_section(path.read_text(), body, start, end))
    return body


@dataclass(frozen=True)
class DocsBlock:
    """A study's generated block of a docs page: its markers, the Markdown it is made of from the
    study's result (its JSON, loaded), and the page it lives on (relative to the repository)."""

    start: str
    end: str
    markdown: Callable[[Any], str]
    page: str

    @property
    def name(self) -> str:
        """``bench:padding`` for ``<!-- bench:padding:start -->``."""
        return self.start.removeprefix("<!-- ").removesuffix(":start -->")

    def write(self, result: Any, page: str | Path) -> str:
        """Rewrite the block in the file at ``page`` from ``result``; return the block."""
        return update_section(page, self.markdown(result), self.start, self.end)

    def write_from_json(self, json_path: str | Path, page: str | Path) -> str:
        """Rewrite the block in the file at ``page`` from the result JSON at ``json_path``; return the block."""
        return self.write(json.loads(Path(json_path).read_text()), page)


def write_json(data: Any, path: str | Path) -> None:
    """``data`` as indented JSON at ``path``, its folder made if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def write_result(result: dict, json_path: str | Path, readme: str | Path | None,
                 render: Callable[[str | Path, str | Path], None]) -> int:
    """The end of a benchmark's ``main``: ``result`` written to ``json_path``, its
    ``summary`` printed, and with ``readme`` that page's section regenerated by
    ``render(json_path, readme)``. Returns 0, the exit code."""
    write_json(result, json_path)
    print(json.dumps(result["summary"], indent=1))
    if readme:
        render(json_path, readme)
    return 0
