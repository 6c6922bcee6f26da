"""Lightning's Trainer with ``CompiledDDPStrategy`` (Note [Lightning strategy]), against the
real package: the same fit with ``strategy="ddp"`` (eager) is the yardstick.

One 2-rank launch (our ``run_ranks``: the ranks' process group exists before the Trainer, which
then takes the torchrun-like environment and spawns nothing) runs every fit one after the other:
fp32 with gradient accumulation, clipping and mid-fit validation at caps below 1 MiB, bf16-mixed,
the traced strategy, and a module whose training_step skips forward. examples/lightning_ddp.py,
the first program of docs/frameworks/lightning.md, runs under torchrun as its users run it in
tests/project/test_docs_framework_pages.py. The rest runs in this process."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("lightning", reason="the Lightning route needs lightning (pip install distcompile[lightning])")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from lightning.pytorch.utilities.compile import from_compiled  # noqa: E402

from compiler import SettingError  # noqa: E402
from ddp_opt.frameworks.lightning import CompiledDDPStrategy  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_ddp.py"
CAP_MB = 0.05  # below 1 MiB, where PyTorch's own splitter asserts; 3 buckets of the model below
STEPS, ACCUM, VAL_EVERY = 4, 2, 4  # optimizer steps; batches per step; batches between validations


class _Regression(pl.LightningModule):
    def __init__(self, width: int = 96, depth: int = 5, skip_forward: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)],
                                 nn.Linear(width, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x) if self.hparams.skip_forward else self(x)
        return nn.functional.mse_loss(out.float(), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _Record(pl.Callback):
    """Per batch: the loss, and the all-reduce calls (bucket indices) the counting hook saw during it."""

    def __init__(self, calls: list[int]):
        self.calls, self.seen = calls, 0
        self.losses, self.val_losses, self.rounds = [], [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())
        self.rounds.append(self.calls[self.seen:])
        self.seen = len(self.calls)

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self.val_losses.append(outputs.item())


def _counting_hook(calls, bucket):
    import torch.distributed as dist

    calls.append(bucket.index())
    grad = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(grad, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _loaders():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * ACCUM * 2 * 16, 96, generator=g)
    train = torch.utils.data.TensorDataset(x, x[:, :1].sin())
    val = torch.utils.data.TensorDataset(x[:64], x[:64, :1].sin())
    return torch.utils.data.DataLoader(train, batch_size=16), torch.utils.data.DataLoader(val, batch_size=16)


def _fit(out_dir: Path, name: str, strategy_of, precision: str = "32-true", skip_forward: bool = False) -> dict:
    """One fit; returns what the tests compare. ``strategy_of(calls)`` builds the strategy."""
    torch._dynamo.reset()  # each fit compiles afresh: no graph of an earlier fit's backend reused
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    module = _Regression(skip_forward=skip_forward)
    calls: list[int] = []
    record = _Record(calls)
    strategy = strategy_of(calls)
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy=strategy, precision=precision,
                         max_steps=STEPS, accumulate_grad_batches=ACCUM, gradient_clip_val=0.5,
                         val_check_interval=VAL_EVERY, limit_val_batches=2, num_sanity_val_steps=1,
                         callbacks=[record], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(out_dir))
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        trainer.fit(module, *_loaders())
    ckpt = out_dir / f"{name}.ckpt"
    trainer.save_checkpoint(ckpt)  # every rank calls it; rank 0 writes
    trainer.strategy.barrier()
    keys = sorted(torch.load(ckpt, weights_only=False)["state_dict"])
    loaded = _Regression.load_from_checkpoint(ckpt)  # an uncompiled module
    module = trainer.lightning_module
    weights = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
    compiled = getattr(strategy, "compiled", None)
    return dict(losses=record.losses, val_losses=record.val_losses, rounds=record.rounds, weights=weights,
                keys=keys, loaded_equal=all(torch.equal(v.float(), weights[k])
                                            for k, v in loaded.state_dict().items()),
                buckets=len(compiled.buckets) if compiled is not None else None,
                alignment=compiled.realignment.fraction if compiled and compiled.realignment else None,
                strategy=compiled.strategy if compiled is not None else None,
                autograd_captures=torch._dynamo.utils.counters["compiled_autograd"]["captures"],
                forward_is_own=("forward" not in module.__dict__),
                warnings=[str(w.message) for w in warned if "CompiledDDPStrategy" in str(w.message)
                          or "compile_ddp" in str(w.message)])


def _compiled(**settings):
    return lambda calls: CompiledDDPStrategy(backend="aot_eager", bucket_cap_mb=CAP_MB, ddp_comm_state=calls,
                                             ddp_comm_hook=_counting_hook, **settings)


def _every_fit(rank: int, world_size: int, out_dir: str) -> dict:
    # The torchrun-like environment: Lightning sees ranks launched for it and spawns nothing.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    torch.set_num_threads(1)
    out = Path(out_dir)

    def eager(calls):
        return DDPStrategy(bucket_cap_mb=CAP_MB)

    def traced(calls):  # no comm hook: the traced strategy refuses one
        return CompiledDDPStrategy(backend="aot_eager", bucket_cap_mb=CAP_MB, strategy="traced")

    return dict(
        eager=_fit(out, "eager", eager),
        compiled=_fit(out, "compiled", _compiled()),
        eager_bf16=_fit(out, "eager_bf16", eager, precision="bf16-mixed"),
        compiled_bf16=_fit(out, "compiled_bf16", _compiled(), precision="bf16-mixed"),
        traced=_fit(out, "traced", traced),
        skip_forward=_fit(out, "skip", _compiled(), skip_forward=True),
    )


@pytest.fixture(scope="module")
def fits(run_ranks, tmp_path_factory):
    return run_ranks(_every_fit, str(tmp_path_factory.mktemp("lightning")), timeout=600)


def _same_run(got: dict, want: dict, what: str, rel: float = 1e-5, abs: float = 1e-6) -> None:
    assert len(got["losses"]) == len(want["losses"]) == STEPS * ACCUM, what
    for step, (g, w) in enumerate(zip(got["losses"], want["losses"])):
        assert g == pytest.approx(w, rel=rel, abs=abs), f"{what}: batch {step} loss {g} != eager's {w}"
    assert got["val_losses"] == pytest.approx(want["val_losses"], rel=rel, abs=abs), what
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, rtol=rel, atol=abs, msg=f"{what}: {name}")


@pytest.mark.slow
def test_compiled_fit_trains_as_eager_ddp_with_accumulation_clipping_and_validation(fits):
    for rank, runs in enumerate(fits):
        _same_run(runs["compiled"], runs["eager"], f"rank {rank}")
        assert runs["compiled"]["strategy"] == "split" and not runs["compiled"]["warnings"], runs["compiled"]


@pytest.mark.slow
def test_one_allreduce_round_per_optimizer_step_over_realigned_buckets_below_1_mib(fits):
    for runs in fits:
        got = runs["compiled"]
        assert got["buckets"] >= 3 and got["alignment"] == 1.0, got
        # accumulate_grad_batches=2: DDP's no_sync on the first batch of each step, one round on the second
        assert [r.count(0) for r in got["rounds"]] == [0, 1] * STEPS, got["rounds"]
        assert all(len(r) == got["buckets"] for r in got["rounds"][1::2]), got["rounds"]


@pytest.mark.slow
def test_checkpoint_has_eager_keys_and_loads_into_an_uncompiled_module(fits):
    for runs in fits:
        assert runs["compiled"]["keys"] == runs["eager"]["keys"], runs["compiled"]["keys"]
        assert not any("module." in k or "_orig_mod" in k for k in runs["compiled"]["keys"])
        assert runs["compiled"]["loaded_equal"] and runs["compiled"]["forward_is_own"]


@pytest.mark.slow
def test_bf16_mixed_trains_as_eager_bf16(fits):
    for rank, runs in enumerate(fits):
        _same_run(runs["compiled_bf16"], runs["eager_bf16"], f"rank {rank} bf16", rel=2e-2, abs=2e-3)
        assert runs["compiled_bf16"]["alignment"] == 1.0


@pytest.mark.slow
def test_traced_strategy_runs_its_backward_in_compiled_autograd_and_trains_as_eager(fits):
    for rank, runs in enumerate(fits):
        # the backward ran under compiled autograd, with no warning that one ran outside compiled.backward_context()
        assert runs["traced"]["strategy"] == "traced" and runs["traced"]["autograd_captures"] > 0, runs["traced"]
        assert not runs["traced"]["warnings"], runs["traced"]["warnings"]
        _same_run(runs["traced"], runs["eager"], f"rank {rank} traced", rel=1e-4, abs=1e-5)


@pytest.mark.slow
def test_a_training_step_that_skips_forward_is_warned_about(fits):
    for runs in fits:
        assert any(re.search(r"training_step did not call _Regression.forward .* ran uncompiled", w)
                   for w in runs["skip_forward"]["warnings"]), runs["skip_forward"]["warnings"]
    assert not any("did not call" in w for w in fits[0]["compiled"]["warnings"])


def test_the_docs_page_shows_the_example_as_it_is():
    page = (EXAMPLE.parents[1] / "docs" / "frameworks" / "lightning.md").read_text()
    assert f"```python\n{EXAMPLE.read_text()}```" in page


# In this process: settings and refusals, and the Lightning internals the strategy uses.

def test_keywords_are_shared_between_compile_ddp_and_ddp():
    strategy = CompiledDDPStrategy(backend="aot_eager", bucket_cap_mb=0.05, static_graph=False, fallback="raise")
    assert (strategy.compile_config.backend, strategy.compile_config.fallback) == ("aot_eager", "raise")
    assert strategy.compile_config.bucket_cap_mb is None  # a number is DDP's cap, which the split follows
    assert CompiledDDPStrategy(bucket_cap_mb="auto").compile_config.bucket_cap_mb == "auto"


def test_bad_settings_fail_when_the_strategy_is_built():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bucket_cap'.*Did you mean bucket_cap_mb=\?"):
        CompiledDDPStrategy(bucket_cap=4)
    with pytest.raises(SettingError, match=r"strategy='fused'\): expected one of"):
        CompiledDDPStrategy(strategy="fused")
    with pytest.raises(ValueError, match=r"strategy='traced', ddp_comm_hook=.*Drop ddp_comm_hook, or use "
                                         r"strategy='split'"):
        CompiledDDPStrategy(strategy="traced", ddp_comm_hook=_counting_hook)
    with pytest.raises(ValueError, match=r"reduce_dtype=..., ddp_comm_hook=...\): .* pass reduce_dtype=None"):
        CompiledDDPStrategy(reduce_dtype="bf16", ddp_comm_hook=_counting_hook)
    from ddp_opt import DDPCompileConfig

    with pytest.raises(ValueError, match=r"config=..., backend=...\): a DDPCompileConfig carries"):
        CompiledDDPStrategy(config=DDPCompileConfig(), backend="eager")


def test_the_optimizer_in_backward_is_refused_as_lightning_clips_after_backward():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"^CompiledDDPStrategy\(optimizer=\.\.\.\): the optimizer in backward does "
                                         r"not fit Lightning's loop, which runs backward inside "
                                         r"optimizer\.step\(closure\) and after it clips \(gradient_clip_val\).* Drop "
                                         r"optimizer= .*, or call "
                                         r"compile_ddp\(ddp, optimizer=opt\) in a loop of your own\.$"):
        CompiledDDPStrategy(backend="aot_eager", optimizer=optimizer)


def test_a_module_compiled_by_lightnings_recipe_or_in_place_is_refused():
    from ddp_opt import compile_for_ddp

    for compiled in (from_compiled(torch.compile(_Regression(), backend="eager")),
                     compile_for_ddp(_Regression(), backend="aot_eager")):
        strategy = CompiledDDPStrategy(backend="aot_eager")
        strategy.connect(compiled)
        with pytest.raises(RuntimeError, match=r"_Regression given to trainer.fit is already compiled .* Pass the "
                                               r"uncompiled module .* or use strategy='ddp'"):
            strategy.configure_ddp()


def test_the_strategy_prints_that_it_is_in_control_once_on_rank_0(gloo, clean_dynamo, capsys):
    # Note [In control, once]: printed, not logged at INFO, which Lightning's default verbosity hides.
    strategy = CompiledDDPStrategy(backend="aot_eager", bucket_cap_mb=CAP_MB, parallel_devices=[torch.device("cpu")])
    strategy.connect(_Regression())
    strategy.configure_ddp()
    for _ in range(4):
        strategy.model(torch.randn(4, 96)).sum().backward()
    out = capsys.readouterr().out.splitlines()
    assert out == [strategy.compiled.control.line], out
    assert out[0].startswith("ddp_opt in control (CompiledDDPStrategy): strategy=split, backend=aot_eager; 3 buckets "
                             "= graph partitions (") and out[0].endswith("DDP's buckets realigned with them, "
                                                                       "alignment 1.00"), out


def test_lightning_internals_the_strategy_uses_are_still_there():
    # Note [Lightning strategy]: DDPStrategy.setup calls configure_ddp, which wraps with _setup_model;
    # from_compiled marks a compiled module with _compiler_ctx. If Lightning changes one, revisit the strategy.
    import inspect

    assert "self.configure_ddp()" in inspect.getsource(DDPStrategy.setup)
    assert list(inspect.signature(DDPStrategy._setup_model).parameters) == ["self", "model"]
    assert _Regression()._compiler_ctx is None
    assert from_compiled(torch.compile(_Regression(), backend="eager"))._compiler_ctx is not None
    assert list(inspect.signature(DDPStrategy.backward).parameters)[:3] == ["self", "closure_loss", "optimizer"]
