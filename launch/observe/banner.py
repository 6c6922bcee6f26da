"""What rank 0 prints about the run before it trains: the resolved config in short
(:func:`describe`) and the table of DDP buckets = graph partitions after the first step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tabulate import tabulate

from ddp_opt import format_buckets

from ..config.schema import FSDPOptions, JobConfig, ParallelMode, Padding

MiB = 1 << 20

if TYPE_CHECKING:
    from ddp_opt import Alignment

    from ..runtime.parallel import Wrapped

__all__ = ["describe", "partition_table", "ddp_lines"]


def describe(cfg: JobConfig) -> str:
    """The resolved config in short: one line per group."""
    m, c, d, t = cfg.model, cfg.compile, cfg.ddp, cfg.train
    model = f"{m.name} target={m._target_}" if m._target_ else (
        f"{m.name} n_layer={m.n_layer} n_head={m.n_head} n_embd={m.n_embd} vocab={m.vocab_size} block={m.block_size}"
    )
    comp = f"{c.backend}" + (f" mode={c.mode}" if c.mode else "") + (f" options={c.options}" if c.options else "")
    comp += f" dynamic={c.dynamic} fullgraph={c.fullgraph}" + (" optimizer" if c.optimizer else "")
    ddp = " ".join(f"{k}={getattr(d, k)}" for k in ("bucket_cap_mb", "first_bucket_cap_mb", "bucket_cap_mb_list")
                   if getattr(d, k) is not None) or "defaults (25 MiB, first 1 MiB)"
    data = cfg.data.name + (f" target={cfg.data._target_}" if cfg.data._target_ else "")
    data += f" path={cfg.data.path} val_fraction={cfg.data.val_fraction}" if cfg.data.path else ""
    data += f" lengths={cfg.data.lengths} padding={cfg.data.padding}" + (
        f" pad_multiple={cfg.data.pad_multiple}" if cfg.data.padding == Padding.MULTIPLE else "")
    ckpt = f"every {t.checkpoint_every} steps -> {t.checkpoint_dir}" if t.checkpoint_every else "off"
    lines = [
        ("model", model),
        ("parallel", f"{cfg.parallel.name} ({cfg.parallel.dist_backend})"),
        ("compile", comp),
        *([("ddp", ddp + (" static_graph" if d.static_graph else "") + f" strategy={d.strategy}"
                   + (" optimizer_in_backward" if d.optimizer_in_backward else ""))]
          if cfg.parallel.name == ParallelMode.DDP else []),
        *([("fsdp", _describe_fsdp(cfg.fsdp))] if cfg.parallel.name == ParallelMode.FSDP else []),
        ("data", data),
        ("train", f"steps={t.steps} batch={t.batch_size} seq={t.seq_len} lr={t.lr} seed={t.seed} "
                  f"resume={t.resume} precision={t.precision} grad_accum={t.grad_accum}"
                  + (" no_recompile_after_warmup" if t.no_recompile_after_warmup else "")
                  + (f" lr_schedule={t.lr_schedule} warmup_steps={t.warmup_steps}"
                     + (f" min_lr={t.min_lr}" if t.lr_schedule != "constant" else "")
                     if t.lr_schedule != "constant" or t.warmup_steps else "")
                  + (f" max_grad_norm={t.max_grad_norm}" if t.max_grad_norm else "")
                  + (f" eval_every={t.eval_every} eval_batches={t.eval_batches}" if t.eval_every else "")),
        ("checkpoint", ckpt),
    ]
    return "\n".join(f"  {k:<10} {v}" for k, v in lines)


def _describe_fsdp(f: FSDPOptions) -> str:
    units = f"shard_unit_mb={f.shard_unit_mb}" if f.shard_unit_mb is not None else "one unit per block"
    return (f"strategy={f.strategy} {units} prefetch={f.prefetch} reshard_after_forward={f.reshard_after_forward} "
            f"checkpointing={f.checkpointing} mixed_precision={f.mixed_precision}")


def ddp_lines(wrapped: Wrapped, alignment: Alignment | None) -> list[str]:
    """What DDP's gradients went through: the realigned buckets' alignment, or under
    ``ddp.strategy=traced`` the fused all-reduces of the compiled backward; and with
    ``ddp.optimizer_in_backward`` the updates run inside backward (per bucket; per parameter when traced)."""
    lines = []
    updates = wrapped.in_backward_updates()
    traced = wrapped.traced_buckets()
    if updates is not None and traced is not None:
        lines.append(f"optimizer in backward: {updates} parameter update(s) on rank 0, traced into the compiled "
                     "backward after their bucket's all-reduce (ddp.optimizer_in_backward=true; the step after "
                     "backward found no gradients)")
    elif updates is not None:
        lines.append(f"optimizer in backward: {updates} bucket update(s) on rank 0, each run inside backward right "
                     "after its bucket's all-reduce (ddp.optimizer_in_backward=true; the step after backward found "
                     "no gradients)")
    if alignment is not None:
        lines.append(f"alignment: {alignment.fraction:.2f} of gradient bytes are in DDP buckets that hold exactly "
                     f"one partition ({sum(alignment.aligned)} of {len(alignment.aligned)} runtime buckets)")
    if traced:
        lines.append(f"ddp.strategy=traced: {len(traced)} all-reduce(s) fused in the compiled backward graph, "
                     f"MiB {[round(b / 2**20, 2) for b in traced]} (gradient-ready order)")
    elif traced is not None:
        lines.append("ddp.strategy=traced: the all-reduces run inside the compiled backward graph; no fusion "
                     "recorded (a backend without Inductor's fusion pass all-reduces one gradient at a time; a "
                     "backward loaded from Inductor's cache fused as when it was compiled, without running the "
                     "pass again)")
    return lines


def partition_table(wrapped: Wrapped, verbose: bool = False) -> str | None:
    """DDP's buckets, one line each (``verbose``: one line per parameter, and each partition's
    compile outcome in a table of its own); None without compile_ddp."""
    buckets = wrapped.buckets()
    if not buckets:
        return None
    records = wrapped.partition_records()
    if verbose:
        text = f"DDP buckets = graph partitions ({len(buckets)}):\n{format_buckets(buckets)}"
        if records:
            rows = [(r.index, r.name, r.status, f"{r.compile_s:.2f}") for r in records]
            text += "\n" + tabulate(rows, headers=("partition", "name", "status", "compile s"), tablefmt="simple")
        return text
    rows = [(i, f"{b.size / MiB:.2f}", f"{b.cap / MiB:.2f}", len(b.params), _first_last(b.params))
            for i, b in enumerate(buckets)]
    text = (f"DDP buckets = graph partitions ({len(buckets)}; log.verbose=true lists every parameter):\n"
            + tabulate(rows, headers=("bucket", "MiB", "cap MiB", "params", "first .. last parameter"),
                       tablefmt="simple", disable_numparse=True, colalign=("right",) * 4 + ("left",)))
    if records:
        text += "\n" + _partitions_line(records)
    return text


def _first_last(names: list[str]) -> str:
    if not names:
        return "(no parameters)"
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"


def _partitions_line(records: list) -> str:
    """The partitions' compile outcome in one line: how many compiled, in how long, and
    each one that runs eagerly by name."""
    compiled = [r for r in records if r.status == "compiled"]
    here = [r for r in compiled if not getattr(r, "shared", False)]
    eager = [r.name for r in records if r.status == "eager"]
    loaded = len(compiled) - len(here)
    return (f"partitions: {len(compiled)}/{len(records)} compiled"
            + (f", {len(here)} on this rank in {sum(r.compile_s for r in here):.1f}s and {loaded} loaded from another "
               f"rank's compile" if loaded else f" in {sum(r.compile_s for r in here):.1f}s")
            + (f"; eager (failed to compile): {', '.join(eager)}" if eager else ""))
