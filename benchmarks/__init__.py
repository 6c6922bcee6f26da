"""Side-by-side measurements of the toolkit against its peers, each mode in the same
job and in turns (DESIGN.md, "How performance is measured here").

Grouped by role, one subpackage each:

- ``harness``: what every study shares (``core``, the measuring core; ``rounds``,
  ``stats``, ``limit``, ``report``, ``plot``, ``cli``, ``torchrun``, ``device``).
- ``link``: the simulated slow link (``shaping``: the comm hook; ``netns``: a shaped
  network namespace; ``peer_hooks``: PyTorch's compression hooks as peers).
- ``studies``: one entry point per study, run as ``python -m benchmarks.studies.<name>``
  (documented in docs/benchmarks/), with the modules only that study uses beside it.
- ``render``: the docs blocks from the committed JSON (``python -m benchmarks.render.pages``).

``_torch_internals`` stays at the top: the package's one place for private torch names.
The results (JSON and PNG) live in ``benchmarks/results/``. Nothing is imported here, so
``python -m benchmarks.harness.stats`` and friends stay light.
"""

__all__ = ["harness", "link", "render", "studies"]
