"""Training data: the contract a dataset follows and the synthetic default (``source``),
token files (``tokens``), the dataset the config names (``build``), and the padding
strategies that batch it (``batching``).

``launch.data.SyntheticTokens`` stays a valid ``data._target_`` (``configs/data/custom.yaml``).
"""

from .build import build_data
from .source import SyntheticTokens, TokenSource, stream_seed

__all__ = ["SyntheticTokens", "TokenSource", "build_data", "stream_seed"]
