"""The model zoo of ``test_ddp_zoo.py``: tiny ``transformers`` models with random
weights (no downloads), and the job each spawned rank runs on them.

Each architecture is trained twice per loss variant, side by side, for ``STEPS``
steps: ``compile_ddp(DDP(model))`` with ``aot_eager`` and eager ``DDP(copy)``,
same seeds, same inputs. ``"outside"`` computes the loss from the logits outside
the model; ``"inside"`` passes ``labels=`` so that HF computes the loss in
forward. What each rank saw comes back as a plain dict (it crosses a pickle).
"""

from __future__ import annotations

import copy
import logging
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from compiler._torch_internals import graph_break_frame
from ddp_opt import compile_ddp, measure_alignment
from ddp_opt.alignment.measure import runtime_buckets

STEPS = 3
VOCAB, SEQ, BATCH, IMAGE = 100, 12, 2, 16
BUCKET_CAP_MB = 0.02  # ~20 KiB: every model below has several buckets
VARIANTS = ("outside", "inside")
RTOL, ATOL = 1e-4, 1e-5


@dataclass(frozen=True)
class Arch:
    """One architecture: ``build()`` makes the model, ``kind`` says what it eats."""

    name: str
    build: Callable[[], torch.nn.Module]
    kind: str  # causal, masked, seq2seq or image
    # Dynamo runs whole frames holding parameters eagerly (here: a loop over experts with a
    # data-dependent `nonzero`): those parameters are in no partition, so DDP's buckets cannot
    # all be partitions, and compile_ddp must say so.
    params_outside_graphs: bool = False


def _tiny(cls_name: str, config_name: str, **cfg: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import transformers

        config = getattr(transformers, config_name)(**cfg)
        return getattr(transformers, cls_name)(config)

    return build


_DEC = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=64)

