"""Pipeline parallelism (``--pipeline-parallel-size``) on ``torch.distributed.pipelining``: the layers cut into
stages, each rank the stages of its place on the ``pp`` axis, a schedule running the micro-batches through them.

How a rank holds its stages: the family's model is built whole on the meta device, then pruned in place to the
layers of this rank's stages (the others' entries of ``model.layers`` become empty slots, the embeddings stay on the
rank of the first stage, the final norm and the output layer on the rank of the last), so every parameter keeps its
one-process name (``layers.5.mlp.up_proj.weight``) and ``init_weights`` (seeded per name) gives it the one-process
value; the rest of the parallelize sequence (TP, activation checkpointing, compile, FSDP2 over the stage's data
ranks) then wraps what is left. A stage is a thin module over that model (:class:`StageModule`): its forward calls
the model (so FSDP2's hooks on the model run) with the stage's layers.

Inside a stage: tensor parallelism splits the modules the stage holds by the family's plan (the embeddings, final
norm and head of another stage are absent and skipped), the last stage's head vocabulary-parallel and its loss taken
under ``loss_parallel``; under sequence parallelism the stages send each other a tp rank's T/M positions of the hidden
states (torchtitan's choice: no gather at a stage boundary), the batch padded here to a multiple of the tp size.
Context parallelism: the trainer cuts each sample into this cp rank's chunks before the schedule, and every stage
rotates their positions and gathers the keys through the sample's ``ContextShard`` (``Pipeline._context``).
Packed documents (``--document-attention-mask``, ``--reset-position-ids``): the batch's ``document_ids`` and
``positions`` go to the schedule as keyword inputs, which torch cuts into the micro-batches as it cuts the tokens and
hands to every stage (each pp rank reads its data rank's batch), so each stage's blocks mask and rotate as one
process's; under context parallelism a micro-batch's rows of the shard's documents (``ContextShard.with_documents``).

Schedules and the stages a rank holds (``SCHEDULES``): ``gpipe`` and ``1f1b`` one stage per rank;
``interleaved_1f1b`` and ``zero_bubble`` (torch's interleaved zero-bubble) two, rank r holding stages r and r + P
(loop); ``dualpipev`` two, rank r holding r and 2P - 1 - r (V: the first and the last stage on rank 0).

The loss: the schedule calls the criterion's summed loss on each micro-batch of the last stage and back-propagates
it unscaled (``scale_grads=False``); the trainer then divides the gradients once by the update's token count across
micro-batches, ``--update-freq`` and the data ranks, as one process does, and takes the logged sums from the last
stage (:meth:`Pipeline.from_last_stage`). The gradient norm adds the stages' squares (:meth:`Pipeline.global_norm`).
Under fp16 the schedule back-propagates each micro-batch's loss times the loss scale (:meth:`Pipeline._loss`; the
routers' terms too), as one process scales its loss, and the overflow is that norm's being non-finite: every stage
and data rank sees the same norm, skips the same update and halves its scale with the others.

The MoE routers' auxiliary losses (:class:`RouterTerms`): each stage takes its layers' terms after its forward of a
micro-batch and back-propagates them with that micro-batch (an identity on the stage's output whose backward also
gives the terms gradient 1, Megatron's ``MoEAuxLossAutoScaler``), weighted as one process weighs a sample's: a term
is a mean over the whole model's MoE layers times the sample size, so a stage's part is its layers' share of the
mean times the micro-batch's share of the sample size. The logged terms are summed over the micro-batches, the
data ranks and the stages (:meth:`Pipeline.from_every_stage`). The statistics are a micro-batch's: the z-loss and
the sequence-wise balance loss (means over tokens or sequences) equal one process's, the load-balance loss and the
loads of ``moe_max_load_*`` (products and maxima of counts) are those of the micro-batches; the tokens per expert
that move the aux-loss-free bias are summed over the micro-batches and the stage's ranks (``MoE.count_group``), as
one process counts them.

Multi-token prediction (``--mtp-depth``, :class:`PredictionTerms`): the depths sit on the last stage, which reads
the decoder's final-normed hidden states there, and keep a copy of the token embedding (the embedding group of
Megatron and DeepSeek-V3); the head is the last stage's own. Each micro-batch's targets reach it as a keyword of the
schedule's step, the depths' loss is back-propagated with its micro-batch as the routers' terms are, divided by the
whole sample's labels so the micro-batches add up to one process's mean, and logged as ``mtp_loss``. The two copies'
gradients are summed between the first and the last stage's ranks before the update
(:meth:`Pipeline.sum_shared_gradients`), so both step as one parameter; the gradient norm counts the first stage's
copy only, and a checkpoint holds the one copy under its one-process name (the stages' states merge by name). Under
tensor parallelism the last stage's copy is split by vocabulary rows as the first stage's (the plan splits whatever a
stage holds), and the embedding group pairs the ranks of the same tp coordinate, so each sum is of the same rows. Under
context parallelism the keyword carries the micro-batch's whole target rows (the shard's), which the depths read
at this cp rank's columns, as one process's cp ranks do.
"""

from __future__ import annotations

import copy
import functools
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from toolkit.core.errors import UserError
from toolkit.core.protocols import PARAMETER_ROLES
from toolkit.distributed.tensor_parallel import loss_context
from toolkit.models.common.moe import MoE

