"""benchmarks.render.compression_report on hand-made rows: the table of a bf16 sweep and the compression
goal rows, each with the measured value beside its bound."""

import pytest

from benchmarks.render.compression_report import goals, results_markdown
from benchmarks.harness.limit import add_limit_columns, limit_parts


def _row(mode, cap, steps, dtype):
    return {"mode": mode, "runner": f"{mode}@{cap}", "bucket_cap_mb": cap, "step_ms_rounds": steps,
            "step_ms_median": sorted(steps)[len(steps) // 2], "step_ms_q1": min(steps), "step_ms_q3": max(steps),
            "fwd_ms": 10, "bwd_ms": 20, "opt_ms": 2, "reduce_dtype": dtype,
            "wire_mib": 6.3 if dtype == "bf16" else 12.6}


def _rows():
    rows = [_row("compiled_autograd", 1, [100, 100, 100], "fp32"), _row("eager_bf16", 25, [80, 80, 80], "bf16"),
            _row("builtin_bf16", 1, [60, 60, 60], "bf16"), _row("ours_bf16", "auto", [54, 57, 60], "bf16")]
    add_limit_columns(rows, {"fp32": limit_parts(rows, 0.080), "bf16": limit_parts(rows, 0.040)})
    return rows


def test_goal_rows_compare_each_bound_with_the_measured_value():
    found = {goal: (bound, measured, met) for goal, bound, measured, met in goals(_rows())}
    assert found["ours_bf16@auto vs the best bf16 peer (builtin_bf16@1)"] == ("<= 1.00", "0.950", "yes")
    assert found["ours_bf16@auto vs the best fp32 peer (compiled_autograd@1)"] == ("<= 0.60", "0.570", "yes")
    # the link (40 ms) exceeds backward (20 ms): the step is held to its limit, 52 ms
    assert found["ours_bf16@auto step / limit on bf16 bytes (the link exceeds backward)"] == ("<= 1.05", "1.096",
                                                                                               "**no**")
    # eager_bf16 is 80 / 52 = 1.54 of its limit: ours must be at most 0.90 of it
    assert found["ours_bf16@auto vs eager_bf16@25 (1.54 of its limit)"] == ("<= 0.90", "0.713", "yes")
    assert found["ours_bf16@auto vs builtin_bf16@1 (1.15 of its limit)"] == ("<= 0.90", "0.950", "**no**")
    # compiled_autograd@1 is 100 / 92 = 1.09 of its fp32 limit: under 1.10, not a peer this goal counts
    assert len([g for g in found if "of its limit" in g]) == 2


def test_the_block_lists_rows_fastest_first_with_what_each_sends():
    text = results_markdown(_rows(), command="python -m benchmarks.studies.ddp_compare ...")
    rows_table = text.split("Compression goals")[0]
    lines = [line for line in rows_table.splitlines() if line.startswith("| ")]
    assert lines[1] == ("| auto | ours_bf16 | bf16 | 6.3 | 57.0 [54.0, 60.0] | 0.950 [0.925, 0.975] | "
                        "0.570 [0.555, 0.585] | 1.10 | 52.0 |")
    assert lines[-1].startswith("| 1 | compiled_autograd | fp32 | 12.6 | 100.0")
    assert "Command: `python -m benchmarks.studies.ddp_compare ...`" in text and "Compression goals" in text


def test_powersgd_rows_are_held_to_their_own_peer_and_to_045_of_the_best_fp32_peer():
    kind = "powersgd:4:2"
    rows = [_row("compiled_autograd", 1, [100, 100, 100], "fp32"),
            dict(_row("eager_powersgd", 25, [40, 40, 40], "fp32"), compression=kind, wire_mib=0.3),
            dict(_row("eager_powersgd", 1, [50, 50, 50], "fp32"), compression=kind, wire_mib=0.3),
            dict(_row("ours_powersgd", "auto", [42, 42, 42], "fp32"), compression=kind, wire_mib=0.3)]
    # 4 ms: what the iteration added inside backward; 3 ms: the same timed alone, reported, not in the limit.
    add_limit_columns(rows, {"fp32": limit_parts(rows, 0.080), kind: limit_parts(rows, 0.002, 0.004, 0.003)})
    found = {goal: (bound, measured, met) for goal, bound, measured, met in goals(rows)}
    assert rows[-1]["limit_ms"] == pytest.approx(10 + (20 + 4) + 2)  # fwd + (bwd + the power iteration) + opt: compute-bound
    assert rows[-1]["limit_compress_alone_ms"] == pytest.approx(3.0)
    assert found == {
        f"ours_powersgd@auto vs the best {kind} peer (eager_powersgd@25)": ("<= 1.00", "1.050", "**no**"),
        "ours_powersgd@auto vs the best fp32 peer (compiled_autograd@1)": ("<= 0.45", "0.420", "yes"),
        "ours_powersgd@auto step / limit (its bytes, and its power iteration on backward's core)":
            ("<= 1.15", "1.167", "**no**")}
    text = results_markdown(rows)
    assert f"| auto | ours_powersgd | {kind} | 0.3 | 42.0" in text
    assert f"The {kind} rows' limit adds the power iteration's own compute to backward: 4.0 ms" in text
    assert "timed inside an eager backward that ran them on each gradient" in text and "(timed alone: 3.0 ms)" in text


def test_powersgd_sends_p_and_q_of_the_matrices_worth_compressing_and_the_rest_whole():
    import torch

    from benchmarks.harness.limit import wire_kind, wire_numel

    params = [torch.zeros(600, 600), torch.zeros(600), torch.zeros(4, 600)]
    assert wire_numel(params, None) == 360_000 + 600 + 2_400
    # 600 x 600 at rank 4: (600 + 600) * 4; a vector, and 4 x 600 (604 * 4 does not halve 2400), sent whole
    assert wire_numel(params, "powersgd:4:2") == 4_800 + 600 + 2_400
    assert wire_kind({"reduce_dtype": "fp32", "compression": "powersgd:4:2"}) == "powersgd:4:2"
    assert wire_kind({"reduce_dtype": "bf16", "compression": None}) == "bf16" and wire_kind({}) == "fp32"
