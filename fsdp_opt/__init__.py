"""FSDP2 (fully_shard) + per-block compile. Not built yet: see the project's issues."""

__all__: list[str] = []