# name: (torch's class, virtual stages per rank, placement of a rank's stages)
SCHEDULES: Dict[str, Tuple[str, int, str]] = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> the summed loss


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: its index among all ``P x V`` stages and the model's layers it runs."""

    index: int
    layers: Tuple[int, ...]
    first: bool
    last: bool


def virtual_stages(schedule: str) -> int:
    return SCHEDULES[schedule][1]


def default_microbatches(pp: int, schedule: str) -> int:
    """``pp x`` the virtual stages per rank: the fewest micro-batches that give every stage work at once."""
    return pp * virtual_stages(schedule)


def layer_counts(
    layers: int, stages: int, balance: Optional[str], costs: Optional[Sequence[float]] = None
) -> List[int]:
    """Layers per stage: ``--pipeline-balance`` (fairseq's list, one count per stage); else, given each layer's
    ``costs`` (:func:`layer_costs`), the contiguous split whose costliest stage costs least; else an even split whose
    remainder goes to the first stages. A one-line UserError when they do not add up or leave a stage empty."""
    if balance is None or not str(balance).strip():
        if layers < stages:
            raise UserError(
                f"--pipeline-parallel-size: {stages} stages need at least {stages} layers and the model has {layers}; "
                f"lower --pipeline-parallel-size (or use a schedule with one stage per rank)"
            )
        if costs is not None:
            return balanced_counts(costs, stages)
        return [layers // stages + (1 if i < layers % stages else 0) for i in range(stages)]
    try:
        counts = [int(x) for x in str(balance).strip().strip("[]()").split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--pipeline-balance {balance}: give layer counts separated by commas, e.g. '[2,2]'") from None
    if len(counts) != stages or sum(counts) != layers or min(counts) < 1:
        raise UserError(
            f"--pipeline-balance {balance}: needs {stages} counts (one per stage) of at least 1 adding up to the "
            f"model's {layers} layers"
        )
    return counts


def layer_costs(named_numels: Sequence[Tuple[str, int]], layers: int) -> List[float]:
    """Each layer's cost for the default split: the values of its parameters (what its stage keeps, updates and,
    for a block's matmuls, multiplies with), the embeddings' added to the first layer's and the final norm's and
    the output layer's to the last one's (their stages hold them). The planner prices the same split with it."""
    costs = [0.0] * layers
    for name, numel in named_numels:
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
            costs[int(parts[1])] += numel
        else:
            costs[0 if "embed" in name else layers - 1] += numel
    return costs


def balanced_counts(costs: Sequence[float], stages: int) -> List[int]:
    """The contiguous split of ``costs`` into ``stages`` non-empty runs whose largest sum is smallest (the least
    limit at which filling the stages in turn places every layer, by bisection), each stage filled toward an even
    share of what is left, so the slack of that limit is spread over the stages instead of left to the last."""

    def fill(limit: float, even: bool) -> Optional[List[int]]:
        counts, i, left = [], 0, float(sum(costs))
        for stage in range(stages):
            start, total, share = i, 0.0, left / (stages - stage)
            while i < len(costs) - (stages - stage - 1) and (i == start or total + costs[i] <= limit):
                if even and i > start and abs(total + costs[i] - share) > abs(total - share):
                    break
                total += costs[i]
                i += 1
            counts.append(i - start)
            left -= total
        return counts if i == len(costs) else None

    low, high = max(costs), float(sum(costs))
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (low, mid) if fill(mid, False) is not None else (mid, high)
    return fill(high, True) or fill(high, False) or fill(float(sum(costs)), False)


def rank_stage_indices(pp_rank: int, pp: int, schedule: str) -> List[int]:
    """The stages rank ``pp_rank`` of the pp axis runs, in the order its schedule takes them."""
    _, per_rank, placement = SCHEDULES[schedule]
    if placement == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(per_rank)]


def stage_specs(
    layers: int, pp: int, pp_rank: int, schedule: str, balance: Optional[str], costs: Optional[Sequence[float]] = None
) -> List[StageSpec]:
    """This rank's stages and their layers (``costs``: each layer's, for the default split)."""
    stages = pp * virtual_stages(schedule)
    counts = layer_counts(layers, stages, balance, costs)
    starts = [sum(counts[:i]) for i in range(stages)]
    return [
        StageSpec(i, tuple(range(starts[i], starts[i] + counts[i])), i == 0, i == stages - 1)
        for i in rank_stage_indices(pp_rank, pp, schedule)
    ]


def check_pipelinable(model: nn.Module) -> None:
    """A pipeline cuts the stack of blocks of the rotary decoder families that declare it (their forward is composed
    here, stage by stage, their routers' terms taken by stage); the embeddings and the output layer must be separate
    weights (a tied pair lives on two stages)."""
    from toolkit.core.protocols import supports
    from toolkit.models.common.rotary_decoder import RotaryDecoderLM

    name = type(model).__name__
    if not isinstance(model, RotaryDecoderLM) or not supports(type(model), "supports_pipeline_parallel"):
        raise UserError(
            f"--pipeline-parallel-size: {name} does not declare a forward the pipeline can cut into stages (the "
            "Llama family and the MoE ones, DeepSeek-V3, gpt-oss, GLM-4.5 and Qwen3-Next do); train it without "
            "--pipeline-parallel-size"
        )
    if model.output_projection is None:
        raise UserError(
            "--pipeline-parallel-size: the model ties its output layer to the token embeddings, which would live on "
            "the first and the last stage at once; use an untied --arch or --no-share-decoder-input-output-embed"
        )


def prune_to_stages(model: nn.Module, specs: Sequence[StageSpec], pp: int, sequence_shards: int = 1) -> None:
    """Keep on ``model`` (on the meta device) only what ``specs`` run; its forward becomes a stage's
    (``model(x, spec)``; ``sequence_shards``: the tp ranks the hidden states between stages are cut over). The FLOPs it reports stay the whole model's, divided over the ``pp`` ranks; its plan (FSDP2's
    units) and its names and shapes (``whole_model_shapes``, what a checkpoint is checked against) the whole model's."""
    whole_matmul = model.num_matmul_parameters()
    flops = type(model).flops_per_token
    plan = model.tensor_parallel_plan()  # it reads the first block, which another stage may hold
    model.whole_model_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}  # what a resume checks
    model.whole_router_layers = [m.name for m in model.modules() if isinstance(m, MoE)]  # what a term is a mean over
    model.whole_prediction_depths = len(getattr(model, "mtp", ()))  # --mtp-depth: on the last stage (PredictionTerms)
    model.tensor_parallel_plan = lambda: plan
    model.num_matmul_parameters = lambda: whole_matmul
    model.flops_per_token = lambda seq_len: flops(model, seq_len) // pp
    kept = {i for spec in specs for i in spec.layers}
    for i in range(len(model.layers)):
        if i not in kept:
            model.layers[i] = None
    last = any(spec.last for spec in specs)
    if not any(spec.first for spec in specs) and not (last and model.whole_prediction_depths):
        model.embed_tokens = None  # the last stage's depths read a copy (PredictionTerms)
    if not last:
        model.norm = None
        model.output_projection = None
        if model.whole_prediction_depths:
            model.mtp = nn.ModuleList()
    model.forward = functools.partial(_stage_forward, model, sequence_shards=sequence_shards)


