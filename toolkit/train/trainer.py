"""One update at a time: forward/backward over micro-batches, all-reduce, clip, step.

The trainer composes parts that live elsewhere (model, criterion, optimizer,
schedule, loss scaler, parallelism); it holds no model- or sharding-specific code.

The trainer runs the model (:func:`forward_and_loss`) and the criterion computes the loss from its outputs and
the sample's targets, so the loss is a function a pipeline schedule could call on the last stage's output;
fairseq's criterions, which run the model themselves, are left to do so.

Gradients are normalized the fairseq way: the criterion returns a *summed*
loss, and after all micro-batches the gradients are multiplied by
``world_size / total_sample_size`` (data-parallel reductions average over
ranks). So N ranks with ``--update-freq 1`` take the same step as one rank with
``--update-freq N`` over the same batches.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import platform
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from toolkit.train.amp_retries import AmpBatchRetries
from toolkit.checkpoint.identity import HASH_KEY
from toolkit.checkpoint.stateful import (
    DataPosition,
    Meters,
    ModelState,
    OptimizerState,
    StagedState,
    Value,
    stage_model_state,
    stage_optimizer_state,
)
from toolkit.compat.fairseq.plugins import calls_the_model
from toolkit.config import TrainConfig
from toolkit.core.protocols import PostStepHook
from toolkit.distributed import float8
from toolkit.distributed.offload_overlap import build_offload_overlap
from toolkit.distributed.parallel_dims import DP_AXES
from toolkit.distributed.pipeline import merge_stage_states, own_stage_state, with_every_stage_groups
from toolkit.distributed.strategies import ParallelStrategy
from toolkit.distributed.utils import DistributedEnv, all_reduce_sums
from toolkit.train.ema import EMA, EMAState
from toolkit.logging import metrics
from toolkit.models.common.attention.qk_clip import qk_clip_hook
from toolkit.models.document_mask import packing_inputs
from toolkit.optim import build_optimizer_from_section
from toolkit.optim import fp16 as fp16_utils
from toolkit.optim.grad_norm import normalize_and_clip
from toolkit.optim.loss_scaler import DynamicLossScaler
from toolkit.optim.param_groups import DecayChoice, log_decay_choice, parameter_groups, skips_decay
from toolkit.optim.lr_scheduler import build_lr_scheduler_from_section

logger = logging.getLogger("toolkit.trainer")  # the logger name log lines and filters already use


def move_to_device(sample: Dict[str, Any], device: torch.device) -> Dict[str, Any]:
    def move(x):
        if isinstance(x, torch.Tensor):
            return x.to(device, non_blocking=True)
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        return x

    return move(sample)


def forward_and_loss(
    model: torch.nn.Module, criterion, sample: Dict[str, Any], reduce: bool = True
) -> Tuple[torch.Tensor, int, Dict[str, Any]]:
    """One micro-batch's ``(loss, sample_size, logging_output)``: the model run on the inputs it takes (the
    tokens, the batch's packing inputs, what the criterion asks it to compute: ``model_requests``), then the
    criterion on its outputs and the sample (``toolkit.core.protocols.Criterion``).

    Training, validation and ``toolkit-validate`` compute their losses here. A fairseq criterion
    (``forward(model, sample, reduce)``, ``toolkit.compat.fairseq.plugins.criterion.calls_the_model``) runs the model
    itself."""
    if calls_the_model(criterion):
        return criterion(model, sample, reduce)
    net_input = sample["net_input"]
    inputs = dict(packing_inputs(net_input), **criterion.model_requests(model, sample, reduce))
    return criterion(model(net_input["src_tokens"], **inputs), sample, reduce)


def keep_freed_cpu_memory() -> bool:
    """glibc malloc: serve large blocks from the heap and keep freed memory instead of unmapping it.

    glibc hands blocks above its mmap threshold (at most 32 MiB) straight to mmap and unmaps
    them on free, so every training step's large tensors (logits and their gradients:
    B*T*V*4 bytes, 64 MiB at B=8, T=256, V=8192) come back as fresh pages that the kernel
    faults in and zeroes on first touch. That cost 10-20% of a CPU training step (the output
    projection's matmul ran at ~110 instead of ~180 GFLOP/s, zero-filling the loss gradient
    took 13 ms). With mmap off and heap trimming off the memory is reused step after step;
    the price is that the process keeps its peak heap (it is reused, not returned). Returns
    whether the settings were applied (glibc only; ``TOOLKIT_KEEP_CPU_MEMORY=0`` turns it off).
    """
    if os.environ.get("TOOLKIT_KEEP_CPU_MEMORY", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


class Trainer:
    """One update at a time; the owner of a run's state, which :meth:`statefuls` hands to the checkpoints.

    Its own ``state_dict``/``load_state_dict`` hold its counters, LR schedule and loss scale.
    """

    def __init__(
        self, cfg: TrainConfig, task, model: torch.nn.Module, criterion, env: DistributedEnv, strategy: ParallelStrategy
    ):
        self.cfg = cfg
        self.task, self.model, self.criterion = task, model, criterion
        self.env = env
        self.device = env.device
        self.strategy = strategy
        common = cfg.common
        self.compute_dtype = torch.float16 if common.fp16 else torch.bfloat16 if common.bf16 else torch.float32
        if env.is_master:
            flag = "memory-efficient-fp16" if common.memory_efficient_fp16 else "fp16" if common.fp16 else "bf16"
            fp16_utils.warn_if_slow_on_cpu(self.device, self.compute_dtype, flag)
        self.optimizer = build_optimizer_from_section(
            cfg.components.optimizer, cfg.optimizer, self._parameter_groups(), cfg.optimization.lr
        )
        # --memory-efficient-fp16 without sharding: fp16 weights (cast by parallelize), fp32 optimizer state
        # (see toolkit.optim.fp16); under FSDP2 the mixed-precision policy keeps only the sharded fp32 weights.
        memory_efficient = common.memory_efficient_fp16 and not strategy.handles_mixed_precision
        self.memory_efficient = fp16_utils.MemoryEfficientFP16(self.optimizer) if memory_efficient else None
        self.lr_scheduler = build_lr_scheduler_from_section(
            cfg.components.lr_scheduler, cfg.lr_scheduler, self.optimizer
        )
        # fairseq's default scale window counts the ranks; a pipeline's stages share each batch (fairseq ran its
        # pipeline in one process), so a pipelined run keeps one process's window
        ranks = env.world_size // strategy.dims.shape.pp
        self.scaler = (
            DynamicLossScaler.from_config(common, ranks, cfg.optimization.update_freq) if common.fp16 else None
        )
        self.amp_retries = AmpBatchRetries.from_config(common)
        self.num_updates = 0
        self.steps_taken = 0  # optimizer steps in this process: before the first, the weights are the starting ones
        self.ema = EMA(model, cfg.ema) if cfg.ema.store_ema else None  # --store-ema: saved, not trained on
        # --overlap-offload-step, else None; its norm adds the experts' squares over ep, the stages' over pp
        self.overlap = build_offload_overlap(cfg, model, self.optimizer, strategy.expert_grads, strategy.pipeline)
        self.post_step_hooks: List[Callable[[], None]] = []
        qk_clip = getattr(
            cfg.optimizer, "qk_clip_threshold", None
        )  # --optimizer muon's MuonClip, before float8's scales
        if qk_clip is not None:
            clip = qk_clip_hook(model, qk_clip)
            self.add_post_step_hook(lambda: metrics.log_scalar("qk_clipped_heads", clip(), priority=800, round=1))
        float8_scales = float8.after_optimizer_step(model, cfg.distributed.fp8_all_gather)  # --fp8-all-gather
        if float8_scales is not None:
            self.add_post_step_hook(float8_scales)
        for module in model.modules():
            if isinstance(module, PostStepHook):
                self.add_post_step_hook(module.after_optimizer_step)
        self.lr_scheduler.step_update(0)
        if self.device.type == "cpu" and keep_freed_cpu_memory():
            logger.info(
                "CPU training: glibc malloc keeps freed memory for reuse (TOOLKIT_KEEP_CPU_MEMORY=0 to disable)"
            )

    def _parameter_groups(self) -> List[Any]:
        """The trainable parameters, grouped by the family's roles where the optimizer or the weight decay asks."""
        decay = self._decay_choice()
        by_role = bool(getattr(type(self.cfg.optimizer), "wants_parameter_roles", False))
        if self.env.is_master:
            log_decay_choice(
                self.model, skips_decay(self.model, decay.no_decay, decay.decay_all), decay.no_decay, decay.weight_decay
            )
        return parameter_groups(
            self.model, by_role, decay.skips(self.model), f"--optimizer {self.cfg.components.optimizer}"
        )

    def _decay_choice(self) -> DecayChoice:
        """The weight-decay grouping flags (``DecayChoice``): the groups built here, the resume's check."""
        optimization = self.cfg.optimization
        return DecayChoice(
            optimization.no_decay_norms_biases_embeddings,
            optimization.decay_all_parameters,
            float(getattr(self.cfg.optimizer, "weight_decay", 0.0) or 0.0),
        )

    # --- contexts -------------------------------------------------------------------
    def _autocast(self):
        return self.strategy.autocast(self.device, self.compute_dtype)

    def _set_seed(self) -> None:
        # Seeding by update number makes dropout identical when a run resumes from a checkpoint.
        torch.manual_seed(self.cfg.common.seed + self.num_updates)

    # --- steps ----------------------------------------------------------------------
    def train_step(self, samples: List[Dict[str, Any]]) -> Optional[Dict[str, float]]:
        """One optimizer update over ``samples`` (this rank's micro-batches); None if skipped."""
        self._set_seed()
        self.model.train()
        metrics.log_start_time("train_wall", priority=800, round=0)
        totals = self._forward_backward(samples)
        sample_size = totals.pop("_sample_size")

        overflow = False
        scale = self.scaler.loss_scale if self.scaler else 1.0
        grad_factor = self.strategy.dims.loss_world / (max(sample_size, 1.0) * scale)
        grad_norm, grad_factor = self._grad_norm_for_step(grad_factor)  # factor: what the step still applies
        if self.scaler is not None:
            try:
                self.scaler.check_overflow(grad_norm)
            except OverflowError as e:
                overflow = True
                logger.info(f"NOTE: gradient overflow detected, ignoring gradient, {e}")
        elif not math.isfinite(grad_norm):
            raise FloatingPointError(
                f"non-finite gradient norm ({grad_norm}) at update {self.num_updates + 1}; "
                + self._non_finite_cause(self.steps_taken)
            )
        if overflow:
            self.optimizer.zero_grad(set_to_none=True)
            metrics.log_stop_time("train_wall")
            return self.amp_retries.after_overflow(lambda: self.train_step(samples))  # --amp-batch-retries
        steps_before = self.steps_taken  # the loss below was computed with these steps' weights
        self._step_optimizer(grad_factor)
        self.steps_taken += 1
        self._run_post_step_hooks()
        if self.scaler is not None:
            self.scaler.update()
        self.num_updates += 1
        if self.ema is not None:
            self.finish_pending_steps()
            self.ema.step(self.model, self.num_updates)
            metrics.log_scalar("ema_decay", self.ema.decay, weight=0, priority=10000, round=5)
        self.lr_scheduler.step_update(self.num_updates)
        if not math.isfinite(totals.get("loss", 0.0)):
            raise FloatingPointError(
                f"non-finite loss at update {self.num_updates}; {self._non_finite_cause(steps_before)}"
            )
        metrics.log_stop_time("train_wall")
        self._log_update(totals, sample_size, grad_norm)
        return totals

    @staticmethod
    def _non_finite_cause(steps_before: int) -> str:
        """What to change after a NaN computed with the weights of ``steps_before`` steps of this run: the
        learning rate only once a step has moved them; before that the starting weights, the model's options or
        the data gave it."""
        if steps_before == 0:
            return (
                "no step of this run had changed the weights yet, so not --lr: the starting weights "
                "(--finetune-from-model, --restore-file), the model's options (--rope-theta, --rms-norm-eps, ...) "
                "or the data give it"
            )
        return "lower --lr, add --clip-norm, or check the data"

    def _forward_backward(self, samples: List[Dict[str, Any]]) -> Dict[str, float]:
        """Every micro-batch's forward and backward; the logged sums over them and the data-parallel replicas."""
        if self.strategy.pipeline is not None:
            return self._pipelined_forward_backward(samples)
        totals: Dict[str, Any] = {}
        for i, sample in enumerate(samples):
            sample = self.strategy.shard_sample(move_to_device(sample, self.device), self.task.dictionary.pad())
            with self.strategy.loss_context():  # forward and backward of a vocabulary-sharded loss
                with (
                    self.strategy.grad_sync(self.model, enabled=i == len(samples) - 1),
                    self._autocast(),
                    self.strategy.forward_context(),
                ):
                    loss, sample_size, logging_output = forward_and_loss(self.model, self.criterion, sample)
                    if sample.get("is_dummy"):
                        loss = loss * 0.0
                        logging_output = {k: 0 for k in logging_output}
                        sample_size = 0
                scale = self.scaler.loss_scale if self.scaler else 1.0
                (loss * scale).backward()
            for k, v in logging_output.items():  # tensors (the loss) stay on the device: no sync here
                v = v.detach().double() if isinstance(v, torch.Tensor) else v
                totals[k] = totals[k] + v if k in totals else v
            totals["_sample_size"] = totals.get("_sample_size", 0.0) + float(sample_size)
        totals = {k: float(v) for k, v in totals.items()}  # one device sync per update
        dims = self.strategy.dims
        return all_reduce_sums(totals, self.device, dims.loss_world, group=dims.group(*DP_AXES))

    def _pipelined_forward_backward(self, samples: List[Dict[str, Any]]) -> Dict[str, float]:
        """``--pipeline-parallel-size``: each sample through the stages' schedule (its micro-batches), the summed
        losses on the last stage; the sums over the data ranks of each stage, then the last stage's on every rank
        (every stage normalizes its gradients by the same token count)."""
        totals: Dict[str, Any] = {}
        for i, sample in enumerate(samples):
            sample = self.strategy.shard_sample(move_to_device(sample, self.device), self.task.dictionary.pad())
            with self.strategy.grad_sync(self.model, enabled=i == len(samples) - 1), self._autocast():
                logging_output = self._pipeline_pass(sample, train=True)
            for k, v in logging_output.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        self.strategy.pipeline.sum_shared_gradients()  # --mtp-depth: the last stage's copy of the embedding
        dims = self.strategy.dims
        totals = all_reduce_sums(totals, self.device, dims.loss_world, group=dims.group(*DP_AXES))
        return self.strategy.pipeline.from_every_stage(totals)

    def _pipeline_pass(self, sample: Dict[str, Any], train: bool) -> Dict[str, Any]:
        """One sample through the pipeline: on the last stage the criterion's logging output of the summed loss
        (``_sample_size`` beside it); on every stage, training, its MoE layers' logged router terms."""
        pipeline = self.strategy.pipeline
        dummy = 0.0 if sample.get("is_dummy") else 1.0

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return self.criterion.compute_loss(logits, target) * dummy

        net_input, pad = sample["net_input"], self.task.dictionary.pad()
        inputs = (net_input["src_tokens"], sample["target"], loss_fn, pad, net_input.get("context_parallel"))
        documents = {key: net_input[key] for key in ("document_ids", "positions") if key in net_input}
        if train:  # the routers' terms weighed by the sample's size, as one process weighs them
            size = self.criterion.with_counts(torch.zeros(()), sample)[1]
            scale = self.scaler.loss_scale if self.scaler else 1.0  # fp16's, on each micro-batch's loss
            loss = pipeline.step(*inputs, sample_size=size, loss_scale=scale, **documents)
        else:
            loss = pipeline.evaluate(*inputs, **documents)
        router = {**pipeline.router_logged(), **pipeline.prediction_logged()}
        if loss is None:
            return router
        _, sample_size, logging_output = self.criterion.with_counts(loss, sample)
        return dict(logging_output, _sample_size=sample_size, **router)

    def _step_optimizer(self, grad_factor: float) -> None:
        """The update with the gradients times ``grad_factor`` (folded into the step where that is exact); grads dropped."""
        if self.memory_efficient is not None:
            self.memory_efficient.step(grad_factor)
        elif self.overlap is not None:
            self.overlap.launch_step(grad_factor)  # the worker drops each gradient after its update
            return
        elif grad_factor != 1.0:
            self.optimizer.step(grad_scale=grad_factor)  # only optimizers with supports_grad_scale get a factor
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def add_post_step_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` after every optimizer step, once the new weights are in place (in the order added):
        float8's scales for the next all-gather, a module's ``PostStepHook`` (a MoE router's bias)."""
        self.post_step_hooks.append(hook)

    def _run_post_step_hooks(self) -> None:
        if not self.post_step_hooks:
            return
        self.finish_pending_steps()  # --overlap-offload-step: the hooks read the updated weights
        for hook in self.post_step_hooks:
            hook()

    def finish_pending_steps(self) -> None:
        """Wait for an update still running beside the forward (--overlap-offload-step); no-op otherwise.

        Whatever reads weights or optimizer state outside ``train_step`` calls this first
        (validation, EMA, the trainer's state); model/optimizer ``state_dict`` wait by themselves.
        """
        if self.overlap is not None:
            self.overlap.finish()

    @torch.no_grad()
    def valid_step(self, sample: Dict[str, Any]) -> Dict[str, float]:
        self.finish_pending_steps()
        self.model.eval()
        sample = self.strategy.shard_sample(move_to_device(sample, self.device), self.task.dictionary.pad())
        if self.strategy.pipeline is not None:
            with self._autocast():
                out = self._pipeline_pass(sample, train=False)
            out = self.strategy.pipeline.from_last_stage({k: float(v) for k, v in out.items()})
            return {} if sample.get("is_dummy") else out
        with self._autocast(), self.strategy.loss_context():
            _, sample_size, logging_output = forward_and_loss(self.model, self.criterion, sample)
        if sample.get("is_dummy"):
            return {}
        out = {k: float(v) for k, v in logging_output.items()}
        out["_sample_size"] = float(sample_size)
        return out

    def _grad_norm_for_step(self, grad_factor: float) -> Tuple[float, float]:
        """(norm of the normalized gradients, the factor the step still applies: 1.0 once applied), clipped to
        ``--clip-norm`` by the one clipping path (``toolkit.optim.grad_norm.normalize_and_clip``).

        Where the norm comes from and who multiplies depends on the step: fp16 gradients of
        ``--memory-efficient-fp16`` stay scaled (norm in fp32, the factor applied in fp32 inside the step,
        a non-finite norm is the overflow); the offload overlap has summed most squares during backward;
        an optimizer with ``supports_grad_scale`` (cpu_adam) folds the factor into its update, exactly
        (torch's fused AdamW takes only a divisor, which rounds differently, so it gets the separate pass).
        """
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        raw_norm, measure = None, None
        if self.strategy.pipeline is not None:  # --pipeline-parallel-size: each rank holds other layers
            measure = functools.partial(self.strategy.pipeline.global_norm, grads, self.strategy.expert_grads, params)
        if self.overlap is not None and self.memory_efficient is None:  # expert and stage squares added there too
            raw_norm = self.overlap.raw_grad_norm()
        elif measure is not None:
            raw_norm = measure()
        elif self.strategy.expert_grads is not None:  # --expert-parallel-size: each rank holds other experts
            raw_norm = self.strategy.expert_grads.global_norm(params)
        elif self.memory_efficient is not None:
            raw_norm = float(fp16_utils.grad_norm_fp32(params))
        step_applies = (
            self.memory_efficient is not None
            or self.overlap is not None
            or getattr(self.optimizer, "supports_grad_scale", False)
        )
        return normalize_and_clip(
            grads,
            grad_factor,
            self.cfg.optimization.clip_norm,
            raw_norm=raw_norm,
            in_place=not step_applies,
            look_again=self.memory_efficient is None,
            measure=measure,
        )

    def _log_update(self, totals: Dict[str, float], sample_size: float, grad_norm: float) -> None:
        self.criterion.reduce_metrics([dict(totals, sample_size=sample_size)])
        metrics.log_standard_update_metrics(
            ntokens=totals.get("ntokens", 0),
            nsentences=totals.get("nsentences", 0),
            num_updates=self.num_updates,
            lr=self.get_lr(),
            grad_norm=grad_norm,
            clip_norm=self.cfg.optimization.clip_norm,
            loss_scale=self.scaler.loss_scale if self.scaler else None,
            device=self.device,
        )

    # --- state ----------------------------------------------------------------------
    def get_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def lr_step(self, epoch: int, val_loss: Optional[float] = None) -> float:
        self.lr_scheduler.step(epoch, val_loss)
        return self.lr_scheduler.step_update(self.num_updates)

    def statefuls(self, progress) -> Dict[str, Any]:
        """Everything a checkpoint holds, by its key in the file, in load order (tensors first).

        Why one mapping, built here: the trainer owns (or is handed, ``progress``: the loop's
        :class:`~toolkit.checkpoint.common.TrainingState`) every piece of run state, so it is the one
        place that lists them; the checkpoint formats save and load whatever the mapping holds
        (:mod:`toolkit.checkpoint.stateful`) and never reach into the trainer. A new piece of state (a
        second EMA) is one entry here. The keys are the files' (fairseq's ``extra_state`` names).
        """
        ckpt = self.cfg.checkpoint
        entries: Dict[str, Any] = {
            "model": ModelState(self.model),
            "optim": OptimizerState(
                self.model,
                self.optimizer,
                self.cfg.components.optimizer,
                save=not ckpt.no_save_optimizer_state,
                reset=ckpt.reset_optimizer,
                decay=self._decay_choice(),
            ),
            "train_iterator": DataPosition(progress, self.cfg.optimization.update_freq),
            "val_loss": Value(lambda: progress.val_loss),  # saved for fairseq's readers; a resume validates anew
            "best": Value(lambda: progress.best.best, lambda best: setattr(progress.best, "best", best)),
            "trainer": self,
            "metrics": Meters(reset=ckpt.reset_meters),
            HASH_KEY: Value(self.task.dictionary.symbols_hash),  # checked before anything loads
        }
        if self.ema is not None:
            entries["ema"] = EMAState(self.ema, self.model)  # fairseq's key (--store-ema)
        if self.strategy.pipeline is not None:
            self._stage_entries(entries)
        return entries

    def _stage_entries(self, entries: Dict[str, Any]) -> None:
        """``--pipeline-parallel-size``: the model and the optimizer saved whole from every stage, loaded by each
        stage keeping its own parameters (``toolkit.checkpoint.stateful.StagedState``)."""
        pipeline, model = self.strategy.pipeline, self.model
        merge = functools.partial(merge_stage_states, pipeline)
        own = functools.partial(own_stage_state, model)
        entries["model"] = StagedState(entries["model"], lambda: stage_model_state(model), merge, own)
        optimizer_state = lambda: stage_optimizer_state(model, self.optimizer)  # noqa: E731
        every_stage = functools.partial(with_every_stage_groups, pipeline)
        entries["optim"] = StagedState(entries["optim"], optimizer_state, merge, own, every_stage)
        if self.ema is not None:  # each stage averages its own layers; the file holds the whole model's average
            entries["ema"] = EMAState(self.ema, model, merge=merge)

    def state_dict(self) -> Dict[str, Any]:
        self.finish_pending_steps()
        return {
            "num_updates": self.num_updates,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "loss_scaler": self.scaler.state_dict() if self.scaler else None,
        }

    def load_state_dict(self, state: Dict[str, Any], reset_lr_scheduler: Optional[bool] = None) -> None:
        """``reset_lr_scheduler`` None: ``--reset-lr-scheduler``'s value."""
        if reset_lr_scheduler is None:
            reset_lr_scheduler = self.cfg.checkpoint.reset_lr_scheduler
        self.num_updates = int(state["num_updates"])
        if not reset_lr_scheduler and state.get("lr_scheduler"):
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.scaler is not None and state.get("loss_scaler"):
            self.scaler.load_state_dict(state["loss_scaler"])
        self.lr_scheduler.step_update(self.num_updates)
