"""benchmarks.harness.core, the mode tables, benchmarks.harness.report and benchmarks._torch_internals,
without a process group: registration, the row pieces, the round loop, the tables."""

import argparse
import json
import logging
import math
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from benchmarks._torch_internals import BuiltinBuckets, cache_counts, graphs_compiled
from benchmarks.harness.cli import publish
from benchmarks.harness.core import Runner, compile_seconds, first_steps, loss_reference, max_loss_diff, measure_rounds, \
    step_stats
from benchmarks.studies.ddp_bench import BenchConfig
from benchmarks.studies.fsdp_bench import FSDP_MODES, FSDPBenchConfig
from benchmarks.studies.modes_ddp import DDP_MODES, DEFAULT_CAP, build_runner
from benchmarks.harness.report import cap_label, fmt, markdown_table, with_iqr
from fsdp_opt import FSDPCompileConfig


def test_the_traced_mode_reports_the_fused_all_reduces_of_the_synchronised_backward():
    traced = DDP_MODES["ours_traced"]
    r = SimpleNamespace(fn=SimpleNamespace(traced=SimpleNamespace(fused=[[2**20, 2**19], [2**20]])))
    assert traced.fused_bytes(r) == [2**20, 2**19] and traced.partitions(r) == 2  # the first backward compiled
    cached = SimpleNamespace(fn=SimpleNamespace(traced=SimpleNamespace(fused=[])))  # Inductor's cache served it
    assert traced.fused_bytes(cached) is None and traced.partitions(cached) is None
    assert DDP_MODES["ours"].fused_bytes(r) is None and DDP_MODES["compiled_autograd"].fused_bytes(r) is None


def test_every_ddp_mode_is_registered_and_describes_itself():
    assert DDP_MODES.names == ("eager", "builtin", "nosplit", "ours", "ours_nogate", "regional", "compiled_autograd",
                               "ours_traced", "ours_traced_oib", "eager_bf16", "builtin_bf16", "compiled_autograd_bf16",
                               "ours_bf16", "ours_traced_bf16", "eager_powersgd", "ours_powersgd", "ours_traced_powersgd")
    for name in DDP_MODES.names:
        assert DDP_MODES[name].name == name and DDP_MODES[name].summary
        assert DDP_MODES.describe([name]) == f"  {name}: {DDP_MODES[name].summary}"
    assert [n for n in DDP_MODES.names if not DDP_MODES[n].compiled] == ["eager", "eager_bf16", "eager_powersgd"]
    assert [n for n in DDP_MODES.names if DDP_MODES[n].plans_auto] == [
        "ours", "ours_nogate", "ours_traced", "ours_traced_oib", "ours_bf16", "ours_traced_bf16", "ours_powersgd",
        "ours_traced_powersgd"]
    caps = (1.0, 4.0, "auto")
    assert {n: DDP_MODES[n].sweep_caps(caps) for n in DDP_MODES.names} == {
        "eager": [DEFAULT_CAP], "builtin": [1.0, 4.0], "nosplit": [DEFAULT_CAP], "ours": [1.0, 4.0, "auto"],
        "ours_nogate": [1.0, 4.0, "auto"], "regional": [], "compiled_autograd": [1.0, 4.0],
        "ours_traced": [1.0, 4.0, "auto"], "ours_traced_oib": ["auto"], "eager_bf16": [DEFAULT_CAP],
        "builtin_bf16": [1.0, 4.0], "compiled_autograd_bf16": [1.0, 4.0],
        "ours_bf16": [1.0, 4.0, "auto"], "ours_traced_bf16": [1.0, 4.0, "auto"],
        "eager_powersgd": [1.0, 4.0, DEFAULT_CAP], "ours_powersgd": [1.0, 4.0, "auto"],
        "ours_traced_powersgd": [1.0, 4.0, "auto"]}
    # The bf16 and PowerSGD modes send through their own hook, not the simulated link's.
    assert [n for n in DDP_MODES.names if not DDP_MODES[n].takes_hook] == [
        "compiled_autograd", "ours_traced", "ours_traced_oib", "eager_bf16", "builtin_bf16", "compiled_autograd_bf16",
        "ours_bf16", "ours_traced_bf16", "eager_powersgd", "ours_powersgd", "ours_traced_powersgd"]
    assert [n for n in DDP_MODES.names if DDP_MODES[n].compression] == ["eager_powersgd", "ours_powersgd",
                                                                         "ours_traced_powersgd"]
    assert [n for n in DDP_MODES.names if DDP_MODES[n].reduce_dtype == "bf16"] == [
        "eager_bf16", "builtin_bf16", "compiled_autograd_bf16", "ours_bf16", "ours_traced_bf16"]


def test_an_unknown_mode_names_the_valid_ones():
    with pytest.raises(ValueError, match="valid modes are eager, builtin, nosplit, ours, ours_nogate, regional, "
                                         "compiled_autograd, ours_traced, ours_traced_oib, eager_bf16, .*, "
                                         "ours_traced_powersgd. Leave "
                                         "--modes out"):
        DDP_MODES["fast"]
    with pytest.raises(ValueError, match="valid modes are eager, per_block, grouped"):
        FSDP_MODES.check(())


