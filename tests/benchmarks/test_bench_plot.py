"""benchmarks.harness.plot redraws a benchmark's PNG from its JSON, the physical limit included."""

import json

import pytest

from benchmarks.harness.plot import main, replot

pytest.importorskip("matplotlib")

DDP_ROWS = [
    {"mode": m, "runner": f"{m}@{cap:g}", "backend": "eager" if m == "eager" else "inductor", "link": "none",
     "net": "shaped:100mbit", "bucket_cap_mb": cap, "step_ms_median": 100.0 + i, "step_ms_q1": 99.0 + i,
     "step_ms_q3": 101.0 + i, "ratio_vs_builtin": 1.0, "ratio_q1": 0.9, "ratio_q3": 1.1, "limit_ms": 90.0,
     "world_size": 2, "device": "cpu"}
    for cap in (1.0, 4.0) for i, m in enumerate(("builtin", "ours", "compiled_autograd"))
] + [{"mode": "ours", "runner": "ours@auto", "backend": "inductor", "link": "none", "net": "shaped:100mbit",
      "bucket_cap_mb": "auto", "step_ms_median": 98.0, "ratio_vs_builtin": 0.95, "limit_ms": 90.0}]
FSDP_ROWS = [{"mode": m, "backend": "inductor", "step_ms_median": 200.0, "step_ms_q1": 190.0, "step_ms_q3": 210.0,
              "units": 3, "limit_ms": 150.0, "net": "shaped:800mbit", "transport": "gloo", "world_size": 2}
             for m in ("eager", "per_block", "grouped")]


@pytest.mark.parametrize("rows", [DDP_ROWS, FSDP_ROWS], ids=["ddp", "fsdp"])
def test_replot_writes_a_png_next_to_the_json(tmp_path, rows):
    src = tmp_path / "rows.json"
    src.write_text(json.dumps(rows))
    out = replot(src)
    assert out == tmp_path / "rows.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(src), str(tmp_path / "other.png")]) == 0 and (tmp_path / "other.png").exists()


def test_replot_refuses_a_file_without_rows(tmp_path):
    src = tmp_path / "empty.json"
    src.write_text("[]")
    with pytest.raises(ValueError, match="holds no rows.*--json of a finished run"):
        replot(src)
