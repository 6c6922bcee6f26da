"""Two nodes on this machine (benchmarks.link.netns): the shaped link is made as asked and
leaves nothing behind (also after an exception, SIGTERM or SIGKILL of its holder), and
the main job as 2 nodes x 1 rank over it (torchrun c10d rendezvous) trains exactly as
``--standalone --nproc-per-node 2`` does. Skipped with the reason where namespaces
cannot be made (not root, no iproute2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.link.netns import PREFIX, namespaces, parse_rate, rate_bits_per_s, shaped_network, unavailable_reason

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def netns_here():
    """Skip where namespaces cannot be made; probed once, and only by the tests that need
    them (the probe starts ``ip``: no process at collection or in the fast tier)."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no network namespaces here: {reason}")


def needs_netns(test):
    """A test that makes namespaces: it starts ip and tc, so it is in the slow tier; it runs alone
    (Note [Test tiers]): the machine has one list of namespaces, which these tests compare before
    and after, and a shaped link's rate is what the node pair gets."""
    return pytest.mark.alone(pytest.mark.slow(pytest.mark.usefixtures("netns_here")(test)))


def _ours() -> list[str]:
    return [n for n in namespaces(PREFIX) if n.startswith(f"{PREFIX}{os.getpid()}n")]


def test_rates_in_tc_units_and_a_bad_rate_says_how_to_write_one():
    assert parse_rate("shaped:800mbit") == "800mbit" and rate_bits_per_s("800mbit") == 8e8
    assert rate_bits_per_s("1.5gbit") == 1.5e9
    with pytest.raises(ValueError, match=r"'shaped:100MB/s' is not a link rate: .* e.g. shaped:800mbit"):
        parse_rate("shaped:100MB/s")


@needs_netns
def test_the_link_is_shaped_as_asked_and_removed_after_an_error():
    with pytest.raises(KeyboardInterrupt):
        with shaped_network("200mbit") as net:
            assert sorted(_ours()) == sorted(n.namespace for n in net.nodes)
            for i, node in enumerate(net.nodes):
                qdisc = subprocess.run(net.command(i, ["tc", "qdisc", "show", "dev", node.ifname]),
                                       capture_output=True, text=True, check=True).stdout
                assert "tbf" in qdisc and "rate 200Mbit" in qdisc, qdisc
                env = net.env(i)  # gloo and NCCL bound to this node's veth; NCCL takes each node for a host
                assert {env[k] for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")} == {node.ifname}, env
                assert env["NCCL_HOSTID"] == node.namespace and env["NCCL_P2P_DISABLE"] == env["NCCL_SHM_DISABLE"] == "1"
            raise KeyboardInterrupt  # Ctrl-C inside the block
    assert _ours() == []
    assert not any(os.path.exists(f"/etc/netns/{n.namespace}") for n in net.nodes)


HOLDER = """
import sys, time
sys.path.insert(0, {repo!r})
from benchmarks.link.netns import shaped_network
with shaped_network("100mbit") as net:
    print(" ".join(n.namespace for n in net.nodes), flush=True)
    time.sleep(60)
"""


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_holder_killed_by_sigterm_or_sigkill_leaves_nothing_behind(sig):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(repo=str(REPO))], stdout=subprocess.PIPE,
                              text=True)
    names = holder.stdout.readline().split()
    assert len(names) == 2 and set(names) <= set(namespaces())
    holder.send_signal(sig)
    holder.wait(timeout=30)
    if sig == signal.SIGKILL:  # nothing could run in the holder: the next network sweeps its namespaces
        assert set(names) <= set(namespaces())
        with shaped_network("100mbit"):
            pass
    else:
        assert holder.returncode == 128 + sig
    assert not set(names) & set(namespaces())


SMALL = ["compile.backend=aot_eager", "model.n_layer=2", "model.n_embd=64", "model.n_head=2", "train.batch_size=4",
         "train.seq_len=32", "ddp.bucket_cap_mb=0.05", "train.steps=4"]


