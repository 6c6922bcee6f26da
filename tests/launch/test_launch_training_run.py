"""The main job as training teams run it, everything at once: 2 ranks
under torchrun on a token file the test prepares, a cosine schedule with warm-up, gradient
clipping, held-out evaluation, TensorBoard and a profiled step range."""

from __future__ import annotations

import json

import pytest

from _torchrun import metrics as _metrics, ok as _ok

pytestmark = pytest.mark.slow

PNG = b"\x89PNG\r\n\x1a\n"
TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog {i % 7}\n" for i in range(400))


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_two_ranks_on_a_token_file_with_schedule_clipping_eval_tensorboard_and_profile(tmp_path, torchrun):
    pytest.importorskip("tensorboard")
    from launch.prepare_data import prepare

    (tmp_path / "in.txt").write_text(TEXT)
    prepare(str(tmp_path / "in.txt"), str(tmp_path / "tokens.bin"), log=lambda line: None)
    proc = torchrun(tmp_path, "compile.backend=aot_eager", "data=tokens", f"data.path={tmp_path / 'tokens.bin'}",
                    "model.vocab_size=256", "model.n_layer=2", "model.n_embd=64", "model.n_head=2",
                    "train.batch_size=4", "train.seq_len=16", "ddp.bucket_cap_mb=0.2", "train.steps=6",
                    "train.lr_schedule=cosine", "train.warmup_steps=2", "train.min_lr=1e-4", "train.max_grad_norm=0.5",
                    "train.eval_every=3", "train.eval_batches=2", "log.tensorboard=true", "profile.steps=[4,5]",
                    "hydra.run.dir=run", timeout=300)
    _ok(proc)
    run = tmp_path / "run"
    m = _metrics(run)
    steps = [1, 2, 3, 4, 5, 6]
    # the schedule: warm-up to lr, then cosine down to min_lr at the last step
    lrs = dict(m["lrs"])
    assert sorted(lrs) == steps and lrs[1] == pytest.approx(1.5e-3) and lrs[2] == pytest.approx(3e-3)
    assert lrs[2] > lrs[3] > lrs[4] > lrs[5] > lrs[6] == pytest.approx(1e-4)
    assert [s for s, _ in m["grad_norms"]] == steps and all(n > 0 for _, n in m["grad_norms"])
    assert [s for s, _ in m["eval_losses"]] == [3, 6]
    # TensorBoard: every series, one point per step (eval: per evaluation), values as in metrics.json
    scalars = _scalars(run)
    for tag in ("loss", "lr", "grad_norm", "step_s", "tokens_per_s"):
        assert [s for s, _ in scalars[tag]] == steps, tag
    assert [v for _, v in scalars["lr"]] == pytest.approx([lrs[s] for s in steps])
    assert [s for s, _ in scalars["eval_loss"]] == [3, 6]
    assert [v for _, v in scalars["eval_loss"]] == pytest.approx([v for _, v in m["eval_losses"]])
    assert (run / "curves.png").read_bytes()[:8] == PNG
    # the profiled steps: a Chrome trace with the all-reduces, and the timeline picture
    trace = json.loads((run / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"step 4", "step 5", "gloo:all_reduce", "partition 0 backward"} <= names
    assert (run / "timeline.png").read_bytes()[:8] == PNG and m["profile"]["steps"] == [4, 5]
    assert "eval_loss" in proc.stdout and "grad_norm" in proc.stdout
