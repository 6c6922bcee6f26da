"""Markers for features a torch release of the supported range may lack (docs/getting-started.md's
compatibility table): a test of such a feature is skipped there, naming what is missing."""

import pytest

from ddp_opt._torch_internals import REALIGN_SUPPORTED, missing_for_realignment

NO_REALIGNMENT = f"bucket realignment is off on this torch: it lacks {', '.join(missing_for_realignment())}"
needs_realignment = pytest.mark.skipif(not REALIGN_SUPPORTED, reason=NO_REALIGNMENT)
