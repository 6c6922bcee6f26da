"""Inductor compiling every graph through its passes again, for the tests that read what a pass
records (the traced strategy's bucket fusion), in the rank's process only.

Note [Graph caches off, kernel files kept]
    A graph served by Inductor's FX graph cache or AOTAutograd's cache (left by an earlier run on
    this machine) skips the passes, and records nothing: these tests turn the caches off with
    ``force_disable_caches``, the switch a user would flip, so the product sees what such a user's
    run sees (the split strategy then compiles its partitions as with the caches off:
    ``compiler.graph.partition.aot_cache_enabled`` reads the switch, as AOTAutograd's own check does).
    That switch also gives every ``compile_fx`` a fresh, empty Inductor directory, so each C++ kernel
    was built by the C++ compiler again: in every graph, on every rank, in every run. The built
    kernel files are not what these tests check (the graphs, their order of collectives and the
    losses are), and a kernel file is named by its source's hash, so one built before is the same
    kernel. The fresh directory is dropped here: the kernels go to the process's own Inductor
    directory, as without the switch. Measured on the 2-core CI host (torch 2.15, a quiet machine):
    ``test_traced_inductor_fuses_bf16_buckets_by_gradient_bytes`` 61 s with a fresh directory per
    compile, 36 s with the kernels kept (one after the other); in whole slow-tier runs,
    ``test_two_rank_traced_inductor_fuses_by_ddp_caps_and_by_the_auto_plan`` 178 s then 76 s, and
    ``test_two_rank_inductor_fuses_the_buckets_with_the_update_in_backward`` 147 s then 58 s.
"""

import contextlib

import torch


def compile_every_graph() -> None:
    """Inductor's and AOTAutograd's graph caches off for this process, its kernel files kept
    (Note [Graph caches off, kernel files kept])."""
    from torch._inductor import compile_fx

    torch._inductor.config.force_disable_caches = True
    compile_fx.with_fresh_cache_if_config = contextlib.nullcontext
