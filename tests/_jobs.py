"""The main job's configs for the tests, one definition each: a config composed from
Hydra overrides as ``python -m launch.train`` composes it, and a tiny job built from the
dataclasses (the model size every in-process run uses)."""

from __future__ import annotations

from pathlib import Path

from launch.config.schema import JobConfig, ModelConfig, TrainConfig, register_configs, to_job_config

__all__ = ["ONE_BLOCK", "REFERENCE", "REFERENCE_RUN", "REFERENCE_STEPS", "TINY", "TINY_GPT", "TINY_OVERRIDES",
           "composed", "one_rank_main_model", "tiny_job"]

TINY = dict(n_layer=2, n_head=2, n_embd=64)  # the model of the in-process runs of the main job
# One narrow block, 16 positions: the runs that compile or step often (schedule, eval, step tests).
ONE_BLOCK = dict(n_layer=1, n_head=2, n_embd=32, block_size=16)
# A smaller GPT still (vocabulary 64, 16 positions) for the compile-cache and shared-compile tests,
# as GPTConfig keywords and as the main job's overrides.
TINY_GPT = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16)
TINY_OVERRIDES = [f"model.{k}={v}" for k, v in TINY_GPT.items()]

# The reference run under torchrun (the ``reference_run`` fixture, one per test session): small and
# quick to compile, split into several buckets by a 0.05 MiB cap, 8 steps with checkpoints after
# steps 2, 4, 6 and 8, all kept. A test that resumes or restarts it runs REFERENCE_RUN too.
REFERENCE = ["compile.backend=aot_eager", "model.n_layer=2", "model.n_embd=64", "model.n_head=2",
             "train.batch_size=4", "train.seq_len=32", "ddp.bucket_cap_mb=0.05"]
REFERENCE_STEPS = 8
REFERENCE_RUN = [*REFERENCE, f"train.steps={REFERENCE_STEPS}", "train.checkpoint_every=2", "train.keep_last=4"]


def composed(*overrides: str) -> JobConfig:
    """The JobConfig ``python -m launch.train OVERRIDES`` runs (composed, converted; not validated)."""
    from hydra import compose, initialize_config_module

    register_configs()
    with initialize_config_module("configs", version_base="1.3"):
        return to_job_config(compose(config_name="config", overrides=list(overrides)))


def one_rank_main_model(*overrides: str):
    """The model ``launch.runtime.parallel.apply_parallel`` makes for the main job composed with
    ONE_BLOCK's size and ``overrides``, on a one-rank gloo group (the ``gloo`` fixture's), and a
    batch of token ids for it: ``(wrapped, x)``; ``wrapped.forward(x, x)`` returns ``(logits, loss)``."""
    import torch

    from launch.runtime.dist import DistEnv
    from launch.runtime.parallel import apply_parallel, build_model

    cfg = composed(*overrides, "model.n_layer=1", "model.n_embd=32", "model.n_head=2")
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return apply_parallel(build_model(cfg.model), cfg, env), x


def tiny_job(tmp_path: Path, **sections) -> JobConfig:
    """A TINY model, 3 steps of batch 4 x 16 tokens, checkpoints under ``tmp_path/ckpt``;
    ``train=dict(...)`` and ``model=dict(...)`` update those, other sections are passed on."""
    train = dict(steps=3, batch_size=4, seq_len=16, checkpoint_dir=str(tmp_path / "ckpt"))
    train.update(sections.pop("train", {}))
    return JobConfig(model=ModelConfig(**{**TINY, **sections.pop("model", {})}), train=TrainConfig(**train),
                     **sections)
