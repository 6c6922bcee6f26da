"""Every rank runs the same config: checked by one small collective as the process
group starts.

Ranks are started by separate processes (torchrun's workers, Slurm tasks, several
machines), each composing its own config. Ranks that disagree on ``train.steps``
leave the rank with more steps waiting in a collective until ``train.timeout_s``;
ranks that disagree on ``train.lr`` train their replicas apart without a word.
Each rank hashes its config and the hashes are gathered; only when they differ are
the configs themselves gathered, to name the keys that differ.
"""

from __future__ import annotations

import json
from typing import Any

import torch.distributed as dist

from ..checkpoint.run_identity import digest_of, flat_config
from ..config.schema import ConfigError, JobConfig

__all__ = ["config_digest", "check_same_config", "differing_keys"]


def config_digest(cfg: JobConfig) -> tuple[str, dict[str, str]]:
    """The config as flat ``key -> JSON text of the value`` and its sha256."""
    flat = {k: json.dumps(v) for k, v in flat_config(cfg).items()}
    return digest_of(flat), flat


def differing_keys(configs: list[dict[str, str]]) -> dict[str, list[str]]:
    """For each key whose value is not the same on every rank, its value on each rank."""
    keys = sorted(set().union(*configs))
    return {k: [c.get(k, "<missing>") for c in configs] for k in keys if len({c.get(k) for c in configs}) > 1}


def check_same_config(cfg: JobConfig) -> None:
    """Refuse a job whose ranks were given different configs (every rank raises the
    same :class:`ConfigError`). Call right after the process group starts."""
    world = dist.get_world_size()
    if world == 1:
        return
    digest, flat = config_digest(cfg)
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return
    configs: list[Any] = [None] * world
    dist.all_gather_object(configs, flat)
    diff = differing_keys(configs)
    shown = "; ".join(f"{k}: " + ", ".join(f"{v} on rank {r}" for r, v in enumerate(values))
                      for k, values in list(diff.items())[:8])
    more = f" (and {len(diff) - 8} more keys)" if len(diff) > 8 else ""
    raise ConfigError(
        f"the ranks were started with different configs: {shown}{more}. Every rank must run the same config: "
        "a rank with fewer steps leaves the others waiting in a collective until train.timeout_s, and a "
        "different learning rate or model trains the replicas apart. Start every rank with the same overrides "
        "(and the same environment variables any ${oc.env:...} in them reads)."
    )
