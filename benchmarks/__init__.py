"""Side-by-side measurements of the toolkit against its peers, each mode in the same
job and in turns (DESIGN.md, "How performance is measured here").

Command lines (``python -m benchmarks.<name>``, documented in docs/benchmarks/):
``ddp_compare`` (eager DDP, PyTorch's splitter, nosplit, ours, regional; ``--sweep``),
``fsdp_compare`` (FSDP2 eager, per-block compile, grouped shard units),
``compile_time`` (cold and warm first steps across restarts), ``padding_compare``
(padding strategies through the launcher) ``readme_results`` (a DDP docs
section from the JSON), ``docs_pages`` (every generated docs table from the committed JSON) and
``step_gate_peers`` (a recompile on one rank longer than the timeout, under PyTorch's mechanisms and ours).

Inside: ``core`` (the measuring core both interleaved benchmarks share), ``modes_ddp``
and ``ddp_bench`` / ``sweep`` (DDP), ``fsdp_bench`` (FSDP), ``report`` (tables, docs
sections, ``print0``), ``link`` (the simulated-link comm hook), ``stats``, ``rounds``,
``plot``, ``cli``, ``device`` (``--device``: a rank's GPU and process group, clocks that
wait for the GPU, peak memory), ``torchrun``, and ``_torch_internals`` (every private
torch name used).

Nothing is imported here, so ``python -m benchmarks.stats`` and friends stay light;
``__all__`` names the modules used from outside the package (the command lines, and
``link``, which ``tests/test_ddp_autoplan.py`` drives ``compile_ddp``'s auto plan with).
"""

__all__ = ["compile_time", "ddp_compare", "docs_pages", "fsdp_compare", "link", "padding_compare", "readme_results"]
