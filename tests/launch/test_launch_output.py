"""What the main job prints: one line per bucket (every parameter with -v), a line at least
every 10 s while compiling, an ETA on step lines, one format for everything rank 0 prints,
and at most 50 lines for a 20-step run."""

from __future__ import annotations

import logging
import re
import time
from types import SimpleNamespace

import pytest

from compiler.graph.partition import PartitionRecord
from compiler.graph.progress import ProgressTicker, compiling, now_compiling
from ddp_opt import Bucket
from launch.config.argv import check_argv
from launch.observe.banner import partition_table
from launch.observe.console import ConsoleFormatter
from launch.observe.report import Tally, format_duration, step_line

MiB = 1 << 20


def _wrapped(records):
    buckets = [Bucket(size=int(2.3 * MiB), cap=25 * MiB, params=["blocks.2.mlp.fc.weight", "blocks.3.ln.bias",
                                                                "wte.weight"]),
               Bucket(size=MiB, cap=MiB, params=["ln_f.weight"])]
    return SimpleNamespace(buckets=lambda: buckets, partition_records=lambda: records)


def test_the_bucket_table_is_one_line_per_bucket_and_verbose_lists_every_parameter():
    records = [PartitionRecord(0, "submod_0", "compiled", 5.9), PartitionRecord(1, "submod_1", "eager", 0.1)]
    lines = partition_table(_wrapped(records)).splitlines()
    assert lines[0] == "DDP buckets = graph partitions (2; log.verbose=true lists every parameter):"
    assert lines[1].split() == ["bucket", "MiB", "cap", "MiB", "params", "first", "..", "last", "parameter"]
    assert lines[3].split() == ["0", "2.30", "25.00", "3", "blocks.2.mlp.fc.weight", "..", "wte.weight"]
    assert lines[4].split() == ["1", "1.00", "1.00", "1", "ln_f.weight"]
    assert lines[5] == "partitions: 1/2 compiled in 5.9s; eager (failed to compile): submod_1"
    assert len(lines) == 6
    verbose = partition_table(_wrapped(records), verbose=True)
    assert "blocks.3.ln.bias" in verbose and "submod_1  eager" in verbose
    assert partition_table(SimpleNamespace(buckets=lambda: [], partition_records=lambda: [])) is None


def test_a_partition_another_rank_compiled_is_counted_as_loaded_not_compiled_in_0s():
    records = [PartitionRecord(0, "submod_0", "compiled", 18.0), PartitionRecord(1, "submod_1", "compiled", 0.0,
                                                                                 shared=True)]
    assert partition_table(_wrapped(records)).splitlines()[5] == (
        "partitions: 2/2 compiled, 1 on this rank in 18.0s and 1 loaded from another rank's compile")


def test_dash_v_is_log_verbose_beside_the_other_overrides():
    argv, problem = check_argv(["compile=aot_eager", "-v", "--config-name", "config"])
    assert problem is None and argv == ["compile=aot_eager", "log.verbose=true", "--config-name", "config"]
    assert check_argv(["--verbose"])[0] == ["log.verbose=true"]


def test_step_lines_carry_an_eta_once_steps_are_timed():
    tally = Tally()
    tally.add_step(1, 6.0, 512, 512, 30.0, first=True)  # the compile
    assert tally.eta_s(1, 100) is None
    for step, seconds in ((2, 0.5), (3, 0.7), (4, 0.6)):
        tally.add_step(step, 6.0, 512, 512, seconds, first=False)
    assert tally.eta_s(4, 100) == pytest.approx(0.6 * 96)  # the median timed step, the steps left
    assert tally.eta_s(99, 100) == pytest.approx(0.6) and tally.eta_s(100, 100) is None  # none after the last
    line = step_line(4, 100, 6.0, 0.6, 512, eta_s=tally.eta_s(4, 100))
    assert line.endswith("  eta 58s")
    assert "eta" not in step_line(1, 100, 6.0, 30.0, 512)
    assert step_line(99, 100, 6.0, 0.6, 512, eta_s=tally.eta_s(99, 100)).endswith("  eta 0.6s")
    assert [format_duration(s) for s in (0.04, 9.94, 9.96, 42, 185, 7620)] == ["<0.1s", "9.9s", "10s", "42s", "3m05s",
                                                                           "2h07m"]


