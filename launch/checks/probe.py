"""A user's model or dataset (``model._target_``, ``data._target_``) tried on one tiny
batch in the launching process, before any process group starts.

The job's contract with them (``launch.data.source.TokenSource``, ``launch.runtime.parallel.CausalLM``):
``batch(step, rank, world_size, batch_size, seq_len)`` returns ``(inputs, targets)``,
int64 of shape ``(batch_size, seq_len)`` with ids below ``model.vocab_size``; the
model's ``forward(idx)`` returns logits ``(batch, seq, model.vocab_size)``, a tuple
starting with them, or an object with ``.logits``. Broken, each fails deep in the
first step, after the process group (and the compile) started: here it is a
:class:`~launch.config.schema.ConfigError` naming the setting and what was wrong.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..config.schema import ConfigError, JobConfig
from ..data.build import build_data
from ..data.source import SyntheticTokens
from ..runtime.parallel import build_model

__all__ = ["check_custom_parts", "PROBE_BATCH"]

PROBE_BATCH = 2  # sequences asked of the dataset; the model sees one


def check_custom_parts(cfg: JobConfig, world_size: int) -> None:
    """Build and try the user's dataset and model, when the config names them."""
    if not (cfg.model._target_ or cfg.data._target_):
        return
    t = cfg.train
    b = max(1, min(PROBE_BATCH, t.batch_size // max(1, world_size)))
    rank = int(os.environ.get("RANK", "0"))
    if cfg.data._target_:
        inputs, targets = _probe_data(cfg, rank, world_size, b)
    else:
        inputs, targets = SyntheticTokens(t.seed, cfg.model.vocab_size).batch(1, rank, world_size, b, t.seq_len)
    if cfg.model._target_:
        _probe_model(cfg, inputs[:1], targets[:1])


def _probe_data(cfg: JobConfig, rank: int, world_size: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    d, t, vocab = cfg.data, cfg.train, cfg.model.vocab_size
    what = f"data._target_={d._target_!r}"
    contract = ("batch(step, rank, world_size, batch_size, seq_len) must return (inputs, targets), int64 tensors of "
                "shape (batch_size, seq_len) with ids in [0, model.vocab_size)")
    try:
        data = build_data(d, seed=t.seed, vocab_size=vocab)
        out = data.batch(1, rank, world_size, b, t.seq_len)
    except Exception as e:  # noqa: BLE001 - the user's code: say which call failed
        raise ConfigError(f"{what}: building the dataset or its batch(1, {rank}, {world_size}, {b}, {t.seq_len}) "
                          f"failed with {type(e).__name__}: {_one_line(e)}. Fix the dataset (or data.kwargs): {contract}.") from e
    x, y = _check_pair(cfg, out, b, "batch()", contract)
    if t.eval_every > 0:
        _probe_eval(cfg, data, rank, world_size, b)
    return x, y


def _probe_eval(cfg: JobConfig, data: Any, rank: int, world_size: int, b: int) -> None:
    """``train.eval_every > 0`` with a user dataset needs its ``eval_batch`` (Note [Evaluation] in
    ``launch.step.evaluate``)."""
    what, seq = f"data._target_={cfg.data._target_!r}", cfg.train.seq_len
    contract = ("eval_batch(index, rank, world_size, batch_size, seq_len) must return held-out (inputs, targets), "
                "int64 tensors of shape (batch_size, seq_len) with ids in [0, model.vocab_size)")
    if not callable(getattr(data, "eval_batch", None)):
        raise ConfigError(
            f"train.eval_every={cfg.train.eval_every} with {what}: the dataset has no eval_batch method, so there "
            "are no held-out batches to evaluate on (training batches would not tell how the model does on unseen "
            f"data). Add {contract}; or set train.eval_every=0 to switch evaluation off."
        )
    try:
        out = data.eval_batch(0, rank, world_size, b, seq)
    except Exception as e:  # noqa: BLE001 - the user's code
        raise ConfigError(f"{what}: eval_batch(0, {rank}, {world_size}, {b}, {seq}) failed with "
                          f"{type(e).__name__}: {_one_line(e)}. Fix the dataset: {contract}.") from e
    _check_pair(cfg, out, b, "eval_batch()", contract)


def _check_pair(cfg: JobConfig, out: Any, b: int, call: str, contract: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` of the dataset's ``call`` must be (inputs, targets) of the job's shape, dtype and vocabulary."""
    t, vocab = cfg.train, cfg.model.vocab_size
    what = f"data._target_={cfg.data._target_!r}"
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out)):
        raise ConfigError(f"{what}: {call} returned {_describe(out)}, not a pair of tensors. {contract}.")
    for name, x in zip(("inputs", "targets"), out):
        problem = None
        if tuple(x.shape) != (b, t.seq_len):
            problem = f"has shape {tuple(x.shape)}, expected ({b}, {t.seq_len}) for batch_size={b}, seq_len={t.seq_len}"
        elif x.dtype != torch.int64:
            problem = f"has dtype {x.dtype}, expected torch.int64 token ids"
        else:
            valid = x if name == "inputs" else x[x != -100]  # -100: targets the loss ignores
            if valid.numel() and (valid.min() < 0 or valid.max() >= vocab):
                problem = (f"holds ids from {int(valid.min())} to {int(valid.max())}, outside [0, {vocab}) "
                           f"(model.vocab_size={vocab}); the embedding would index out of range")
        if problem:
            raise ConfigError(f"{what}: the {name} of {call} {problem}. {contract}; set model.vocab_size to your "
                              "tokenizer's vocabulary if that is what differs.")
    return out[0], out[1]


def _probe_model(cfg: JobConfig, idx: torch.Tensor, targets: torch.Tensor) -> None:
    m = cfg.model
    what = f"model._target_={m._target_!r}"
    contract = (f"forward(idx) must return logits of shape (batch, seq, model.vocab_size={m.vocab_size}), a tuple "
                "starting with them, or an object with .logits")
    leftover = _example_kwargs_left(cfg)
    try:
        model = build_model(m)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{what}: building the model with model.kwargs={dict(m.kwargs)!r} failed with "
                          f"{type(e).__name__}: {_one_line(e)}.{leftover} Fix model._target_ or model.kwargs.") from e
    inner = model.model  # CausalLM: the user's module
    try:
        with torch.no_grad():
            out = inner(idx)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{what}: forward on a batch of shape {tuple(idx.shape)} failed with "
                          f"{type(e).__name__}: {_one_line(e)}. {contract}.") from e
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        logits = out[0]
    want = (*idx.shape, m.vocab_size)
    if not isinstance(logits, torch.Tensor):
        raise ConfigError(f"{what}: forward returned {_describe(out)}, with no logits to train on. {contract}.")
    if tuple(logits.shape) != want or not logits.is_floating_point():
        raise ConfigError(f"{what}: forward on a batch of shape {tuple(idx.shape)} returned logits of shape "
                          f"{tuple(logits.shape)} and dtype {logits.dtype}, expected floating-point logits of shape "
                          f"{want}. {contract}; set model.vocab_size to the model's vocabulary if that is what "
                          "differs.")


def _example_kwargs_left(cfg: JobConfig) -> str:
    """configs/model/custom.yaml's example builds launch.models.GPT from kwargs.cfg; a user's
    own model given with '+model.kwargs={...}' still gets that cfg merged in."""
    example = cfg.model.kwargs.get("cfg")
    if (cfg.model._target_ != "launch.models.GPT" and isinstance(example, dict)
            and example.get("_target_") == "launch.models.GPTConfig"):
        return (" model.kwargs still holds cfg, the example's launch.models.GPTConfig from configs/model/custom.yaml "
                "(a +model.kwargs={...} override is merged into it); drop it with '~model.kwargs.cfg'.")
    return ""


def _describe(out: Any) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)}"
    if isinstance(out, dict):
        return f"a dict with keys {sorted(map(str, out))}"
    return f"a {type(out).__name__}"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