def _stage_forward(
    model: nn.Module,
    x: torch.Tensor,
    spec: StageSpec,
    sequence_shards: int = 1,
    context_parallel: Any = None,
    document_ids: Optional[torch.Tensor] = None,
    positions: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One stage of the rotary decoder's forward (``RotaryDecoderLM.forward`` without cache):
    tokens in on the first stage, logits out of the last, the hidden states [B, T, C] between; under sequence
    parallelism (``sequence_shards`` tp ranks) this tp rank's [B, T/M, C] of them, as the blocks of one stage pass
    them on (torchtitan's stages send the same), so a later stage's blocks see every position's mask and rotary
    rows, T = M times what arrives. ``document_ids`` and ``positions`` [B, T]: the micro-batch's documents (the
    mask keeps attention inside each) and rotary positions, as one process's forward takes them. ``context_parallel``:
    this cp rank's chunks of the micro-batch's sequences (a ``ContextShard`` holding their documents), whose
    positions rotate and whose layout the attention gathers the keys through, instead of a mask."""
    from toolkit.models.common.attention import attention_mask
    from toolkit.models.common.options import head_dim, layer_windows

    if spec.first:
        x = model.embed(x)
    T = x.size(1) * (1 if spec.first else sequence_shards)
    windows = layer_windows(model.cfg)
    masks: Dict[Any, Any] = {}
    for i in spec.layers:
        window = windows[i]
        if window not in masks and context_parallel is None:
            masks[window] = attention_mask(document_ids, T, x.device, window=window, head_dim=head_dim(model.cfg))
        if context_parallel is None or positions is not None:
            cos, sin = model.rope_rows(window, 0, T, positions)
        else:
            cos, sin = (table[context_parallel.query_index] for table in model.rope_table(window))
        documents = document_ids if context_parallel is None else None  # under cp the shard holds them
        mask = model.layer_attention_input(i, masks.get(window), documents)  # the whole-model index's kind
        x = model.layers[i](x, cos, sin, attn_mask=mask, context_parallel=context_parallel)
    return model.output(x) if spec.last else x


class _AlsoBackward(torch.autograd.Function):
    """The stage's output as it is; its backward also gives ``term`` (a 0-dim loss of the stage) gradient 1, so the
    term is back-propagated with the micro-batch whose forward computed it (the schedule back-propagates only the
    last stage's loss and, into the other stages, their outputs' gradients)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
        ctx.term_dtype, ctx.term_device = term.dtype, term.device
        return output.clone()  # not a view: the zero-bubble schedules detach the stage's output in place

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=ctx.term_dtype, device=ctx.term_device)


class _StageTerms:
    """Terms a stage carries into its backward beside the criterion's loss (the routers', the prediction depths'):
    ``weight`` what one process weighs them by, ``loss_scale`` fp16's (their gradients scaled as the criterion's
    loss is, :meth:`Pipeline._loss`), ``logged`` the update's sums as one process logs them (tensors: no sync per
    micro-batch)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.weight = 0.0
        self.loss_scale = 1.0
        self.logged: Dict[str, Any] = {}

    def take(self) -> Dict[str, float]:
        """The update's logged sums so far (one sync), then none."""
        logged, self.logged = {k: float(v) for k, v in self.logged.items()}, {}
        return logged