def test_fsdp_modes_give_their_apply_keywords():
    cfg = FSDPBenchConfig(backend="aot_eager", shard_unit_mb=3.0, prefetch=2)
    assert FSDP_MODES["eager"].apply_kwargs(cfg) == dict(compile=None, prefetch=0, replicate=False)
    assert FSDP_MODES["per_block"].apply_kwargs(cfg) == dict(compile="aot_eager", prefetch=0, replicate=False)
    assert FSDP_MODES["grouped"].apply_kwargs(cfg) == dict(compile="aot_eager", prefetch=2, shard_unit_mb=3.0,
                                                           replicate=False)
    bf16 = FSDP_MODES["grouped_bf16"].apply_kwargs(cfg)
    assert bf16.pop("mp_policy") == MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    assert bf16 == FSDP_MODES["grouped"].apply_kwargs(cfg)
    assert FSDP_MODES["replicate_per_block"].apply_kwargs(cfg) == dict(compile="aot_eager", prefetch=0, replicate=True)
    whole = FSDP_MODES["replicate_whole"].apply_kwargs(cfg)
    assert whole["replicate"] and whole["compile"] == FSDPCompileConfig(backend="aot_eager", whole_model=True)
    assert FSDP_MODES.describe(FSDP_MODES.default).count("\n") == 2


def test_config_errors_say_how_to_fix_them():
    with pytest.raises(ValueError, match="--steps must be >= 1.*Pass --steps 1 or more"):
        FSDPBenchConfig(rounds=0)
    with pytest.raises(ValueError, match="--shard-unit-mb must be > 0.*--prefetch 0 for FSDP2's implicit prefetch"):
        FSDPBenchConfig(shard_unit_mb=0)
    with pytest.raises(ValueError, match="cap 'auto' is compile_ddp's cost-model plan.*only ours, ours_nogate, ours_traced, "
                                         "ours_traced_oib, ours_bf16, "
                                         "ours_traced_bf16, ours_powersgd, ours_traced_powersgd plan"):
        build_runner("builtin", BenchConfig(), "auto", link=None)  # refused before anything is built
    assert (FSDPBenchConfig().layers, BenchConfig().layers) == (8, 4)  # each family keeps its own model


def test_row_pieces():
    steps = step_stats([0.1, 0.2, 0.3], [0.2, 0.2, 0.2])
    assert steps.median_s == pytest.approx(0.2) and steps.ratio == pytest.approx(1.0)
    assert step_stats([0.1], None).ratio is None
    assert compile_seconds(5.0, 0.2, compiled=True) == pytest.approx(4.8)
    assert compile_seconds(None, 0.2, compiled=True) is None and compile_seconds(5.0, 0.2, compiled=False) == 0.0
    gathered = [{"losses": {"eager": [1.0, 2.0], "ours": [1.0, 2.5]}}, {"losses": {"eager": [1.0], "ours": [0.0]}}]
    assert max_loss_diff(gathered, "ours", "eager") == 1.0 and max_loss_diff(gathered, "ours", None) is None


def _runner(name, compiled):
    return Runner(mode=SimpleNamespace(name=name, compiled=compiled, summary=name), opt=None)


def test_first_steps_and_rounds_record_every_runner_and_rotate(capsys):
    runners = [_runner("eager", False), _runner("a", True), _runner("b", True)]
    assert loss_reference(runners) == "eager"
    first_steps(runners, lambda r: 1.5, phase="first step", prefix="[t] ")
    assert all(r.first_step_s == [1.5] and set(r.cache_events[0]) == set(cache_counts()) for r in runners)
    order = []

    def run_round(r, measured):
        order.append(r.label)
        if measured:
            r.step_s.append(0.01)
        return 0.01

    measure_rounds(runners, 1, 2, run_round, "[t] ")
    assert order == ["eager", "a", "b", "a", "b", "eager", "b", "eager", "a"]
    assert [len(r.step_s) for r in runners] == [2, 2, 2]
    err = capsys.readouterr().err
    assert "[t] first step: a (compiling...) 1.5 s" in err and "[t] round 2/2: b 10ms, eager 10ms, a 10ms" in err


def test_report_cells_and_tables():
    assert fmt(None, ".1f") == "-" and fmt(math.nan, ".1f") == "-" and fmt(2, "d") == "2"
    assert with_iqr(1.0, 0.9, 1.1) == "1.000 [0.900, 1.100]" and with_iqr(None, None, None) == "-"
    assert cap_label(4.0) == "4" and cap_label("auto") == "auto"
    assert markdown_table(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |"


def test_publish_stamps_the_command_and_writes_json(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_TEST_COMMAND", "python -m benchmarks.x --quick")
    rows = [{"mode": "eager"}]
    args = argparse.Namespace(json=str(tmp_path / "out" / "rows.json"), plot=None, net="shaped:200mbit")
    publish(rows, args, module="benchmarks.x", command_env="BENCH_TEST_COMMAND", plot=lambda path: None)
    assert json.loads((tmp_path / "out" / "rows.json").read_text()) == [
        {"mode": "eager", "command": "python -m benchmarks.x --quick", "net": "shaped:200mbit"}]


def test_builtin_bucket_log_reads_the_splitters_count_and_restores_the_logger():
    logger = logging.getLogger(BuiltinBuckets.LOGGER)
    handlers, level = list(logger.handlers), logger.level
    log = BuiltinBuckets()
    with log.listening():
        logger.info("\nDDPOptimizer used bucket cap %s and created %d buckets. Enable debug logs.", 1048576, 3)
    logger.info("\nDDPOptimizer used bucket cap %s and created %d buckets.", 1048576, 5)  # not listening
    assert log.counts == [3]
    assert logger.handlers == handlers and logger.level == level
    assert isinstance(graphs_compiled(), int)
