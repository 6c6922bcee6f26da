"""The HF Trainer route (``ddp_opt.frameworks.hf``, Note [HF Trainer route]) against the real
package: ``Trainer(model, args, train_dataset)`` + ``compile_trainer`` trains a tiny GPT-2 as the
plain Trainer does, on 2 gloo ranks, with DDP's buckets realigned under the Trainer's defaults,
and ``save_model`` + ``from_pretrained`` round-trip.

Run as a script under torchrun (``python -m torch.distributed.run ... this_file OUT``), this file
is the job: the same training eager and then compiled, each rank's results in OUT/rank{R}.json."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

transformers = pytest.importorskip("transformers", reason="the HF Trainer route needs transformers")

from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments)

from ddp_opt import DDPCompileConfig  # noqa: E402
from ddp_opt.frameworks.hf import DDPCompileCallback, compile_trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "hf_trainer_ddp.py"
STEPS, ACCUM = 4, 2
TURNED_OFF = (r"compile_trainer: turned DDP's find_unused_parameters off \(the Trainer turns it on by default, and "
              r"such a DDP never rebuilds its buckets, so they could not follow the partitions\); a step in which a "
              r"parameter gets no gradient stops with an error. TrainingArguments\(ddp_find_unused_parameters=True\) "
              r"keeps it on.")


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seq: int = 32):
        self.ids = torch.randint(256, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _gpt() -> GPT2LMHeadModel:
    torch.manual_seed(0)  # 3 buckets at 0.15 MiB
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=256,
                                      bos_token_id=0, eos_token_id=0))


def _args(out: Path, **more) -> TrainingArguments:
    return TrainingArguments(str(out), use_cpu=True, ddp_bucket_cap_mb=0.15,
                             per_device_train_batch_size=4, gradient_accumulation_steps=ACCUM, max_steps=STEPS,
                             logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                             learning_rate=1e-3, **more)


class _CountRounds(TrainerCallback):
    """A DDP comm hook that all-reduces and counts the all-reduces of bucket 0: one per synchronised backward."""

    def __init__(self, trainer: Trainer, compiled: DDPCompileCallback | None):
        self.trainer, self.compiled, self.rounds = trainer, compiled, 0

    def on_train_begin(self, args, state, control, **kwargs):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(state, bucket):
            self.rounds += bucket.index() == 0
            return allreduce_hook(None, bucket)

        target = self.compiled.compiled if self.compiled is not None else self.trainer.model_wrapped
        target.register_comm_hook(None, hook)


def _train(compiled: bool, out: Path) -> dict:
    trainer = Trainer(model=_gpt(), args=_args(out, ddp_backend="gloo"), train_dataset=_Tokens())
    callback = compile_trainer(trainer, backend="aot_eager") if compiled else None
    counter = _CountRounds(trainer, callback)
    trainer.add_callback(counter)
    trainer.train()
    trainer.save_model(str(out / "saved"))  # written by the main process
    trainer.accelerator.wait_for_everyone()
    trained = trainer.model.state_dict()
    loaded = GPT2LMHeadModel.from_pretrained(str(out / "saved")).state_dict()
    result = {
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "steps": trainer.state.global_step, "rounds": counter.rounds, "keys": sorted(trained),
        "round_trip": sorted(loaded) == sorted(trained) and all(torch.equal(loaded[k], trained[k]) for k in trained),
        "params": {k: v.flatten()[:8].tolist() for k, v in trained.items()},
        "find_unused": trainer.model_wrapped.find_unused_parameters,
    }
    if callback is not None:
        result.update(buckets=len(callback.compiled.buckets), stopped=callback.stopped_finding_unused,
                      alignment=callback.compiled.realignment.fraction if callback.compiled.realignment else None)
    return result


def _job(out: Path) -> None:
    logging.getLogger("ddp_opt.frameworks.hf").addHandler(logging.StreamHandler())
    logging.getLogger("ddp_opt.frameworks.hf").setLevel(logging.INFO)
    results = {"eager": _train(False, out / "eager"), "compiled": _train(True, out / "compiled")}
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


def _launch(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=500,
                          env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_compiled_trains_as_the_plain_trainer_realigned_and_round_trips_through_from_pretrained(tmp_path):
    proc = _launch(Path(__file__), str(tmp_path), cwd=tmp_path)
    assert len(re.findall(TURNED_OFF, proc.stderr)) == 2  # once per rank
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        eager, compiled = got["eager"], got["compiled"]
        assert eager["steps"] == compiled["steps"] == STEPS and len(compiled["losses"]) == STEPS
        for step, (e, c) in enumerate(zip(eager["losses"], compiled["losses"]), 1):
            assert c == pytest.approx(e, rel=1e-5), f"rank {rank} step {step}: loss {c} != eager {e}"
        assert compiled["rounds"] == eager["rounds"] == STEPS  # gradient accumulation: one round per optimizer step
        # the Trainer's default find_unused_parameters=True is turned off, so DDP rebuilds into the partitions
        assert eager["find_unused"] is True and compiled["find_unused"] is False and compiled["stopped"]
        assert compiled["buckets"] == 3 and compiled["alignment"] == 1.0
        assert compiled["keys"] == eager["keys"] and compiled["round_trip"] and eager["round_trip"]
        for name, values in eager["params"].items():
            assert compiled["params"][name] == pytest.approx(values, rel=1e-4, abs=1e-6), name


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """TrainingArguments keep Accelerate's process state in a singleton: none left for the next test."""
    from accelerate.state import AcceleratorState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def _callback(model: nn.Module, tmp_path: Path, **args) -> tuple[DDPCompileCallback, TrainingArguments]:
    """The callback with a stand-in for the Trainer: what on_train_begin reads of it."""
    training_args = _args(tmp_path, **args)
    trainer = SimpleNamespace(model_wrapped=model, args=training_args)
    return DDPCompileCallback(trainer, DDPCompileConfig(backend="aot_eager")), training_args


