"""benchmarks.link.shaping: the link's time model, its parser, and the hook on a real
single-rank gloo group (the real all-reduce happens, delivery waits for the link)."""

import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.link.shaping import LINK_PRESETS, LinkModel, SimulatedLink, parse_link


def test_presets_and_custom_values_parse():
    assert not parse_link("none").enabled
    fast = parse_link("1ms,1GB/s")
    assert (fast.alpha_s, fast.bandwidth) == (pytest.approx(1e-3), 1e9)
    slow = parse_link("1ms,100MB/s")
    assert slow.bandwidth == 1e8 and slow.label == "1ms,100MB/s"
    custom = parse_link("250us, 2.5GiB/s")
    assert custom.alpha_s == pytest.approx(250e-6) and custom.bandwidth == pytest.approx(2.5 * 2**30)
    for preset in LINK_PRESETS:
        parse_link(preset)


@pytest.mark.parametrize("bad", ["fast", "1ms", "1ms,100Mb/s", "1h,1GB/s"])
def test_bad_link_names_the_accepted_forms(bad):
    with pytest.raises(ValueError, match="expected 'none' or 'ALPHA,BANDWIDTH'.*--link none"):
        parse_link(bad)


def test_transfer_time_is_alpha_plus_bytes_over_bandwidth():
    link = LinkModel(alpha_s=1e-3, bandwidth=1e8)
    assert link.transfer_s(16 * 2**20) == pytest.approx(1e-3 + 16 * 2**20 / 1e8)
    assert LinkModel().transfer_s(10**9) == 0.0


def test_serial_link_queues_buckets_behind_each_other():
    link = LinkModel(alpha_s=0.01, bandwidth=1000.0)  # 100 B take 0.1 s + 0.01 s
    free = 0.0
    done_times = []
    for ready in (0.0, 0.02, 0.5):  # the 2nd waits for the 1st; the 3rd finds the link idle
        start, done = link.schedule(ready, free, 100)
        free = done
        done_times.append((start, done))
    assert done_times[0] == (0.0, pytest.approx(0.11))
    assert done_times[1] == (pytest.approx(0.11), pytest.approx(0.22))
    assert done_times[2] == (0.5, pytest.approx(0.61))


def test_hook_delivers_after_the_modelled_serial_time(gloo):
    link = SimulatedLink(LinkModel(alpha_s=0.02, bandwidth=4000 * 1000.0))  # 4000 floats: 0.02 + 0.016 s
    tensors = [torch.full((4000,), float(i)) for i in range(3)]
    t0 = time.perf_counter()
    futures = [link._reduce(t) for t in tensors]
    done = []
    for fut in futures:
        fut.wait()
        done.append(time.perf_counter() - t0)
    per_bucket = 0.02 + 16000 / 4e6
    for i, t in enumerate(done):  # serial: bucket i is delivered no earlier than (i + 1) transfers
        assert t >= (i + 1) * per_bucket - 1e-3, f"bucket {i} delivered at {t:.4f}s, before the link could"
    assert [f.value()[0].item() for f in futures] == [0.0, 1.0, 2.0]
    stats = link.take_step_stats()
    assert (stats.buckets, stats.nbytes) == (3, 3 * 16000)
    assert stats.link_s == pytest.approx(3 * per_bucket)
    assert link.take_step_stats().buckets == 0


def test_ddp_gradients_are_exact_with_the_hook(gloo):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    ddp = DDP(model, bucket_cap_mb=0.0001)  # several buckets
    link = SimulatedLink(parse_link("1ms,100MB/s"))
    ddp.register_comm_hook(link, SimulatedLink.hook)
    for step in range(2):  # DDP rebuilds its buckets after the first step
        x = torch.randn(5, 8)
        ddp(x).square().sum().backward()
        ref(x).square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"step {step}, {name}: {m}")
            p.grad, q.grad = None, None
        stats = link.take_step_stats()
        assert stats.nbytes == sum(p.numel() * 4 for p in model.parameters())
    assert stats.buckets >= 2, stats


def test_probe_takes_the_hook_path_but_is_not_counted_and_fits_the_link(gloo):
    from ddp_opt.planning.cost import measure_link

    link = SimulatedLink(LinkModel(alpha_s=2e-3, bandwidth=2e8))
    t = torch.full((1000,), 3.0)
    t0 = time.perf_counter()
    link.probe(t).wait()
    assert time.perf_counter() - t0 >= 2e-3 + 4000 / 2e8 - 1e-4
    assert t[0].item() == 3.0  # summed over one rank, not averaged
    est = measure_link(link.probe, reps=3, warmup=1)
    assert link.take_step_stats().buckets == 0
    # The link never delivers early; load on the machine only adds time (loose upper bound).
    modelled = 2e-3 + 4 * 2**20 / 2e8
    assert 0.9 * modelled <= est.transfer_s(4 * 2**20) <= 3 * modelled, est
