"""benchmarks.render.readme_results rewrites only the marked section of a file."""

import json

import pytest

from benchmarks.render.readme_results import END, START, main, replace_section, results_markdown

ROWS = [
    {"mode": m, "backend": "inductor" if m != "eager" else "eager", "link": "1ms,100MB/s", "bucket_cap_mb": cap,
     "step_ms_median": 100.0 + i, "ratio_vs_builtin": 1.0 + i / 100, "ratio_q1": 0.99, "ratio_q3": 1.02,
     "overlap": 0.5, "compile_s": 0.0 if m == "eager" else 10.0, "compile_cold_s": 0.0 if m == "eager" else 10.0,
     "compile_warm_s": 0.0 if m == "eager" else 3.0, "partitions": None if m == "eager" else 4,
     "loss_max_abs_diff": 1e-6, "exposed_comm_ms": 12.0, "mode_order": i, "world_size": 2, "rounds": 8,
     "command": "python -m benchmarks.studies.ddp_compare --caps 1,4"}
    for cap in (1.0, 4.0) for i, m in enumerate(("eager", "builtin", "nosplit", "ours"))
]


def test_table_has_one_line_per_row_and_the_plot():
    body = results_markdown(ROWS, plot="bench_out/full.png")
    table = [line for line in body.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(ROWS)  # header + rows
    assert "| 4 | ours | inductor | 103.0 | 1.030 [0.990, 1.020] |" in body
    assert "![step time vs bucket cap](bench_out/full.png)" in body
    assert "--caps 1,4" in body


def test_peak_memory_column_and_device_only_where_the_rows_have_them():
    body = results_markdown(ROWS)
    assert "peak MiB" not in body and "device `" not in body  # rows from before --device, or CPU rows
    assert "peak MiB" not in results_markdown([dict(r, device="cpu", peak_mib=None) for r in ROWS])
    gpu = results_markdown([dict(r, device="cuda: NVIDIA H200", peak_mib=800.0 + i) for i, r in enumerate(ROWS)])
    assert "| alignment | peak MiB | max loss diff |" in gpu and "| 4 | ours | inductor | 103.0 |" in gpu
    assert "| 807 | 1.00e-06 |" in gpu  # the last row, ours at cap 4
    assert "world size 2, device `cuda: NVIDIA H200`," in gpu and "`torch.cuda.max_memory_allocated`" in gpu


def test_only_the_marked_section_changes(tmp_path):
    readme = tmp_path / "README.md"
    before, after = "# Title\n\nintro text\n\n", "\n\n## Later\nkept as is\n"
    readme.write_text(f"{before}{START}\nold numbers\n{END}{after}")
    data = tmp_path / "rows.json"
    data.write_text(json.dumps(ROWS))
    assert main([str(data), str(readme), "--plot", "full.png"]) == 0
    text = readme.read_text()
    assert text.startswith(before + START + "\n") and text.endswith(END + after)
    assert "old numbers" not in text and "| 1 | eager | eager |" in text
    # Regenerating is idempotent.
    main([str(data), str(readme), "--plot", "full.png"])
    assert readme.read_text() == text


@pytest.mark.parametrize("text", ["no markers", f"{START} twice {START} {END}", f"{END} reversed {START}"])
def test_markers_must_be_there_once_and_in_order(text):
    with pytest.raises(ValueError, match="Expected exactly one"):
        replace_section(text, "body")


def test_limit_and_best_peer_columns_and_the_shaped_network_where_the_rows_have_them():
    assert "step / limit" not in results_markdown(ROWS)  # rows from before the limit
    limit = dict(limit_ms=80.0, limit_fwd_ms=20.0, limit_bwd_ms=50.0, limit_comm_ms=55.0, limit_opt_ms=5.0,
                 best_peer="builtin@1", net="shaped:800mbit", link="none")
    rows = [dict(r, **limit, step_over_limit=r["step_ms_median"] / 80.0, ratio_vs_best_peer=0.97,
                 ratio_vs_best_peer_q1=0.95, ratio_vs_best_peer_q3=0.99) for r in ROWS]
    body = results_markdown(rows)
    assert "| ratio vs builtin [IQR] | vs best peer [IQR] | step / limit | exposed comm ms |" in body
    assert "| 4 | ours | inductor | 103.0 | 1.030 [0.990, 1.020] | 0.970 [0.950, 0.990] | 1.29 |" in body
    assert "Network `shaped:800mbit` (two nodes" in body
    assert "Physical limit 80.0 ms = fwd 20.0 + max(bwd 50.0, comm 55.0) + opt 5.0" in body and "`builtin@1`" in body


def test_the_torch_release_of_the_rows_is_named():
    assert ", torch 2.15.0+cpu," in results_markdown([dict(r, torch="2.15.0+cpu") for r in ROWS])
    assert ", torch not recorded (2.13 or older)," in results_markdown(ROWS)  # rows from before it was recorded
