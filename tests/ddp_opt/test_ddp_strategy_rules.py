"""Each strategy's rules (ddp_opt/strategies/rules.py) are what the checks do: a strategy whose
entry says it takes no cost model is refused one, one that compile_for_ddp does not offer is
refused there, and the table lists every strategy with its rules."""

import pytest
import torch

from compiler import SettingError
from ddp_opt import DDPCompileConfig, compile_for_ddp
from ddp_opt.config import STRATEGIES as NAMES
from ddp_opt.strategies.rules import RULES
from ddp_opt.strategies.table import STRATEGIES


def test_the_table_holds_every_strategy_with_its_rules():
    assert list(STRATEGIES) == list(RULES) == list(NAMES)
    assert all(STRATEGIES[name].rules is RULES[name] for name in RULES)
    assert {name: RULES[name].says for name in RULES} == NAMES


@pytest.mark.parametrize("strategy", list(RULES))
def test_a_cost_model_is_refused_where_the_rules_say_the_strategy_plans_no_buckets(strategy):
    if RULES[strategy].plans_buckets:
        assert DDPCompileConfig(strategy=strategy, bucket_cap_mb="auto").strategy == strategy
        return
    with pytest.raises(SettingError, match=rf"compile_ddp\(bucket_cap_mb='auto', strategy='{strategy}'\): the cost "
                                           r"model chooses .* or use strategy='split' or 'traced'\.") as e:
        DDPCompileConfig(strategy=strategy, bucket_cap_mb="auto")
    assert e.value.setting == "bucket_cap_mb"


@pytest.mark.parametrize("strategy", list(RULES))
def test_compile_for_ddp_offers_the_strategies_the_rules_say_it_does(strategy):
    model = torch.nn.Linear(4, 4)
    if RULES[strategy].compile_first:
        assert compile_for_ddp(model, strategy=strategy, backend="eager") is model
        return
    with pytest.raises(SettingError, match=rf"compile_for_ddp\(strategy='{strategy}'\): this setting needs the DDP "
                                           r"module before the first forward"):
        compile_for_ddp(model, strategy=strategy, backend="eager")
