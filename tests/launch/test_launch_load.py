"""Measurements you can trust: an oversubscribed machine (load average over the cores, or
ranks x intra-op threads over the cores) is named beside the figures, with what to change,
and the job's summary says when its step times varied widely."""

from __future__ import annotations

from launch.observe.load import MachineLoad, spread_line
from launch.observe.report import Tally, summary_lines


def test_a_quiet_machine_has_no_note():
    assert MachineLoad(cores=2, load=0.4, ranks=1, threads=2).note() is None
    assert MachineLoad(cores=2, load=None, ranks=2, threads=1).note() is None


def test_ranks_times_threads_over_the_cores_suggest_omp_num_threads():
    note = MachineLoad(cores=2, load=1.0, ranks=2, threads=2).note()
    assert note == ("the machine is oversubscribed (2 rank(s) x 2 intra-op thread(s) on 2 core(s)), so these timings "
                    "are slower and noisier than on a quiet machine: give each rank at most its share of the cores: "
                    "OMP_NUM_THREADS=1.")


def test_a_load_average_over_the_cores_names_the_other_work():
    note = MachineLoad(cores=2, load=5.0, ranks=1, threads=1).note()
    assert note.startswith("the machine is oversubscribed (load average 5.0 on 2 core(s))")
    assert note.endswith("measure when the other work on this machine has finished.") and "OMP_NUM_THREADS" not in note
    both = MachineLoad(cores=2, load=5.0, ranks=2, threads=2).note()
    assert "load average 5.0 on 2 core(s); 2 rank(s) x 2 intra-op thread(s)" in both
    assert "OMP_NUM_THREADS=1 and measure when" in both


def test_widely_varying_times_are_said_with_the_machines_state():
    steady = [30.0, 31.0, 29.5, 30.2, 30.8, 29.9]
    assert spread_line(steady, "step times", MachineLoad(2, 5.0, 1, 1)) is None
    assert spread_line([30.0, 90.0, 31.0], "step times", MachineLoad(2, 5.0, 1, 1)) is None  # too few to say
    wide = [30.0, 31.0, 29.0, 95.0, 30.5, 120.0, 30.0, 31.5, 88.0, 30.0]
    busy = spread_line(wide, "step times", MachineLoad(2, 5.0, 1, 1))
    assert busy.startswith("step times varied widely: ") and "(10th to 90th percentile); the machine is " \
                                                             "oversubscribed (load average 5.0" in busy
    quiet = spread_line(wide, "step times", MachineLoad(2, 0.5, 1, 1))
    assert quiet.endswith("the machine is not oversubscribed now, so look for other work that ran during the run")


def test_the_jobs_summary_adds_the_line_only_when_steps_varied_widely():
    metrics = dict(graphs=None, real_tokens_per_s=1000.0, tokens_per_s=1000.0, padding_waste=0.0, recompiles=0,
                   start_step=0, steps=11, final_loss=5.0, median_step_ms=30.0, first_step_s=2.0, wall_s=3.0)
    tally = Tally()
    tally.add_step(1, 6.0, 512, 512, 2.0, first=True)
    for step, ms in enumerate([30.0, 31.0, 29.0, 95.0, 30.5, 120.0, 30.0, 31.5, 88.0, 30.0], start=2):
        tally.add_step(step, 6.0, 512, 512, ms / 1e3, first=False)
    lines = summary_lines(metrics, tally, MachineLoad(2, 5.0, 1, 1))
    assert lines[-1].startswith("step times (after the first) varied widely: ")
    steady = Tally()
    for step in range(1, 8):
        steady.add_step(step, 6.0, 512, 512, 0.03, first=step == 1)
    assert not any("varied widely" in line for line in summary_lines(metrics, steady, MachineLoad(2, 5.0, 1, 1)))
