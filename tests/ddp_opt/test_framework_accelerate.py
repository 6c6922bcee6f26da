"""The Accelerate route (``ddp_opt.frameworks.accelerate``, Note [Accelerate route]) against
the real package: a script written as Accelerate's docs write one (``prepare``, ``accumulate``,
``autocast``, ``backward``, ``clip_grad_norm_``, ``save_state``/``load_state``,
``unwrap_model``) trains compiled as it trains eager, on 2 gloo ranks.

Run as a script under torchrun (``python -m torch.distributed.run ... this_file OUT``), this file
is the job: the same training eager and then compiled, each rank's results in OUT/rank{R}.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

accelerate = pytest.importorskip("accelerate", reason="the Accelerate route needs accelerate (pip install accelerate)")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, PartialState  # noqa: E402
from accelerate.utils import DistributedDataParallelKwargs, extract_model_from_parallel  # noqa: E402

from ddp_opt.frameworks.accelerate import compile_prepared  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "accelerate_ddp.py"
MICRO_STEPS = 8  # 4 optimizer steps of 2 micro-batches
ACCUM = 2


def _model() -> nn.Module:
    torch.manual_seed(0)  # 3 buckets at 0.25 MiB: one Linear(256, 256) each, the head with the last
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(3)], nn.Linear(256, 1))


def _train(compiled: bool, ckpt: Path) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=ACCUM,
                              kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=0.25)])
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randn(MICRO_STEPS * 16 * 2, 256, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x[:, :1]), batch_size=16)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    if compiled:
        model = compile_prepared(model, backend="aot_eager")  # the one line on what prepare returned
    rounds: list[int] = []  # the micro-step of each all-reduce of bucket 0: one per synchronised backward
    micro = [0]

    def counting_hook(state, bucket):
        if bucket.index() == 0:
            rounds.append(micro[0])
        return allreduce_hook(None, bucket)

    model.register_comm_hook(None, counting_hook)
    losses, norms = [], []
    for micro[0], (inputs, targets) in enumerate(data, 1):
        with accelerator.accumulate(model):
            with accelerator.autocast():
                loss = nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    accelerator.save_state(str(ckpt))
    accelerator.wait_for_everyone()  # the main process writes; every rank reads it back
    unwrapped = accelerator.unwrap_model(model)
    trained = {k: v.clone() for k, v in unwrapped.state_dict().items()}
    with torch.no_grad():
        for p in unwrapped.parameters():
            p.zero_()
    accelerator.load_state(str(ckpt))
    reloaded = unwrapped.state_dict()
    result = {
        "losses": losses, "norms": norms, "rounds": rounds,
        "unwrapped": type(unwrapped).__name__, "keys": sorted(trained),
        "unwrapped_uncompiled": type(accelerator.unwrap_model(model, keep_torch_compile=False)).__name__,
        "reloaded": all(torch.equal(trained[k], reloaded[k]) for k in trained),
        "params": {k: v.flatten()[:8].tolist() for k, v in trained.items()},
    }
    if compiled:
        result["buckets"] = len(model.buckets)
        result["alignment"] = model.realignment.fraction if model.realignment is not None else None
    accelerator.free_memory()
    return result


def _job(out: Path) -> None:
    results = {"eager": _train(False, out / "eager_ckpt"), "compiled": _train(True, out / "compiled_ckpt")}
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))
    PartialState().destroy_process_group()


def _launch(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture
def fresh_accelerate_state():
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.slow
def test_compiled_trains_as_eager_and_saves_loads_and_unwraps_as_eager(tmp_path):
    _launch(Path(__file__), str(tmp_path), cwd=tmp_path)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        eager, compiled = got["eager"], got["compiled"]
        for step, (e, c) in enumerate(zip(eager["losses"], compiled["losses"]), 1):
            assert c == pytest.approx(e, rel=1e-5, abs=1e-7), f"rank {rank} micro-step {step}: loss {c} != eager {e}"
        assert len(compiled["losses"]) == MICRO_STEPS
        assert compiled["norms"] == pytest.approx(eager["norms"], rel=1e-5)
        # accumulate: one all-reduce round per optimizer step, at its last micro-batch
        assert compiled["rounds"] == eager["rounds"] == list(range(ACCUM, MICRO_STEPS + 1, ACCUM))
        assert compiled["buckets"] == 3 and compiled["alignment"] == 1.0
        # unwrap_model gives the user's module with its own keys, as for eager; save_state/load_state round-trip
        assert compiled["unwrapped"] == compiled["unwrapped_uncompiled"] == eager["unwrapped"] == "Sequential"
        assert compiled["keys"] == eager["keys"] and not any(k.startswith("module.") for k in compiled["keys"])
        assert compiled["reloaded"] and eager["reloaded"]
        for name, values in eager["params"].items():
            assert compiled["params"][name] == pytest.approx(values, rel=1e-4, abs=1e-6), name
    saved = sorted(p.name for p in (tmp_path / "compiled_ckpt").iterdir())
    assert saved == sorted(p.name for p in (tmp_path / "eager_ckpt").iterdir())


def test_unwrap_model_sees_through_the_compiled_handle(gloo):
    model = _model()
    ddp = DDP(model)
    compiled = compile_prepared(ddp, backend="aot_eager")
    assert isinstance(compiled, DDP) and type(compiled).__name__ == "CompiledDDP"
    assert extract_model_from_parallel(compiled) is model
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model
    assert sorted(extract_model_from_parallel(compiled).state_dict()) == sorted(_model().state_dict())


def test_compile_prepared_prints_that_it_is_in_control_once_on_rank_0(gloo, clean_dynamo, capsys):
    # Note [In control, once]: printed, as accelerator.print prints; INFO would not show by default.
    compiled = compile_prepared(DDP(_model(), bucket_cap_mb=0.25), backend="aot_eager")
    for _ in range(4):
        compiled(torch.randn(4, 256)).sum().backward()
    out = capsys.readouterr().out.splitlines()
    assert out == [compiled.control.line] == [
        "ddp_opt in control (compile_prepared): strategy=split, backend=aot_eager; 3 buckets = graph partitions "
        "(0.25, 0.25, 0.25 MiB); DDP's buckets realigned with them, alignment 1.00"], out


def test_a_model_accelerate_did_not_wrap_in_ddp_is_refused_in_its_terms(fresh_accelerate_state):
    accelerator = Accelerator(cpu=True)
    with pytest.raises(TypeError, match=r"^compile_prepared: accelerator.prepare returned a Linear, not a DDP module: "
                                        r"Accelerate wraps .* only when several processes run .* Launch several "
                                        r"processes, or, for one process, compile with torch.compile\(model\).$"):
        compile_prepared(accelerator.prepare(nn.Linear(4, 4)), backend="aot_eager")


def test_a_model_accelerate_compiled_is_refused_with_the_setting_to_drop(fresh_accelerate_state):
    accelerator = Accelerator(cpu=True, dynamo_backend="eager")
    with pytest.raises(TypeError, match=r"^compile_prepared: accelerator.prepare returned a torch.compile'd Linear, "
                                        r"because the Accelerator was built with a dynamo_backend .* Build the "
                                        r"Accelerator without dynamo_backend .*"
                                        r"compile_prepared\(model, backend=...\).$"):
        compile_prepared(accelerator.prepare(nn.Linear(4, 4)), backend="aot_eager")


def test_the_docs_show_the_example_as_it_is():
    page = (REPO / "docs" / "frameworks" / "accelerate.md").read_text()
    assert f"```python\n{EXAMPLE.read_text()}```" in page


if __name__ == "__main__":
    _job(Path(sys.argv[1]))
