"""Checkpoints: DCP checkpoints written then published (``store``), the run identity
and manifest that tie a checkpoint to its run (``run_identity``), the files a checkpoint
must hold and their checksums (``integrity``), and the resume policy (``resume``)."""
