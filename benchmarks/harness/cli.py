"""Command-line pieces the studies share: the model and run flags of the interleaved
benchmarks (``ddp_compare``, ``fsdp_compare``; ``--device`` among them, see Note [Benchmark
device] in ``benchmarks.harness.device``), filling unset flags from the quick or full defaults,
the device and process group of a worker, rank 0's outputs, and the render-to-docs flags
(``--readme``, ``--render``) of every study that writes a docs block."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from launch.models import GPTConfig

from .report import DocsBlock, print0, write_json

if TYPE_CHECKING:
    from .device import Placement

__all__ = ["new_parser", "rendered_parser", "add_docs_args", "render_only", "readme_after_run", "add_common_args",
           "fill_defaults", "check_device", "check_net", "job_kwargs", "process_group", "publish"]


def new_parser(module: str, doc: str | None, quick_help: str) -> argparse.ArgumentParser:
    """The parser of ``python -m module``, its docstring as description, with ``--quick``."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"{quick_help} (flags given explicitly still win)")
    return p


def rendered_parser(module: str, doc: str | None, page: Path, start: str) -> argparse.ArgumentParser:
    """The parser of a study whose JSON renders a docs block: ``--out``, ``--render`` and ``--page``."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the JSON rows: written by a run, read by --render")
    p.add_argument("--render", action="store_true", help="write the docs block from --out; run nothing")
    p.add_argument("--page", default=str(page), help=f"with --render: the page whose {start} block is rewritten")
    return p


def add_docs_args(p: argparse.ArgumentParser, block: DocsBlock, *, switch: bool = False,
                  render_help: str | None = None) -> None:
    """The render-to-docs flags of a study that writes ``block``: ``--readme PAGE`` (a run also
    rewrites PAGE's block) and ``--render``, which rewrites a page's block from a result JSON and
    runs nothing: ``--render JSON PAGE``, or with ``switch`` a bare ``--render`` that rewrites
    ``--readme``'s block from ``--json``. :func:`render_only` carries ``--render`` out."""
    p.add_argument("--readme", default=None, metavar="PAGE",
                   help=f"after the run, also rewrite PAGE's {block.name} block (it lives on {block.page})")
    if switch:
        p.add_argument("--render", action="store_true",
                       help=render_help or "only rewrite --readme's block from --json; run nothing")
    else:
        p.add_argument("--render", nargs=2, metavar=("JSON", "PAGE"),
                       help=render_help or "only rewrite PAGE's block from the result at JSON; run nothing")


def render_only(args: argparse.Namespace, block: DocsBlock) -> Any | None:
    """``--render`` (:func:`add_docs_args`) carried out when it was given: the page's block rewritten
    from the result JSON and ``updated PAGE`` printed; returns the result read (a caller may draw more
    from it, a plot), or None without ``--render``."""
    if not args.render:
        return None
    if args.render is True:  # the switch: --readme's block from --json
        if not args.readme:
            raise SystemExit(f"--render rewrites the {block.name} block of --readme, and none was given: add "
                             f"--readme {block.page} (and --json JSON for another result than the default).")
        json_path, page = args.json, args.readme
    else:
        json_path, page = args.render
    result = json.loads(Path(json_path).read_text())
    block.write(result, page)
    print(f"updated {page}")
    return result


def readme_after_run(args: argparse.Namespace, block: DocsBlock, result: Any) -> None:
    """The end of a run with ``--readme PAGE``: PAGE's block rewritten from ``result``; rank 0 says so."""
    if args.readme:
        block.write(result, args.readme)
        print0(f"updated {args.readme}")


def add_common_args(p: argparse.ArgumentParser, *, layers: int, embd: int, embd_help: str, plot_help: str) -> None:
    """``--nproc --device --backend --batch --seq --vocab --layers --embd --heads --seed --json --plot``."""
    p.add_argument("--nproc", type=int, default=2, help="ranks (processes) to launch (default 2)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",  # device.DEVICES; no torch here
                   help="where the ranks run: cuda (rank r on GPU r %% GPUs; NCCL when every rank has a GPU of its "
                        "own, else gloo), cpu (gloo), or auto = cuda when torch.cuda.is_available() (default auto)")
    p.add_argument("--backend", default=None, help="dynamo backend for the compiled modes (default inductor)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=GPTConfig.block_size, help="sequence length (block_size)")
    p.add_argument("--vocab", type=int, default=GPTConfig.vocab_size)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--embd", type=int, default=embd, help=embd_help)
    p.add_argument("--heads", type=int, default=GPTConfig.n_head)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--net", default="local",
                   help="local: every rank on this machine's loopback (default); shaped:RATE (tc units, e.g. "
                        "shaped:800mbit = 100 MB/s): two nodes of --nproc/2 ranks, each in its own network namespace, "
                        "joined by a link shaped to RATE (needs root and iproute2; benchmarks.link.netns)")
    p.add_argument("--json", default=None, help="write the rows here (a JSON list)")
    p.add_argument("--plot", default=None, help=f"{plot_help} (default: the --json path with .png)")


def fill_defaults(args: argparse.Namespace, defaults: dict[str, Any],
                  convert: Callable[[str, Any], Any] = lambda key, value: value) -> argparse.Namespace:
    """Set every flag the user left unset (None) from ``defaults``; derive ``--plot`` from ``--json``."""
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, convert(key, value))
    if args.plot is None and args.json:
        args.plot = str(Path(args.json).with_suffix(".png"))
    return args


