"""The studies, one entry point each (``python -m benchmarks.studies.<name>``):
``ddp_compare`` (with ``ddp_bench``, ``modes_ddp``, ``ddp_mode``, ``sweep``),
``fsdp_compare`` (with ``fsdp_bench``), ``compile_time``, ``compile_share`` (with
``rank_inductor``, its per-rank torchrun entry), ``convergence``, ``padding_compare``,
``step_gate_peers``, ``gpu_check``, ``checkpoint_checksum`` and ``lightning_compare``
(with ``lightning_modes`` and ``lightning_fits``). Nothing is imported here."""
