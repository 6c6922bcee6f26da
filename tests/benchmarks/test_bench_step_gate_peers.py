"""benchmarks.studies.step_gate_peers: its modes and its refusal of an unknown one (the runs
themselves are the step-gate tests' subject: tests/ddp_opt/test_ddp_step_gate.py)."""

from __future__ import annotations

import pytest

from benchmarks.studies import step_gate_peers


def test_an_unknown_mode_is_refused_naming_the_modes(capsys):
    with pytest.raises(SystemExit) as e:
        step_gate_peers.main(["--modes", "gate,guard"])
    assert e.value.code == 2
    assert "unknown mode(s) ['guard']: the modes are torch_compile, guard_collectives" in capsys.readouterr().err
