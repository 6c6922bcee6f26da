"""Docs rendering from the committed results: ``pages`` (every generated docs block,
``python -m benchmarks.render.pages``), ``readme_results``, ``compression_report`` and
``ablation``. Nothing is imported here."""