def test_a_parameter_without_gradient_stops_the_step_with_the_setting_to_use(gloo, tmp_path, caplog):
    ddp = DDP(_WithUnused(), find_unused_parameters=True)  # as the Trainer builds it by default
    callback, args = _callback(ddp, tmp_path)
    with caplog.at_level(logging.INFO, logger="ddp_opt.frameworks.hf"):
        callback.on_train_begin(args, None, None)
    assert not ddp.find_unused_parameters and callback.stopped_finding_unused
    assert re.search(TURNED_OFF, caplog.text)
    ddp(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"^compile_trainer: at step 1 DDP did not receive a gradient for every "
                                           r"parameter \(unused.weight, unused.bias\), .* Pass TrainingArguments\("
                                           r"ddp_find_unused_parameters=True\) to keep DDP's search for unused "
                                           r"parameters \(DDP's buckets then stay unaligned with the partitions\).$"):
        callback.on_pre_optimizer_step(args, SimpleNamespace(global_step=0), None)


def test_the_route_prints_that_it_is_in_control_with_the_flag_it_turned_off(gloo, tmp_path, capsys):
    # Note [In control, once]: printed, since the Trainer's default log level hides INFO from our loggers.
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), find_unused_parameters=True,  # the Trainer's
              bucket_cap_mb=(64 * 64 + 64) * 4 / 2**20)
    callback, args = _callback(ddp, tmp_path)
    callback.on_train_begin(args, None, None)
    for _ in range(4):
        ddp(torch.randn(2, 64)).sum().backward()
    out = capsys.readouterr().out.splitlines()
    assert out == [callback.compiled.control.line], out
    assert out[0].startswith("ddp_opt in control (compile_trainer): strategy=split, backend=aot_eager; 2 buckets = "
                             "graph partitions (0.02, 0.02 MiB); DDP's buckets realigned with them, alignment 1.00; "
                             "changed: find_unused_parameters=False for DDP (the Trainer's default, True, keeps DDP "
                             "from rebuilding its buckets; TrainingArguments(ddp_find_unused_parameters=True) keeps "
                             "it on)"), out


def test_find_unused_parameters_the_user_asked_for_is_kept(gloo, tmp_path):
    ddp = DDP(_WithUnused(), find_unused_parameters=True)
    callback, args = _callback(ddp, tmp_path, ddp_find_unused_parameters=True)
    with pytest.warns(UserWarning, match=r"compile_ddp: this DDP module was built with find_unused_parameters=True"):
        callback.on_train_begin(args, None, None)
    assert ddp.find_unused_parameters and not callback.stopped_finding_unused
    ddp(torch.randn(2, 4)).sum().backward()
    callback.on_pre_optimizer_step(args, SimpleNamespace(global_step=0), None)  # DDP found the unused one: no error


def test_without_ddp_the_model_is_left_uncompiled_with_a_warning(tmp_path):
    model = nn.Linear(4, 4)
    callback, args = _callback(model, tmp_path)
    with pytest.warns(UserWarning, match=r"^compile_trainer: the Trainer's model_wrapped is a Linear, not a DDP module "
                                         r"\(one process, or FSDP/DeepSpeed\), .* trains uncompiled. Launch several "
                                         r"processes with torchrun .* use TrainingArguments\(torch_compile=True\) "
                                         r"instead of compile_trainer.$"):
        callback.on_train_begin(args, None, None)
    assert callback.compiled is None and "forward" not in model.__dict__


def test_the_trainers_own_compile_is_refused(tmp_path):
    trainer = Trainer(model=_gpt(), args=_args(tmp_path, torch_compile=True, torch_compile_backend="eager"),
                      train_dataset=_Tokens())
    with pytest.raises(ValueError, match=r"^compile_trainer: TrainingArguments\(torch_compile=True\) makes the Trainer "
                                         r"compile the model itself, .* Pass torch_compile=False .*, or drop "
                                         r"compile_trainer.$"):
        compile_trainer(trainer, backend="aot_eager")


def test_the_optimizer_in_backward_is_refused_as_the_trainer_clips_after_backward(tmp_path):
    # The Trainer's default max_grad_norm=1.0 clips after backward; with the update inside backward it would
    # find no gradients and silently not clip.
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=_Tokens(), optimizers=(optimizer, None))
    with pytest.raises(ValueError, match=r"^compile_trainer\(optimizer=\.\.\.\): the optimizer in backward does not "
                                         r"fit the Trainer's loop, which clips the gradients after backward "
                                         r"\(TrainingArguments\.max_grad_norm, 1\.0 by default\).* Drop optimizer= "
                                         r".*, or call compile_ddp\(ddp, optimizer=opt\) in a loop of your own\.$"):
        compile_trainer(trainer, backend="aot_eager", optimizer=optimizer)
    assert not any(isinstance(c, DDPCompileCallback) for c in trainer.callback_handler.callbacks)


def test_the_docs_show_the_example_as_it_is():
    page = (REPO / "docs" / "frameworks" / "hf.md").read_text()
    assert f"```python\n{EXAMPLE.read_text()}```" in page


if __name__ == "__main__":
    _job(Path(sys.argv[1]))
