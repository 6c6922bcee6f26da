"""Variable-length batches: the skewed lengths, the three padding strategies, the
exact recompile counts each strategy gives, and the no-recompile stance."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from compiler.graph.diagnose import Diagnoser
from launch.config.schema import CompileConfig, DataConfig, JobConfig, ModelConfig, TrainConfig
from launch.data.batching import IGNORE_INDEX, pad_batch, padded_lengths, sequence_lengths, warmup_lengths
from launch.runtime.recompiles import CompileCounter, RecompileAfterWarmupError
from launch.step.optim import OptimizerStep
from launch.step.train_step import StepRunner
from launch.train import run
from launch.models import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread", "clean_dynamo")

SEQ = 32
CFG = GPTConfig(vocab_size=64, block_size=SEQ, n_layer=1, n_head=2, n_embd=32)
# The fixed sequence of batches the counts are derived on: each batch's longest length.
LONGEST = [5, 17, 9, 30, 3, 32, 12]


def _tokens(batch=2, seq=SEQ, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG.vocab_size, (batch, seq + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _lengths(longest: int) -> torch.Tensor:
    return torch.tensor([longest, max(2, longest // 2)])


def test_skewed_lengths_are_deterministic_short_mostly_and_bounded():
    a = sequence_lengths("skewed", 7, rank=0, step=3, batch_size=4096, seq_len=64)
    assert torch.equal(a, sequence_lengths("skewed", 7, rank=0, step=3, batch_size=4096, seq_len=64))
    assert not torch.equal(a, sequence_lengths("skewed", 7, rank=1, step=3, batch_size=4096, seq_len=64))
    assert not torch.equal(a, sequence_lengths("skewed", 7, rank=0, step=4, batch_size=4096, seq_len=64))
    assert int(a.min()) >= 2 and int(a.max()) == 64
    # log-normal around seq_len/8 = 8, sigma 1: median 8, P(length = 64) = P(z > ln 8) ~ 2%
    assert 7 <= float(a.float().median()) <= 9
    assert 0.01 < float((a == 64).float().mean()) < 0.04
    assert torch.equal(sequence_lengths("fixed", 7, 0, 3, 4, 64), torch.full((4,), 64))


def test_pad_batch_masks_targets_and_cuts_to_the_strategy_length():
    x, y = _tokens()
    lengths = torch.tensor([5, 11])
    for padding, width in (("max", 32), ("multiple", 16), ("dynamic", 11)):
        b = pad_batch(x, y, lengths, padding, 8)
        assert b.inputs.shape == (2, width) and b.targets.shape == (2, width), padding
        assert b.real_tokens == 16 and b.padded_tokens == 2 * width
        assert torch.equal(b.targets[0, :5], y[0, :5]) and bool((b.targets[0, 5:] == IGNORE_INDEX).all())
        assert bool((b.inputs[0, 5:] == 0).all()) and torch.equal(b.inputs[1, :11], x[1, :11])
    assert padded_lengths(32, "multiple", 8) == [8, 16, 24, 32] and padded_lengths(30, "multiple", 8) == [8, 16, 24, 30]
    assert padded_lengths(32, "max", 8) == [32] and padded_lengths(32, "dynamic", 8) is None
    assert warmup_lengths(32, "dynamic", 8) == [32]


def test_loss_is_over_real_tokens_only_and_the_same_for_every_padding():
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = _tokens()
    lengths = torch.tensor([7, 13])
    losses = [model(b.inputs, b.targets)[1] for b in (pad_batch(x, y, lengths, p, 8) for p in ("max", "multiple", "dynamic"))]
    # the reference: each sequence alone, cut to its length (causal: padding after it changes nothing)
    logits = [model(x[i:i + 1, :n])[0] for i, n in enumerate((7, 13))]
    ref = F.cross_entropy(torch.cat([l.reshape(-1, CFG.vocab_size) for l in logits]), torch.cat([y[0, :7], y[1, :13]]))
    for loss in losses:
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)


def _count(padding: str, dynamic: bool | None, warm: bool = False) -> tuple[int, int, int]:
    """(graphs, recompiles, recompiles after warm-up) for the LONGEST sequence."""
    torch._dynamo.reset()  # else GPT.forward's cache entries for the previous model make a "recompile"
    torch.manual_seed(0)
    diag = Diagnoser()
    # dynamo's "eager" backend: the counts are dynamo's (graphs, guards), the backend only runs them
    model = torch.compile(GPT(CFG), backend=diag.wrap(torch._dynamo.lookup_backend("eager")), dynamic=dynamic)
    counter = CompileCounter(diag)
    counter.start()
    x, y = _tokens()
    if warm:
        for n in warmup_lengths(SEQ, padding, 8):
            b = pad_batch(x, y, torch.full((2,), n), padding, 8)
            model(b.inputs, b.targets)
    at_warm = counter.snapshot()
    for longest in LONGEST:
        b = pad_batch(x, y, _lengths(longest), padding, 8)
        model(b.inputs, b.targets)
    end = counter.snapshot()
    return end.graphs, end.recompiles, end.recompiles - at_warm.recompiles


def test_recompile_counts_per_padding_strategy():
    # max: every batch is (2, 32): one graph, never a recompile.
    assert _count("max", dynamic=False) == (1, 0, 0)
    # multiple of 8, dynamic=False: LONGEST pads to 8, 24, 16, 32, 8, 32, 16, four distinct static
    # shapes. Without warm-up that is 4 graphs and 3 recompiles during training; with warm-up (8, 16,
    # 24, 32 fed first) the same 4 graphs, and all 3 recompiles happen in warm-up, none after it.
    assert _count("multiple", dynamic=False, warm=True) == (4, 3, 0)
    # multiple with dynamo's automatic dynamic shapes (dynamic=None): the second shape (24 after 8)
    # recompiles into a graph symbolic in the length that serves every later one: 2 graphs, 1
    # recompile. The launcher compiles padding=multiple with dynamic=False, for static graphs.
    assert _count("multiple", dynamic=None) == (2, 1, 1)
    # dynamic: mark_dynamic on the sequence axis from the first call: one symbolic graph.
    assert _count("dynamic", dynamic=None) == (1, 0, 0)


def test_no_recompile_after_warmup_names_the_input_and_shape():
    torch.manual_seed(0)
    model = GPT(CFG)
    forward = torch.compile(model, backend="aot_eager", dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runner = StepRunner(forward, model, OptimizerStep(opt), no_recompile_after_warmup=True)
    data = type("Data", (), {"batch": lambda self, step, rank, ws, bs, seq: _tokens(bs, seq, step)})()
    shapes = runner.warm_up(data, rank=0, world_size=1, micro_batch=2, seq_len=16, padding="multiple", pad_multiple=8)
    assert shapes == [(2, 8), (2, 16)]
    x, y = _tokens(2, 16, seed=1)
    ok = pad_batch(x, y, torch.tensor([3, 9]), "multiple", 8)  # pads to 16: compiled in warm-up
    runner.step([ok], step=1)
    new = pad_batch(x, y, torch.tensor([3, 12]), "dynamic", 8)  # (2, 12): a shape warm-up never fed
    new.inputs, new.targets = new.inputs.clone(), new.targets.clone()  # "dynamic" only cut it: drop the mark
    with pytest.raises(RecompileAfterWarmupError, match=(
            r"^train.no_recompile_after_warmup=true and step 2 would recompile the model: input 'idx' has shape "
            r"\(2, 12\) \(axis 1 changed\), a shape warm-up did not compile \(warm-up compiled \(2, 8\), \(2, 16\); "
            r"dynamo: [^)]*tensor 'idx' size mismatch at index 1. expected 16, actual 12[^)]*\)\. .*Fix: feed this shape "
            r"during warm-up, use data.padding=multiple .* or set train.no_recompile_after_warmup=false")):
        runner.step([new], step=2)


def test_run_multiple_padding_compiles_every_shape_in_warmup(tmp_path, capsys):
    cfg = JobConfig(
        model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=SEQ),
        compile=CompileConfig(backend="aot_eager"),
        data=DataConfig(lengths="skewed", padding="multiple", pad_multiple=8),
        train=TrainConfig(steps=6, batch_size=4, seq_len=SEQ, checkpoint_dir=str(tmp_path / "ckpt"),
                          no_recompile_after_warmup=True),
    )
    m = run(cfg)
    out = capsys.readouterr().out
    assert not dist.is_initialized()
    # warm-up feeds (4, 8), (4, 16), (4, 24), (4, 32): 4 graphs, 3 recompiles, none after.
    assert "warm-up: compiled 4 input shape(s) (4, 8), (4, 16), (4, 24), (4, 32)" in out
    assert (m["warmup_graphs"], m["graphs"], m["recompiles"], m["recompiles_after_warmup"]) == (4, 4, 3, 0)
    seen = {tuple(s): n for s, n in m["shapes_seen"]}
    assert sum(seen.values()) == 6 and set(seen) <= {(4, 8), (4, 16), (4, 24), (4, 32)}
    assert 0 < m["real_tokens"] < m["padded_tokens"] == 4 * sum(s[1] * n for s, n in seen.items())
    assert m["padding_waste"] == pytest.approx(1 - m["real_tokens"] / m["padded_tokens"])
    assert m["real_tokens_per_s"] < m["tokens_per_s"]
    assert "compile: 4 graph(s), 3 recompile(s) (0 after warm-up); shapes seen: " in out
    assert "real tokens/s" in out and "padding waste" in out