def check_device(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Resolve ``--device auto`` to cpu or cuda; ``--device cuda`` without CUDA exits here
    (code 2, argparse's error), before anything is launched."""
    from .device import resolve_device  # torch: only once the flags are known to need it

    try:
        args.device = resolve_device(args.device)
    except ValueError as e:
        p.error(str(e))
    return args


def check_net(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``--net``: ``local`` or ``shaped:RATE`` with RATE checked; a shaped net needs an even
    ``--nproc`` and a machine that can make namespaces (checked only by the launcher, not
    by the ranks it starts, which run inside them). Errors exit here with code 2."""
    from ..link import netns
    from .torchrun import inside_torchrun

    if args.net == "local":
        return args
    if not args.net.startswith("shaped:"):
        p.error(f"--net {args.net!r} is not a network: use local (the default) or shaped:RATE, e.g. shaped:800mbit.")
    try:
        args.net = "shaped:" + netns.parse_rate(args.net)
    except ValueError as e:
        p.error(f"--net: {e}")
    if args.nproc < 2 or args.nproc % 2:
        p.error(f"--net shaped runs two nodes of --nproc/2 ranks each, and --nproc {args.nproc} does not split in "
                "two: pass an even --nproc (2 = one rank per node).")
    reason = None if inside_torchrun() else netns.unavailable_reason()
    if reason is not None:
        p.error(f"--net {args.net} needs two network namespaces, and they cannot be made here: {reason}. Run as "
                "root on a machine with iproute2 (ip, tc), or measure over the simulated link instead: --net local "
                "with --link (ddp_compare), e.g. --link 1ms,100MB/s.")
    return args


def job_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``core.GPTJob`` fields of the common flags (and ``--modes``, ``--steps``, ``--warmup``)."""
    return dict(modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()), device=args.device,
                backend=args.backend, warmup=args.warmup, rounds=args.steps, batch=args.batch, seq=args.seq,
                vocab=args.vocab, layers=args.layers, embd=args.embd, heads=args.heads, seed=args.seed)


@contextlib.contextmanager
def process_group(device: str, name: str) -> Iterator[Placement]:
    """This rank's device (``cpu`` or ``cuda``, resolved) made current and torchrun's process
    group for the block, its backend chosen by ``device.place_rank``; rank 0 prints which
    and why (``name`` leads the line). A barrier closes a block that succeeds, so rank 0 has
    written its outputs before any rank leaves."""
    import torch.distributed as dist

    from launch.runtime.dist import destroy_process_group

    from .device import device_label, place_rank

    placement = place_rank(device)
    dist.init_process_group(placement.backend)
    try:
        print0(f"{name}: process group {placement.backend}, device {device_label(placement.device)}: {placement.why}.")
        yield placement
        dist.barrier()
    finally:
        destroy_process_group()  # Note [Process-group teardown] in launch.runtime.dist


def publish(rows: Sequence[dict], args: argparse.Namespace, *, module: str, command_env: str,
            plot: Callable[[str], object]) -> None:
    """Rank 0's outputs: every row stamped with the command that reproduces it (from
    ``command_env``, which ``torchrun.relaunch`` sets), then ``--json`` and ``--plot``."""
    command = os.environ.get(command_env, f"python -m {module} " + shlex.join(sys.argv[1:]))
    for row in rows:
        row["command"] = command
        row["net"] = args.net
    if args.json:
        write_json(rows, args.json)
        print0(f"wrote {args.json}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print0(f"not writing {args.plot}: matplotlib is not installed. Install the bench extra "
                   "(pip install -e .[bench]) or pass no --json/--plot to skip the plot.")
        else:
            plot(args.plot)
            print0(f"wrote {args.plot}")
