"""Side-by-side measurements: eager DDP vs PyTorch's splitter vs compiling without
splitting vs ``compile_ddp``, in one job, over a simulated link.

Modules: ``ddp_compare`` (command line), ``harness`` (what each rank runs),
``link`` (simulated-link comm hook), ``stats`` (medians, ratios, overlap),
``plot`` (step time vs cap), ``readme_results`` (README table from the JSON).
Nothing is imported here, so ``python -m benchmarks.stats`` and friends stay light.
"""