class RouterTerms(_StageTerms):
    """The MoE routers' auxiliary losses and metrics of this rank's stages (module docstring): ``weight`` is the
    running micro-batch's share of its sample's size, ``logged`` the update's sums of the terms as one process logs
    them (``value x sample size``), keyed by the whole model's names (``moe_max_load_<i>``: i among all its MoE
    layers)."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.whole_layers: List[str] = list(model.whole_router_layers)

    def attach(self, output: torch.Tensor, stage_layers: Sequence[MoE]) -> torch.Tensor:
        """``output`` of a stage whose MoE layers are ``stage_layers``, carrying their terms into its backward."""
        if not self.model.training or not any(m.aux for m in stage_layers):
            return output
        for m in self.model.modules():  # another stage's terms, left by a recomputed forward, are not this stage's
            if isinstance(m, MoE) and all(m is not own for own in stage_layers):
                m.aux, m.load = {}, {}
        ran = [m for m in self.model.modules() if isinstance(m, MoE) and m.aux]
        aux, metrics = self.model.router_terms()
        share = self.weight * len(ran) / len(self.whole_layers)  # of a mean over the whole model's layers
        term = None
        for name, (value, coefficient) in aux.items():
            part = value.float() * share
            self._add(name, part)
            term = coefficient * part if term is None else term + coefficient * part
        for name, value in metrics.items():
            self._add(self._whole_name(name, ran), value * self.weight)
        return output if term is None else _AlsoBackward.apply(output, term * self.loss_scale)

    def _whole_name(self, name: str, ran: Sequence[MoE]) -> str:
        """A per-layer metric's name (``<name>_<i>``, i among the layers that ran) with i among the whole model's."""
        match = re.fullmatch(r"(.*_)(\d+)", name)
        if match is None or int(match.group(2)) >= len(ran):
            return name
        return match.group(1) + str(self.whole_layers.index(ran[int(match.group(2))].name))

    def _add(self, name: str, value: Any) -> None:
        value = value.detach().double() if isinstance(value, torch.Tensor) else float(value)
        self.logged[name] = self.logged[name] + value if name in self.logged else value


class PredictionTerms(_StageTerms):
    """The multi-token prediction loss (``--mtp-depth``) of the last stage, which holds the depths and a copy of the
    token embedding they read (the first stage's; :meth:`Pipeline.sum_shared_gradients` sums the two copies'
    gradients before the step). Each micro-batch's targets reach the last stage as a keyword of the schedule's step
    (torch hands a step's keywords, cut into micro-batches, to every stage of the rank); each depth's cross-entropy
    is divided by the whole sample's count of its labels (``counts``), so the micro-batches' terms add up to one
    process's mean over the sample, which weighs it by the sample size (``weight``), logged as ``mtp_loss`` and
    back-propagated with its micro-batch as the routers' terms are."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.counts: Optional[torch.Tensor] = None

    def begin(self, target: torch.Tensor, pad: int, sample_size: float) -> None:
        """The sample about to run (``target``: its whole rows, under context parallelism too): its labels per depth
        and its size."""
        from toolkit.models.common.mtp import label_counts

        self.counts = label_counts(target, self.model.whole_prediction_depths, pad)
        self.weight = float(sample_size)

    def run(self, forward: Callable[[], torch.Tensor], target: torch.Tensor, inputs: Dict[str, Any]) -> torch.Tensor:
        """The last stage's ``forward()`` with the depths run on the micro-batch's ``target`` (its whole rows) and
        the stage's ``inputs`` (its documents, positions and ``ContextShard``, whose columns the depths read under
        context parallelism), their loss carried into its backward."""
        model, shard, positions = self.model, inputs.get("context_parallel"), inputs.get("positions")
        if shard is not None:  # the micro-batch's rows of the tokens ahead, this rank's positions (as shard_sample)
            shard = copy.copy(shard)
            shard.target = target
            positions = shard.query_index.expand(target.size(0), -1) if positions is None else positions
        model._mtp_inputs = dict(target=target, document_ids=inputs.get("document_ids"), positions=positions)
        model._mtp_inputs.update(context_parallel=shard, counts=self.counts)
        try:
            output = forward()
            loss = model._mtp_loss
        finally:
            model._mtp_inputs, model._mtp_loss = None, None
        part = loss.float() * self.weight
        logged = part.detach().double()
        self.logged["mtp_loss"] = self.logged["mtp_loss"] + logged if "mtp_loss" in self.logged else logged
        return _AlsoBackward.apply(output, model.cfg.mtp_loss_coef * part * self.loss_scale)


class StageModule(nn.Module):
    """What ``PipelineStage`` runs: the rank's model called with one stage's layers (their routers' terms carried
    into its backward by ``router``). The stage's modules are registered here too (``parameters()`` are the
    stage's: the zero-bubble schedules' weight gradients), the model itself is not (its other stage's parameters
    are not this stage's)."""

    def __init__(
        self,
        model: nn.Module,
        spec: StageSpec,
        context: Dict[str, Any],
        router: Optional[RouterTerms] = None,
        prediction: Optional[PredictionTerms] = None,
    ):
        super().__init__()
        object.__setattr__(self, "rank_model", model)
        object.__setattr__(self, "router", router)
        object.__setattr__(self, "prediction", prediction if spec.last else None)
        self.spec = spec
        self.context = context  # the batch's inputs every stage reads beside the activations (Pipeline._run)
        parts = [model.layers[i] for i in spec.layers]
        if spec.first:
            parts.insert(0, model.embed_tokens)
        if spec.last:
            parts += [model.norm, model.output_projection]
        if self.prediction is not None:  # the depths and the embedding they read
            parts += [model.mtp] + ([] if spec.first else [model.embed_tokens])
        self.parts = nn.ModuleList(parts)
        self.router_layers = [m for m in self.parts.modules() if isinstance(m, MoE)]
        self.inferring = False

    def forward(
        self, x: torch.Tensor, prediction_target: Optional[torch.Tensor] = None, **documents: torch.Tensor
    ) -> torch.Tensor:
        """``documents``: the micro-batch's rows of the batch's ``document_ids`` and ``positions`` (the schedule
        cuts them as it cuts the tokens and hands them to every stage); under context parallelism the documents
        of the whole rows, which the attention reads through this micro-batch's shard. ``prediction_target``: the
        micro-batch's targets, which the last stage's depths read in training."""
        shard = self.context["context_parallel"]
        for m in self.router_layers:  # as the family's forward: the statistics over every cp rank's tokens
            m.context_group = None if shard is None else shard.group
        inputs = dict(self.context, **documents)
        if shard is not None and "document_ids" in documents:
            inputs["context_parallel"] = shard.with_documents(inputs.pop("document_ids"))
        if self.inferring:  # torch's shape inference (tensors of the right shapes): routed, but nothing counted
            counts = [m.tokens_per_expert.clone() for m in self.router_layers]
            out = self.rank_model(x, self.spec, **inputs)
            for m, kept in zip(self.router_layers, counts):
                m.tokens_per_expert.copy_(kept)
                m.aux, m.load = {}, {}
            return out
        forward = functools.partial(self.rank_model, x, self.spec, **inputs)
        predicts = self.prediction is not None and prediction_target is not None and self.rank_model.training
        out = self.prediction.run(forward, prediction_target, inputs) if predicts else forward()
        return out if self.router is None else self.router.attach(out, self.router_layers)


@functools.cache
def _stage_class() -> type:
    """``PipelineStage`` whose shape inference (a forward of the first micro-batch, or of empty tensors on the other
    stages, before the schedule's own) is marked on its ``StageModule`` (``inferring``), so that forward moves no
    router statistics."""
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            self.submod.inferring = True
            try:
                return super()._forward_metadata_inference(*args, **kwargs)
            finally:
                self.submod.inferring = False

    return Stage


@functools.cache
def _forward_only_class(name: str) -> type:
    """torch's schedule ``name`` cut to its forward actions (those inside its overlapped forward-backward actions
    too) and their sends and receives: its V-placed schedules run the backward actions of two stages on one rank in
    ``eval`` as well, which a forward without autograd cannot."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining import schedules

    class ForwardOnly(getattr(pipelining, name)):
        def _prepare_schedule_with_comms(self, *args: Any, **kwargs: Any) -> None:
            super()._prepare_schedule_with_comms(*args, **kwargs)
            backward = ("FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "SEND_B", "RECV_B", "REDUCE_GRAD")
            dropped = {getattr(schedules, kind) for kind in backward}
            self.pipeline_order_with_comms = {
                rank: [
                    sub
                    for action in ops
                    for sub in (action.sub_actions or (action,))
                    if sub.computation_type not in dropped
                ]
                for rank, ops in self.pipeline_order_with_comms.items()
            }

    return ForwardOnly


class Pipeline:
    """This rank's stages and the schedule that runs a batch through them (one per batch shape: torch's stages
    size their receive buffers on the first batch they run)."""

    def __init__(self, model: nn.Module, specs: Sequence[StageSpec], dims: Any, schedule: str, microbatches: int):
        self.model, self.specs, self.dims = model, list(specs), dims
        self.schedule_name = schedule
        self.pp = dims.shape.pp
        self.microbatches = microbatches or default_microbatches(self.pp, schedule)
        self.group = dims.group("pp")
        self.is_first = any(spec.first for spec in specs)
        self.is_last = any(spec.last for spec in specs)
        self._schedules: Dict[Tuple[Tuple[int, ...], bool], Any] = {}
        self._loss_fn: Optional[LossFn] = None
        self._loss_scale = 1.0  # fp16's dynamic loss scale of the batch being trained (Pipeline.step)
        self._context: Dict[str, Any] = {"context_parallel": None}  # the batch's, for every stage (StageModule)
        self.router = router_terms(model, dims)
        self.prediction = PredictionTerms(model) if self.is_last and model.whole_prediction_depths else None
        self.embedding_group = embedding_group(model, dims, schedule)

    def _schedule(self, shape: Tuple[int, ...], device: torch.device, train: bool = True) -> Any:
        """The schedule of a batch shape; for validation under a V placement, its forward actions only
        (:func:`_forward_only_class`)."""
        name = SCHEDULES[self.schedule_name][0]
        forward_only = not train and SCHEDULES[self.schedule_name][2] == "v"
        if (shape, forward_only) in self._schedules:
            return self._schedules[shape, forward_only]
        from torch.distributed import pipelining

        stages = [
            _stage_class()(
                StageModule(self.model, spec, self._context, self.router, self.prediction),
                spec.index,
                self.pp * len(self.specs),
                device,
                group=self.group,
            )
            for spec in self.specs
        ]
        first = stages[0] if len(stages) == 1 else stages
        cls = _forward_only_class(name) if forward_only else getattr(pipelining, name)
        schedule = cls(first, n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False)
        self._schedules[shape, forward_only] = schedule
        return schedule

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one micro-batch: the caller's (its summed loss), set for the batch being run, times
        fp16's loss scale (the schedule back-propagates what this returns, as one process back-propagates the scaled
        loss; :meth:`_run` divides the logged sum by it again)."""
        loss = self._loss_fn(output, target)
        return loss if self._loss_scale == 1.0 else loss * self._loss_scale

    def step(
        self,
        tokens: torch.Tensor,
        target: torch.Tensor,
        loss_fn: LossFn,
        pad: int,
        context_parallel: Any = None,
        sample_size: float = 0.0,
        loss_scale: float = 1.0,
        **documents: torch.Tensor,
    ) -> Optional[torch.Tensor]:
        """Forward and backward of one batch (``pad``: the padding index; ``context_parallel``: the ContextShard of
        this cp rank's columns, which ``tokens`` and ``target`` are; ``sample_size``: what one process weighs its
        routers' terms by; ``loss_scale``: fp16's, each micro-batch's loss multiplied by it before its backward;
        ``documents``: the batch's ``document_ids`` and ``positions``, which every pp rank reads with its tokens)
        through the schedule; the summed loss (unscaled) on the last stage, else None."""
        self._loss_scale = float(loss_scale)
        if self.router is not None:
            self.router.weight = float(sample_size) / self.microbatches  # the micro-batches are equal (_padded)
            self.router.loss_scale = self._loss_scale
        if self.prediction is not None:
            self.prediction.begin(target if context_parallel is None else context_parallel.target, pad, sample_size)
            self.prediction.loss_scale = self._loss_scale
        return self._run(tokens, target, loss_fn, True, pad, context_parallel, documents)

    def router_logged(self) -> Dict[str, float]:
        """This rank's stages' logged router terms of the batches run since the last call (none without MoE)."""
        return {} if self.router is None else self.router.take()

    def prediction_logged(self) -> Dict[str, float]:
        """The last stage's logged ``mtp_loss`` of the batches run since the last call (none elsewhere, or without
        --mtp-depth)."""
        return {} if self.prediction is None else self.prediction.take()

    def _embedding_copy(self) -> List[nn.Parameter]:
        """The token embedding's parameters where this rank holds them and another rank holds them too (the first
        and the last stage on two ranks, under --mtp-depth)."""
        return [] if self.embedding_group is None else list(self.model.embed_tokens.parameters())

    def sum_shared_gradients(self) -> None:
        """The token embedding's gradients summed between the first stage's copy and the last stage's (Megatron's
        embedding group), before the update: both copies step as one process's one parameter."""
        for p in self._embedding_copy():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(grad, group=self.embedding_group)

    @torch.no_grad()
    def evaluate(
        self, tokens, target, loss_fn: LossFn, pad: int, context_parallel: Any = None, **documents: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """Forward only (validation, the arguments as :meth:`step`'s): the summed loss on the last stage, else
        None."""
        self._loss_scale = 1.0
        return self._run(tokens, target, loss_fn, False, pad, context_parallel, documents)

    def _padded(self, tokens: torch.Tensor, target: torch.Tensor, pad: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The batch padded (rows of padding, padding at the ends of the rows: targets the loss ignores, positions
        a causal attention reads after every real one) to the shape every data rank of the stage runs: the largest
        of theirs, its rows a multiple of the micro-batches and its length a multiple of the tp size (sequence
        parallelism cuts the positions into equal parts); under context parallelism the rows only (the columns are
        this cp rank's chunks of a layout made for their length). So the micro-batches are equal (torch's stages keep
        one receive buffer per micro-batch) and the data ranks build their schedules, whose first step runs the
        forward over FSDP2's collectives, at the same steps."""
        shape = torch.tensor(tokens.shape, dtype=torch.long, device=tokens.device)  # NCCL reduces device tensors
        if self.dims.data_world * self.dims.shape.cp > 1:
            from toolkit.distributed.parallel_dims import DP_AXES

            dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=self.dims.group(*DP_AXES))
        rows = -(-int(shape[0]) // self.microbatches) * self.microbatches
        length = -(-int(shape[1]) // self.dims.shape.tp) * self.dims.shape.tp
        if self._context["context_parallel"] is not None:
            length = tokens.size(1)
        grow = (0, length - tokens.size(1), 0, rows - tokens.size(0))
        if any(grow):
            tokens = torch.nn.functional.pad(tokens, grow, value=pad)
            target = torch.nn.functional.pad(target, grow, value=pad)
        return tokens, target

    def _run(
        self, tokens, target, loss_fn, train: bool, pad: int, context_parallel: Any, documents: Dict[str, Any]
    ) -> Optional[torch.Tensor]:
        self._context["context_parallel"] = context_parallel
        tokens, target = self._padded(tokens, target, pad)
        if context_parallel is not None and context_parallel.document_ids is not None:
            documents = dict(documents, document_ids=context_parallel.document_ids)  # the whole rows' (the shard's)
        documents = _padded_documents(documents, *tokens.shape, grow_columns=context_parallel is None)
        schedule = self._schedule(tuple(tokens.shape), tokens.device, train)
        self._loss_fn = loss_fn
        losses: List[torch.Tensor] = []
        args = (tokens,) if self.is_first else ()
        kwargs = dict(target=target if self.is_last else None, losses=losses if self.is_last else None, **documents)
        if train and self.prediction is not None:  # the depths' labels, cut into micro-batches as the target
            kwargs["prediction_target"] = _whole_rows(target, context_parallel, pad)
        with loss_context(self.dims.shape.tp > 1):  # the last stage's logits are vocabulary-sharded under tp
            if train:
                schedule.step(*args, return_outputs=False, **kwargs)
            else:
                schedule.eval(*args, **kwargs)
        if not self.is_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum() / self._loss_scale

    def global_norm(self, grads: Sequence[torch.Tensor], expert_grads: Any = None, params: Sequence = ()) -> float:
        """The L2 norm of the whole model's gradients: this rank's (over FSDP2's shards; with ``expert_grads``, the
        strategy's ``ExpertGradients``, each expert's over the ep ranks holding the stage's others) squared, summed
        over the stages."""
        from toolkit.optim.grad_norm import total_norm

        if params and not self.is_first:  # the embedding's copy on the last stage counts once, on the first's rank
            copies = {id(p) for p in self._embedding_copy()}
            kept = [i for i, p in enumerate(params) if id(p) not in copies]
            grads, params = [grads[i] for i in kept], [params[i] for i in kept]
        if expert_grads is not None:
            device = grads[0].device if grads else torch.device("cpu")
            square = torch.tensor([expert_grads.global_norm(list(params)) ** 2], dtype=torch.float64, device=device)
        else:
            square = total_norm(grads).double().square().reshape(1)
        dist.all_reduce(square, group=self.group)
        return math.sqrt(float(square))

    def from_every_stage(self, values: Dict[str, float]) -> Dict[str, float]:
        """Every stage's ``values`` summed, on every stage: the last stage's criterion terms (the only stage that
        has them) beside each stage's part of the routers' terms."""
        everyone: List[Optional[Dict[str, float]]] = [None] * self.pp
        dist.all_gather_object(everyone, values, group=self.group)
        total: Dict[str, float] = {}
        for each in everyone:
            for k, v in (each or {}).items():
                total[k] = total.get(k, 0.0) + v
        return total

    def from_last_stage(self, values: Dict[str, float]) -> Dict[str, float]:
        """The last stage's ``values`` on every stage (what rank 0 logs and every rank normalizes by)."""
        box = [values]
        source = dist.get_global_rank(self.group, self.pp - 1) if self.schedule_name != "dualpipev" else None
        if source is None:  # V placement: the last stage is on the pp axis's first rank
            source = dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(box, src=source, group=self.group)
        return box[0]


def _padded_documents(documents: Dict[str, torch.Tensor], rows: int, length: int, grow_columns: bool) -> Dict[str, Any]:
    """The batch's ``document_ids`` and ``positions`` padded as :meth:`Pipeline._padded` pads its tokens: rows of
    document 0 at position 0, and (``grow_columns``) at the ends of the rows the row's last document at position 0
    (as context parallelism pads its chunks: no real position reads a later one). Under context parallelism the
    document ids are the whole rows' and the positions this cp rank's columns: only the rows grow."""
    padded = {}
    for name, x in documents.items():
        if grow_columns and x.size(1) < length:
            fill = x[:, -1:] if name == "document_ids" else torch.zeros_like(x[:, -1:])
            x = torch.cat([x, fill.expand(-1, length - x.size(1))], dim=1)
        padded[name] = torch.nn.functional.pad(x, (0, 0, 0, rows - x.size(0)))
    return padded


def router_terms(model: nn.Module, dims: Any) -> Optional[RouterTerms]:
    """The routers' terms of a model with MoE layers (None without; ``model`` pruned to this rank's stages): their
    token counts summed over the stage's ranks only, which hold the same layers."""
    if not model.whole_router_layers:
        return None
    from toolkit.distributed.parallel_dims import CONTEXT_AXES

    stage = dims.group(*CONTEXT_AXES)  # on every rank at once (it may build a group)
    for m in model.modules():
        if isinstance(m, MoE):
            m.count_group = stage
    return RouterTerms(model)


def _whole_rows(target: torch.Tensor, context_parallel: Any, pad: int) -> torch.Tensor:
    """The batch's target rows the depths read: ``target`` (padded as the schedule runs it), or under context
    parallelism the shard's whole rows, given padding rows as many as ``target`` was."""
    if context_parallel is None:
        return target
    whole = context_parallel.target
    return torch.nn.functional.pad(whole, (0, 0, 0, target.size(0) - whole.size(0)), value=pad)


def embedding_group(model: nn.Module, dims: Any, schedule: str) -> Optional[Any]:
    """Under --mtp-depth, the group of this rank with the rank that holds the other copy of the token embedding
    (the first stage's and the last stage's ranks of each pp group; built on every rank at once); None on the ranks
    without a copy, without depths, or where one rank holds both stages (the V placement)."""
    pp = dims.shape.pp
    if not model.whole_prediction_depths or SCHEDULES[schedule][2] == "v":
        return None
    if pp == 2:
        return dims.group("pp")
    stage_world = dims.shape.stage_world  # pp is the outermost axis: rank = pp rank x stage_world + the rest
    pairs = [[rank, (pp - 1) * stage_world + rank] for rank in range(stage_world)]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group if dims.shape.coordinates(dims.rank)["pp"] in (0, pp - 1) else None


def _in_model_order(pipeline: Pipeline, names: Sequence[str]) -> List[str]:
    """``names`` in the whole model's order (a rank of a schedule with several stages per rank holds layers that
    are not neighbours: rank 0 of interleaved_1f1b runs layers 0 and 2), so a merged state lists them as one
    process does."""
    order = {name: i for i, name in enumerate(pipeline.model.whole_model_shapes)}
    return sorted(names, key=lambda name: order.get(name, len(order)))


def _groups_in_model_order(pipeline: Pipeline, groups: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [dict(group, params=_in_model_order(pipeline, group["params"])) for group in groups]


def merge_stage_states(pipeline: Pipeline, state: Dict[str, Any]) -> Dict[str, Any]:
    """The stages' states (a model's ``{name: tensor}`` or an optimizer's ``{"state", "param_groups"}``, each
    keyed by one-process names) merged into one process's on the pp axis's first rank ({} elsewhere): the
    parameters in the whole model's order, each optimizer group's names joined."""
    states = [None] * pipeline.pp if dist.get_rank(pipeline.group) == 0 else None
    dist.gather_object(state, states, dst=dist.get_global_rank(pipeline.group, 0), group=pipeline.group)
    if states is None:
        return {}
    if "param_groups" not in state:
        merged = {k: v for each in states for k, v in each.items()}
        return {k: merged[k] for k in _in_model_order(pipeline, merged)}
    groups = _groups_in_model_order(pipeline, joined_groups([each["param_groups"] for each in states]))
    merged = {k: v for each in states for k, v in each["state"].items()}
    return {"state": {k: merged[k] for k in _in_model_order(pipeline, merged)}, "param_groups": groups}


def joined_groups(stages: Sequence[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """The stages' optimizer groups joined into one process's, each group's names in stage order. Groups tagged
    with the family's roles (``toolkit.optim.param_groups``: Muon, skipped decay) are matched by role, in one
    process's order of roles: a stage has the groups of the roles it holds (the first stage the embeddings', the
    last the head's); untagged ones by position."""
    joined: Dict[Any, Dict[str, Any]] = {}
    for groups in stages:
        for i, group in enumerate(groups):
            into = joined.setdefault(group.get("role", i), dict(group, params={}))
            into["params"].update(dict.fromkeys(group["params"]))  # in order, once (a dict: linear in the names)
    for group in joined.values():
        group["params"] = list(group["params"])
    rank = lambda key: PARAMETER_ROLES.index(key) if isinstance(key, str) else key  # noqa: E731
    return [joined[key] for key in sorted(joined, key=rank)]


def with_every_stage_groups(pipeline: Pipeline, state: Dict[str, Any]) -> Dict[str, Any]:
    """An optimizer's sharded state whose ``param_groups`` name every stage's parameters (the same on every rank:
    DCP writes one copy of them, and a consolidation or another layout reads the whole model's groups)."""
    every: List[Any] = [None] * pipeline.pp
    dist.all_gather_object(every, state["param_groups"], group=pipeline.group)
    return dict(state, param_groups=_groups_in_model_order(pipeline, joined_groups(every)))


def own_stage_state(model: nn.Module, state: Dict[str, Any]) -> Dict[str, Any]:
    """A one-process state (a model's or an optimizer's) cut to the parameters ``model`` (this rank's stages)
    holds."""
    names = {name.replace("_checkpoint_wrapped_module.", "") for name, _ in model.named_parameters()}
    if "param_groups" not in state:
        return {k: v for k, v in state.items() if k in names}
    groups = [dict(group, params=[n for n in group["params"] if n in names]) for group in state["param_groups"]]
    groups = [group for group in groups if group["params"]]  # the roles' groups the stage holds (joined_groups)
    return {"state": {k: v for k, v in state["state"].items() if k in names}, "param_groups": groups}


def build_pipeline(model: nn.Module, cfg: Any, dims: Any) -> List[StageSpec]:
    """Prune the meta-device ``model`` to this rank's stages (``cfg``: the DistributedConfig); their specs."""
    check_pipelinable(model)
    pp = dims.shape.pp
    pp_rank = dims.shape.coordinates(dims.rank)["pp"]
    layers = len(model.layers)
    costs = layer_costs([(name, p.numel()) for name, p in model.named_parameters()], layers)
    specs = stage_specs(layers, pp, pp_rank, cfg.pipeline_schedule, cfg.pipeline_balance, costs)
    sequence_parallel = dims.shape.tp > 1 and not cfg.no_sequence_parallel
    prune_to_stages(model, specs, pp, sequence_shards=dims.shape.tp if sequence_parallel else 1)
    return specs