def test_console_log_records_read_like_the_jobs_own_lines():
    def record(level):
        return logging.LogRecord("ddp_opt.strategies.split", level, __file__, 1, "planned %d bucket(s)", (2,), None)

    fmt = ConsoleFormatter()
    assert fmt.format(record(logging.INFO)) == "planned 2 bucket(s)"
    assert fmt.format(record(logging.WARNING)) == "warning: planned 2 bucket(s)"
    assert fmt.format(record(logging.ERROR)) == "error: planned 2 bucket(s)"


def test_a_long_compile_is_said_every_interval_with_what_compiles():
    said = []
    ticker = ProgressTicker(said.append, every_s=10.0)
    assert ticker.line(time.monotonic()) is None  # nothing compiling
    with compiling("step 1, the first"), compiling("partition 2/4 (submod_1)"):
        start = time.monotonic()
        assert [label for label, _ in now_compiling()] == ["step 1, the first", "partition 2/4 (submod_1)"]
        assert ticker.line(start + 5) is None  # not yet 10 s
        line = ticker.line(start + 11)
        assert line.startswith("still compiling partition 2/4 (submod_1) (11s so far); step 1, the first: 11s")
        assert ticker.line(start + 15) is None  # said 4 s ago
        assert ticker.line(start + 22) is not None
    assert now_compiling() == [] and ticker.line(time.monotonic() + 60) is None


def test_the_ticker_thread_says_lines_while_a_compile_lasts():
    said = []
    with ProgressTicker(said.append, every_s=0.05, poll_s=0.01):
        with compiling("partition 1/1 (submod_0)"):
            deadline = time.monotonic() + 10
            while not said and time.monotonic() < deadline:
                time.sleep(0.01)
    assert said and said[0].startswith("still compiling partition 1/1 (submod_0)")


def test_a_twenty_step_run_prints_at_most_fifty_plain_lines(launch_cli):
    result = launch_cli("compile=aot_eager", "train.steps=20")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) <= 50, result.stdout
    # One format: log records print as plain lines, like the job's own (the log file keeps the time).
    assert any(line.startswith("ddp_opt planned 2 bucket(s)") for line in lines)
    assert not any("][INFO]" in line or line.startswith("[20") for line in lines), result.stdout
    assert sum(line.startswith("DDP buckets = graph partitions") for line in lines) == 1
    # The toolkit says once that it is in control (Note [In control, once]), an INFO record rank 0 shows.
    said = [line for line in lines if line.startswith("ddp_opt in control")]
    assert said == ["ddp_opt in control (launch.train): strategy=split, backend=aot_eager; 2 buckets = graph "
                    "partitions (2.30, 1.01 MiB); DDP's buckets realigned with them, alignment 1.00"], said
    # One line per step; a busy machine adds "step times (after the first) varied widely ..." (in the 50).
    assert sum(re.match(r"step +\d+/20 ", line) is not None for line in lines) == 20, result.stdout


# --- the pictures ---------------------------------------------------------------------


def test_curves_leave_the_compiling_step_out_of_time_panels_and_constant_curves_out():
    from launch.observe.tensorboard import curve_panels

    curves = {"loss": [(1, 6.2), (2, 6.1), (3, 6.0)], "step_s": [(1, 19.0), (2, 0.03), (3, 0.031)],
              "lr": [(1, 3e-3), (2, 3e-3), (3, 3e-3)]}
    panels, constant = curve_panels(curves)
    assert constant == {"lr": 3e-3}
    assert panels == [("loss", curves["loss"]), ("step_s (first step 19, not drawn)", [(2, 0.03), (3, 0.031)])]


def test_the_timeline_cuts_all_reduce_bars_where_the_exposed_time_ends():
    from launch.observe.timeline import split_at

    # The gloo worker's span ran 9 ms past the point where DDP had copied the result back.
    before, after = split_at([(10.0, 30.0), (32.0, 49.3)], 40.3)
    assert before == [(10.0, 30.0), (32.0, 40.3)] and after == [(40.3, 49.3)]