def _losses(run_dir: Path) -> list:
    return json.loads((run_dir / "metrics.json").read_text())["losses"]


@needs_netns
def test_the_main_job_on_two_nodes_over_a_shaped_link_trains_as_on_one(tmp_path, torchrun):
    ref = torchrun(tmp_path, *SMALL, "hydra.run.dir=standalone", timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with shaped_network("800mbit") as net:
        procs = [net.popen(i, net.torchrun(i, 29531, 1, ["-m", "launch.train", *SMALL, "hydra.run.dir=nodes"],
                                           python=sys.executable),
                           env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
                 for i in (0, 1)]
        deadline = time.monotonic() + 300
        outs = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {i} exit {p.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    assert "2 rank(s), cpu + gloo" in outs[0][0]
    assert _losses(tmp_path / "nodes") == _losses(tmp_path / "standalone")


# --- the benchmarks over a shaped link (--net) -------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--net", "shaped:fast"], "--net: 'shaped:fast' is not a link rate"),
    (["--net", "wan"], "--net 'wan' is not a network: use local (the default) or shaped:RATE"),
    (["--net", "shaped:800mbit", "--nproc", "3"], "--nproc 3 does not split in two: pass an even --nproc"),
    (["--net", "shaped:800mbit", "--link", "1ms,100MB/s"], "are two links at once"),
])
def test_ddp_compare_net_flags_are_refused_before_launching(argv, message, capsys, monkeypatch):
    from benchmarks.link import netns
    from benchmarks.studies.ddp_compare import parse_args

    monkeypatch.setattr(netns, "unavailable_reason", lambda: None)  # refused whether or not namespaces can be made

    with pytest.raises(SystemExit) as e:
        parse_args(["--quick", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_without_namespaces_net_says_why_and_points_at_the_simulated_link(monkeypatch, capsys):
    from benchmarks.link import netns
    from benchmarks.studies.fsdp_compare import parse_args

    monkeypatch.setattr(netns, "unavailable_reason", lambda: "making network namespaces needs root")
    with pytest.raises(SystemExit) as e:
        parse_args(["--quick", "--net", "shaped:200mbit"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "cannot be made here: making network namespaces needs root" in err
    assert "--net local with --link" in err


@needs_netns
def test_ddp_compare_runs_as_two_nodes_over_the_shaped_link(tmp_path):
    out = tmp_path / "rows.json"
    before = set(namespaces())
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.studies.ddp_compare", "--device", "cpu", "--backend", "aot_eager", "--layers", "1",
         "--embd", "64", "--heads", "2", "--vocab", "256", "--seq", "16", "--batch", "2", "--caps", "1", "--steps",
         "2", "--warmup", "1", "--modes", "eager,ours,compiled_autograd", "--net", "shaped:800mbit", "--json", str(out), "--plot", ""],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "launching node 1" in proc.stderr and "net shaped:800mbit, link none" in proc.stderr
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["net"], r["link"]) for r in rows] == [
        ("eager", "shaped:800mbit", "none"), ("ours", "shaped:800mbit", "none"),
        ("compiled_autograd", "shaped:800mbit", "none")]
    for r in rows[1:]:  # parity with eager DDP, checked in the run
        assert r["loss_max_abs_diff"] < 1e-4, r
    assert set(namespaces()) <= before  # the launcher removed its two nodes


def test_compiled_autograd_is_refused_with_the_simulated_link_it_would_not_pay():
    from benchmarks.studies.ddp_bench import BenchConfig
    from benchmarks.link.shaping import parse_link

    with pytest.raises(ValueError, match=r"compiled_autograd with --link 1ms,100MB/s: .* never reach DDP's comm hook"
                                         r".*--net shaped:RATE"):
        BenchConfig(modes=("eager", "compiled_autograd"), link=parse_link("1ms,100MB/s"), caps=(1.0,))
    BenchConfig(modes=("eager", "compiled_autograd"), link=parse_link("none"), caps=(1.0,))
