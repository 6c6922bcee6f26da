"""The old import path of three config names, kept for the tests outside ``launch``
that still use it (tests/test_compile_time_config.py, tests/test_ddp_autoplan.py).
New code imports from where the names live: ``launch.schema`` (schemas,
:class:`ConfigError`, :func:`register_configs`) and ``launch.validate``."""

from .schema import ConfigError, register_configs
from .validate import validate

__all__ = ["ConfigError", "register_configs", "validate"]
