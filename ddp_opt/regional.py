"""Regional compile under DDP: compile the repeated block once, bucket by blocks.

Note [Regional compile]

Background
    Whole-model compile traces, partitions and lowers every transformer layer
    again, although the layers are the same code on parameters of the same
    shapes. Compiling the block's forward instead gives one dynamo graph that
    every instance reuses: with ``inline_inbuilt_nn_modules`` (the default) the
    parameters are graph inputs, not constants, so the guards of the first
    block's graph hold for the others.

Algorithm
    - ``compiler.regional.find_blocks`` (shared with FSDP's per-block compile)
      picks the repeated blocks; ``compiler.regional.compile_blocks`` compiles
      each in place with the plain backend (``Module.compile``), never split
      inside.
    - Everything else (embeddings, final norm, head, loss) runs eagerly: it is a
      small share of the compute, and compiling it would mean a second capture
      of the outer forward with a graph break at every block.
    - A compiled block's backward is one autograd node: all of its gradients
      become ready together, when it ends. So partition boundaries *are* block
      boundaries, and :func:`plan_block_buckets` groups whole blocks (in
      gradient-ready order, last block first) until DDP's cap for that bucket is
      reached. The parameters outside the blocks join the same greedy fill as two
      more units: those registered after the last block (final norm, untied
      head) are ready first and open the first bucket, those before the first
      block (embeddings; a tied head shares them) are ready last and close the
      last one.
      ``CompiledDDP`` realigns DDP's reducer to these buckets after step 1
      (Note [Bucket realignment]); ``ddp_opt.measure_alignment`` checks it.

Cost
    Every compiled block call pays a fixed runtime price that one whole-model
    graph pays once: dynamo's frame entry and guard check, AOTAutograd's forward
    wrapper and its backward node. Measured on the 2-core CPU machine (one
    process, one thread, blocks of the launcher's GPT at batch 4, sequence 64):
    four blocks as four graphs against one graph cost about 1 ms more per extra
    graph per step at width 128 (0.5 ms at width 32), and as much with
    ``aot_eager`` as with Inductor, so it is not the generated kernels. The
    profiler puts it in the self time of ``CompiledFunction``,
    ``CompiledFunctionBackward`` and the compiled region (~0.2 ms each per call)
    and the guard check (~0.07 ms). Neither compiling ``forward`` instead of the
    module nor Inductor's ``cpp_wrapper`` or ``size_asserts=False`` changed it.
    Against blocks of ~8 ms forward + backward that is a step-time cost of
    5-10%; at width 256 it is within noise (``benchmarks.compile_time``).

Notes
    - The outside-parameter order is a heuristic (parameter registration order);
      an unusual model shows it as alignment below 1.0, not as wrong results.
    - A block whose forward breaks the graph still works (dynamo compiles the
      pieces); only a graph break changes the one-graph-per-block count.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from compiler import find_blocks

from .plan import Bucket, BucketCaps

__all__ = ["find_ddp_blocks", "plan_block_buckets"]


def find_ddp_blocks(model: nn.Module, blocks: str | Sequence[str] = "auto") -> list[tuple[str, nn.Module]]:
    """``compiler.regional.find_blocks`` with an error that says how to fix it for DDP."""
    try:
        return find_blocks(model, blocks)
    except ValueError as e:
        raise ValueError(
            f"Regional compile needs repeated blocks to compile once and reuse: {e} Pass them as "
            "compile_ddp(..., strategy='regional', blocks=...) (launcher: compile.blocks=...), or compile the whole "
            "model instead (compile_ddp(..., strategy='split'); launcher: ddp.strategy=split)."
        ) from None


def _unit(model_params: dict[int, str], params: list[nn.Parameter]) -> Bucket:
    unit = Bucket()
    for p in params:
        unit.params.append(model_params[id(p)])
        unit.param_ids.append(id(p))
        unit.size += p.numel() * p.element_size()
    return unit


def plan_block_buckets(model: nn.Module, found: list[tuple[str, nn.Module]], caps: BucketCaps) -> list[Bucket]:
    """Buckets made of whole blocks, in forward order (see the Note).

    Args:
        model: the model (DDP's ``module``).
        found: its blocks, in forward order, from :func:`find_ddp_blocks`.
        caps: DDP's caps (``caps_from_ddp``), in gradient-ready order.
    """
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = {id(p): n for n, p in trainable}
    in_block: dict[int, int] = {}
    for i, (_, block) in enumerate(found):
        for p in block.parameters():
            if id(p) in names:
                in_block.setdefault(id(p), i)
    order = [i for i, (n, p) in enumerate(trainable) if id(p) in in_block]
    first = order[0] if order else len(trainable)
    before = [p for i, (_, p) in enumerate(trainable) if id(p) not in in_block and i < first]
    after = [p for i, (_, p) in enumerate(trainable) if id(p) not in in_block and i >= first]
    per_block = [[p for _, p in trainable if in_block.get(id(p)) == i] for i in range(len(found))]

    # Gradient-ready order: after-the-blocks, last block .. first block, before. Greedy
    # over these units, as DDP fills its buckets over parameters: the small outside
    # groups ride with their neighbouring blocks instead of costing a collective each.
    units = ([after] if after else []) + list(reversed(per_block)) + ([before] if before else [])
    buckets: list[Bucket] = []
    current: Bucket | None = None
    for params in units:
        unit = _unit(names, params)
        if current is None:
            current = Bucket(cap=caps.cap_for(len(buckets)))
        current.size += unit.size
        current.params += unit.params
        current.param_ids += unit.param_ids
        if current.size >= current.cap:
            buckets.append(current)
            current = None
    if current is not None:
        buckets.append(current)
    return list(reversed(buckets))