ARCHS = {a.name: a for a in (
    Arch("gpt2", _tiny("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2,
                       n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "causal"),
    Arch("llama", _tiny("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=1, **_DEC), "causal"),
    Arch("bert", _tiny("BertForMaskedLM", "BertConfig", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       **_DEC), "masked"),
    Arch("t5", _tiny("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64,
                     num_layers=2, num_decoder_layers=2, num_heads=2, dropout_rate=0.0, decoder_start_token_id=0),
         "seq2seq"),
    Arch("vit", _tiny("ViTForImageClassification", "ViTConfig", image_size=IMAGE, patch_size=4, num_channels=3,
                      hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_labels=5,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "image"),
    Arch("mixtral", _tiny("MixtralForCausalLM", "MixtralConfig", num_key_value_heads=1, num_local_experts=4,
                          num_experts_per_tok=2, attention_dropout=0.0, **_DEC), "causal"),
    Arch("opt", _tiny("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                      num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0,
                      attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0), "causal"),
    Arch("bart", _tiny("BartForConditionalGeneration", "BartConfig", vocab_size=VOCAB, d_model=32, encoder_layers=2,
                       decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                       decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                       activation_dropout=0.0), "seq2seq"),
    Arch("distilbert", _tiny("DistilBertForMaskedLM", "DistilBertConfig", vocab_size=VOCAB, dim=32, n_layers=2,
                             n_heads=2, hidden_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0),
         "masked"),
    Arch("qwen2_moe", _tiny("Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_key_value_heads=1, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                            attention_dropout=0.0, **_DEC), "causal"),
    Arch("mixtral_eager_experts", _tiny("MixtralForCausalLM", "MixtralConfig", num_key_value_heads=1,
                                        num_local_experts=4, num_experts_per_tok=2, attention_dropout=0.0,
                                        experts_implementation="eager", **_DEC), "causal",
         params_outside_graphs=True),
    Arch("gpt_neox", _tiny("GPTNeoXForCausalLM", "GPTNeoXConfig", hidden_dropout=0.0, attention_dropout=0.0,
                           **_DEC), "causal"),
)}


def batch(kind: str, rank: int, step: int) -> dict[str, torch.Tensor]:
    """The inputs of one step on one rank, with ``labels`` (ranks see different data)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if kind == "image":
        return dict(pixel_values=torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g),
                    labels=torch.randint(0, 5, (BATCH,), generator=g))
    x = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    if kind == "seq2seq":
        y = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        return dict(input_ids=x, labels=y)
    return dict(input_ids=x, labels=x)


def loss_of(model: Callable, kind: str, inputs: dict[str, torch.Tensor], variant: str) -> torch.Tensor:
    """``"inside"``: the model's own loss (``labels=``); ``"outside"``: cross entropy on its logits,
    with the same shifts HF applies."""
    if variant == "inside":
        return model(**inputs).loss
    labels = inputs["labels"]
    if kind == "image":
        return F.cross_entropy(model(pixel_values=inputs["pixel_values"]).logits, labels)
    if kind == "seq2seq":
        decoder_input_ids = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)
        logits = model(input_ids=inputs["input_ids"], decoder_input_ids=decoder_input_ids).logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    logits = model(input_ids=inputs["input_ids"]).logits
    if kind == "causal":
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class GraphRecorder:
    """A ``wrap_backend``: what the splitter did with every graph dynamo handed it,
    and why dynamo ended that graph."""

    def __init__(self) -> None:
        self.graphs: list[dict[str, Any]] = []

    def wrap(self, backend: Callable) -> Callable:
        splitter = backend.__self__  # compile_ddp hands over DDPOptimizer.compile_fn

        def recording_backend(gm, example_inputs, **kwargs):
            compiled = backend(gm, example_inputs, **kwargs)  # a dynamo restart raises past the record
            found = graph_break_frame(gm)
            self.graphs.append(dict(
                break_reason=found[0] if found else None,
                break_at=f"{found[1].filename.rsplit('/', 1)[-1]}:{found[1].lineno}" if found else None,
                partitions=len(splitter.last_plan),
                param_ids=[i for b in splitter.last_plan for i in b.param_ids],
                statuses=[r.status for r in splitter.records],  # every graph's latest compile
                errors=[r.error for r in splitter.records if r.error],
            ))
            return compiled

        return recording_backend


def train_pair(rank: int, arch: Arch, variant: str) -> dict[str, Any]:
    """compile_ddp(DDP(model)) against eager DDP(copy): ``STEPS`` AdamW steps each."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    torch.manual_seed(0)
    model = arch.build()
    ref_model = copy.deepcopy(model)
    ddp, ref = DDP(model, bucket_cap_mb=BUCKET_CAP_MB), DDP(ref_model, bucket_cap_mb=BUCKET_CAP_MB)
    recorder = GraphRecorder()
    warned = _Warnings()
    logging.getLogger("ddp_opt.alignment.realign").addHandler(warned)
    compiled = compile_ddp(ddp, backend="aot_eager", wrap_backend=recorder.wrap)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses, graphs_after_step = [], []
    for step in range(STEPS):
        inputs = batch(arch.kind, rank, step)
        loss, ref_loss = loss_of(compiled, arch.kind, inputs, variant), loss_of(ref, arch.kind, inputs, variant)
        loss.backward(), ref_loss.backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        losses.append((loss.item(), ref_loss.item()))
        graphs_after_step.append(len(recorder.graphs))
    logging.getLogger("ddp_opt.alignment.realign").removeHandler(warned)
    pairs = [(name, p, q) for (name, p), q in zip(model.named_parameters(), ref_model.parameters())]
    param_diffs = {name: (p - q).abs().max().item() for name, p, q in pairs}
    worst = max(param_diffs, key=param_diffs.get)
    beyond = [name for name, p, q in pairs if not torch.allclose(p, q, rtol=RTOL, atol=ATOL)]
    names = {id(p): name for name, p, _ in pairs}
    for graph in recorder.graphs:
        graph["params"] = [names.get(i, "?") for i in graph.pop("param_ids")]
    in_graphs = {name for graph in recorder.graphs for name in graph["params"]}
    alignment = measure_alignment(ddp, compiled.buckets)
    splitter = compiled.splitter
    return dict(
        losses=losses, max_loss_diff=max(abs(a - b) for a, b in losses),
        max_param_diff=param_diffs[worst], worst_param=worst, params_beyond_tolerance=beyond,
        params_outside_graphs=[name for name in param_diffs if name not in in_graphs],
        graphs=recorder.graphs, graphs_after_step=graphs_after_step,
        plans=[len(p) for p in splitter.plans], compiles=splitter.compiles,
        partitions=len(compiled.buckets), runtime_buckets=len(runtime_buckets(ddp)),
        # A graph without parameters (a loss after a graph break) is one partition with no gradient:
        # DDP has no bucket for it.
        partitions_with_params=sum(1 for b in compiled.buckets if b.param_ids),
        alignment=alignment.fraction if alignment is not None else None,
        realigned=compiled.aligned_caps is not None,
        break_reasons=dict(counters["graph_break"]), realign_warnings=warned.messages,
    )


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def zoo_rank(rank: int, world_size: int, names: list[str], variants: tuple[str, ...] = VARIANTS) -> dict:
    """Every (architecture, variant) on this rank; a failure is kept as its traceback,
    so that one architecture does not hide the others."""
    torch.set_num_threads(1)
    results = {}
    for name in names:
        for variant in variants:
            try:
                results[name, variant] = train_pair(rank, ARCHS[name], variant)
            except Exception:  # noqa: BLE001 - reported by the test of that architecture
                results[name, variant] = dict(error=traceback.format_exc())
            torch.distributed.barrier()
    torch._dynamo.reset()
    return results
