"""Checkpoints: DCP checkpoints written then published (``store``), the run identity
and manifest that tie a checkpoint to its run (``run_identity``), and the resume
policy (``resume``)."""
