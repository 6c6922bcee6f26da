"""profile.steps on the main job under torchrun, 2 ranks on gloo: a Chrome trace with
the partitions' labels and the bucket all-reduces, the timeline picture, and their
links in the doctor's diagnosis."""

from __future__ import annotations

import json

import pytest

from _torchrun import metrics as _metrics, ok as _ok

pytestmark = pytest.mark.slow

SMALL = ["compile.backend=aot_eager", "model.n_layer=2", "model.n_embd=64", "model.n_head=2",
         "train.batch_size=4", "train.seq_len=16", "ddp.bucket_cap_mb=0.2"]


def test_two_ranks_profile_writes_a_trace_with_partitions_and_all_reduces_and_a_timeline(tmp_path, torchrun):
    proc = torchrun(tmp_path, *SMALL, "train.steps=4", "profile.steps=[3,4]", "diagnose=true", "hydra.run.dir=run",
                    timeout=300)
    _ok(proc)
    run = tmp_path / "run"
    m = _metrics(run)
    n = len(m["buckets"])
    assert n >= 2, "the test needs several buckets"
    trace = json.loads((run / "trace.json").read_text())
    names = [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"]
    for step in (3, 4):
        assert names.count(f"step {step}") == 1
    for i in range(n):  # every partition labelled, forward and backward, in both steps
        assert names.count(f"partition {i} forward") == 2 and names.count(f"partition {i} backward") == 2, i
    # gloo's all-reduce: every bucket, and the loop's all-reduce of loss and tokens, in both steps
    assert names.count("gloo:all_reduce") == 2 * (n + 1)
    png = run / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    p = m["profile"]
    assert p["steps"] == [3, 4] and p["step"] == 4 and p["timeline"] == str(png) and p["exposed_comm_ms"] >= 0
    assert [r for r in p["rows"] if r.startswith("all-reduce bucket")] == [
        f"all-reduce bucket {i} ({m['buckets'][i]['size'] / 2**20:.2f} MiB)" for i in reversed(range(n))]
    assert sum(r.endswith(" backward") for r in p["rows"]) == n
    # the doctor's report links them (diagnosis.json is written from it)
    assert m["diagnosis"]["profile"]["trace"] == str(run / "trace.json")
    assert "overlap picture (rank 0, step 4): trace" in proc.stdout
    assert not (tmp_path / "trace.json").exists()  # rank 1 profiled too, and wrote nothing
