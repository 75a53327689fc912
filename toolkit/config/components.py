"""The options of the built-in tasks, criterions, optimizers and LR schedulers.

They live here, apart from the code that uses them (which imports torch), so that the command line is built
without torch: ``toolkit-<command> --help`` and every argument error exit before torch is imported
(``core/registry.BUILTIN_COMPONENTS`` names each component's module and options class; the model families'
options are their ``config.py``). Each component module re-exports its class under the old name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional, Tuple

from toolkit.config import opt
from toolkit.config.flag_types import (
    count_or_zero,
    float_list,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)

BREAK_MODES = ("none", "complete", "complete_doc", "eos")
"""``--sample-break-mode``: how a token stream is cut into samples (``data/token_block_dataset.py``)."""
SHORTEN_METHODS = ("none", "truncate", "random_crop")
"""``--shorten-method`` (``data/shorten.py``)."""
MOMENTUM_DTYPES = ("fp32", "bf16")
"""``--muon-momentum-dtype``: the names of ``optim/muon.py``'s momentum dtypes."""
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")
"""``--decay-shape``: the names of ``optim/lr_scheduler/wsd.py``'s decay curves."""
ADAM_STATE_PRECISIONS = ("fp32", "bf16", "8bit")
"""``--adam-state-precision``: how ``optim/quantized_states.py`` keeps the Adam moments in host memory."""


# --task language_modeling (toolkit/tasks/language_modeling.py)


@dataclass
class LanguageModelingConfig:
    data: Optional[str] = field(
        default="",
        metadata={
            "help": "data-bin folder made by toolkit-preprocess; several folders separated by ':' are "
            "used round-robin, one per epoch (leave out with --data-mixture)",
            "positional": True,
        },
    )
    data_mixture: Optional[str] = field(
        default=None,
        metadata={
            "help": "train on a weighted mixture of data-bins with one dictionary, NAME=PATH:WEIGHT,... e.g. "
            "web=data-bin/web:0.7,code=data-bin/code:0.3; validation per source (valid_NAME) and "
            "the weighted total (valid)",
            "metavar": "SPEC",
        },
    )
    mixture_epoch_samples: int = field(
        default=0,
        metadata={
            "type": count_or_zero,
            "help": "samples in an epoch of --data-mixture (0: all sources' samples together)",
            "metavar": "N",
        },
    )
    sample_break_mode: str = field(
        default="none",
        metadata={
            "help": "'none': fill each sample with tokens-per-sample tokens; 'complete': split only at "
            "ends of lines, several lines per sample; 'complete_doc': as complete, never across "
            "documents (empty lines); 'eos': one line per sample",
            "choices": list(BREAK_MODES),
        },
    )
    tokens_per_sample: int = field(
        default=1024, metadata={"type": positive_int, "help": "max number of tokens per sample"}
    )
    add_bos_token: bool = field(
        default=False,
        metadata={
            "help": "prepend the beginning-of-sentence token <s> to every sample (with a Hugging Face tokenizer's "
            "vocabulary: read its BOS as the context a text starts from); default: the model's own convention "
            "when training from a checkpoint that records one (toolkit-export --from hf)",
            "negatable": True,
        },
    )
    shorten_method: str = field(
        default="none",
        metadata={
            "help": "if not none, shorten sequences that exceed --tokens-per-sample (truncate: keep the first "
            "tokens; random_crop: a seeded random window)",
            "choices": list(SHORTEN_METHODS),
        },
    )
    shorten_data_split_list: str = field(
        default="",
        metadata={
            "help": 'comma-separated list of dataset splits to apply shortening to, e.g., "train,valid" '
            "(default: all dataset splits)"
        },
    )
    document_attention_mask: bool = field(
        default=False,
        metadata={
            "help": "keep attention inside each document (line) of a packed sample (block-diagonal causal mask; "
            "flex_attention on CUDA, else an SDPA mask), e.g. with --sample-break-mode none"
        },
    )
    reset_position_ids: bool = field(
        default=False, metadata={"help": "with --document-attention-mask: positions restart at 0 in each document"}
    )
    seed: int = field(default=1, metadata={"help": "pseudo random number generator seed"})


# --task sft (toolkit/tasks/sft.py)

SFT_BREAK_MODES = ("complete", "eos")
"""``--sample-break-mode`` under ``--task sft``: whole conversations, several a sample or one each."""


@dataclass
class SFTConfig(LanguageModelingConfig):
    """Supervised fine-tuning on a chat data-bin (``toolkit-preprocess --chat-template``): the loss over the
    tokens its loss mask marks, conversations packed whole, each one attending and counting positions alone."""

    sample_break_mode: str = field(
        default="complete",
        metadata={
            "help": "'complete': pack whole conversations into samples of up to --tokens-per-sample positions; "
            "'eos': one conversation per sample (--task sft never cuts a conversation between samples)",
            "choices": list(BREAK_MODES),
        },
    )
    document_attention_mask: bool = field(
        default=True,
        metadata={"help": "keep attention inside each conversation of a packed sample (block-diagonal causal mask)"},
    )
    reset_position_ids: bool = field(
        default=True,
        metadata={"help": "with --document-attention-mask: positions restart at 0 in each conversation"},
    )


# --criterion cross_entropy, vocab_parallel_cross_entropy, adaptive_loss (toolkit/criterions/)


@dataclass
class CrossEntropyCriterionConfig:
    sentence_avg: bool = field(
        default=False,
        metadata={
            "help": "normalize gradients by the number of sentences in a batch (default: by the number of tokens)"
        },
    )
    z_loss_coef: float = field(
        default=0.0,
        metadata={
            "help": "PaLM's z-loss: add coef * logsumexp(logits)^2 per target token (nats^2, normalized like the loss) "
            "to the training loss to keep the softmax normalizer near 1 (e.g. 1e-4); logged as z_loss "
            "(the mean logsumexp^2 without coef); loss and ppl stay the cross-entropy",
            "type": non_negative_float,
        },
    )
    head_loss_chunk_rows: int = field(
        default=512,
        metadata={
            "help": "compute the output layer and the loss together, this many tokens at a time: never all "
            "[tokens, vocabulary] logits, only N x vocabulary fp32 (transformer_lm, llama, moe; not with "
            "--z-loss-coef, --fp16, an adaptive softmax, a vocabulary split over ranks or a logit soft-cap, which "
            "keep the logits); 0: always the logits, then the loss",
            "type": non_negative_int,
        },
    )


# --optimizer (toolkit/optim/<name>.py)


@dataclass
class AdamConfig:
    adam_betas: str = opt("(0.9, 0.999)", "betas for Adam optimizer, e.g. '(0.9, 0.98)'")
    adam_eps: float = opt(1e-8, "epsilon for Adam optimizer")
    weight_decay: float = opt(0.0, "weight decay (decoupled, as AdamW)")


@dataclass
class CPUAdamConfig:
    adam_betas: str = opt("(0.9, 0.999)", "betas for Adam optimizer, e.g. '(0.9, 0.98)'")
    adam_eps: float = opt(1e-8, "epsilon for Adam optimizer")
    weight_decay: float = opt(0.0, "weight decay (decoupled, as AdamW)")
    fp16_adam_stats: bool = opt(False, "keep the Adam moments in fp16, with one scale per tensor")
    adam_state_precision: str = opt(
        "fp32",
        "precision of the Adam moments in host memory: fp32 (8 bytes per "
        "parameter), bf16 (4) or 8bit (about 2: blockwise-quantized)",
        choices=list(ADAM_STATE_PRECISIONS),
    )


@dataclass
class MuonConfig:
    wants_parameter_roles: ClassVar[bool] = True  # the trainer hands this optimizer groups tagged by role

    muon_momentum: float = opt(0.95, "Muon's momentum factor")
    muon_nesterov: bool = opt(True, "Nesterov momentum for Muon's matrices")
    muon_ns_steps: int = opt(5, "Newton-Schulz iterations per matrix and step", type=positive_int)
    muon_adjust_lr: str = opt(
        "original",
        "how Muon scales --lr by a matrix's shape (A x B): 'original' by "
        "sqrt(max(1, A/B)) (Keller Jordan's), 'match_rms_adamw' by "
        "0.2 sqrt(max(A, B)) (Moonshot's: AdamW's learning rate and weight "
        "decay carry over)",
        choices=["original", "match_rms_adamw"],
    )
    muon_adamw_lr: Optional[float] = opt(
        None,
        "peak learning rate of the AdamW side (embeddings, output head, "
        "norms, biases), scheduled as --lr (default: --lr)",
    )
    muon_momentum_dtype: str = opt(
        "fp32",
        "Muon's momentum in fp32 or bf16 (half the host memory under --cpu-offload)",
        choices=list(MOMENTUM_DTYPES),
    )
    adam_betas: str = opt("(0.9, 0.999)", "betas of the AdamW side, e.g. '(0.9, 0.98)'")
    adam_eps: float = opt(1e-8, "epsilon of the AdamW side")
    weight_decay: float = opt(0.0, "weight decay (decoupled) of both sides")
    qk_clip_threshold: Optional[float] = opt(
        None,
        "Kimi K2's QK-clip (MuonClip): after each update, the query/key projections of a head whose largest "
        "attention logit went past this are scaled to bring it back to it (default: off; Kimi K2: 100)",
        type=positive_float,
    )


@dataclass
class SGDConfig:
    momentum: float = opt(0.0, "momentum factor")
    weight_decay: float = opt(0.0, "weight decay")


@dataclass
class NAGConfig:
    momentum: float = opt(0.99, "momentum factor")
    weight_decay: float = opt(0.0, "weight decay")


# --lr-scheduler (toolkit/optim/lr_scheduler/<name>.py)


@dataclass
class FixedLRScheduleConfig:
    force_anneal: Optional[int] = opt(None, "force annealing at specified epoch (epochs start at 1)")
    lr_shrink: float = opt(0.1, "shrink factor for annealing, lr_new = (lr * lr_shrink)")
    warmup_updates: int = opt(0, "warmup the learning rate linearly for the first N updates")
    lr: float = opt(0.25, "learning rate")
    lr_per_epoch: Tuple[float, ...] = opt(
        (), "--lr's comma-separated values: epoch e uses the e-th (the last repeats)", cli=False
    )


@dataclass
class InverseSquareRootLRScheduleConfig:
    warmup_updates: int = opt(4000, "warmup the learning rate linearly for the first N updates")
    warmup_init_lr: float = opt(-1.0, "initial learning rate during warmup (default: 0 with a warmup, else --lr)")
    lr: float = opt(0.25, "learning rate")


@dataclass
class PolynomialDecayLRScheduleConfig:
    warmup_updates: int = opt(0, "warmup the learning rate linearly for the first N updates")
    force_anneal: Optional[int] = opt(None, "force annealing at specified epoch")
    end_learning_rate: float = opt(0.0, "learning rate to decay to")
    power: float = opt(1.0, "decay exponent")
    total_num_update: Optional[int] = opt(
        None, "total number of updates over which to decay the learning rate (default: --max-update)"
    )
    lr: float = opt(0.25, "learning rate")
    max_update: int = opt(0, "stop after this many updates (0: no limit)")


@dataclass
class CosineLRScheduleConfig:
    warmup_updates: int = opt(0, "warmup the learning rate linearly for the first N updates")
    warmup_init_lr: float = opt(-1.0, "initial learning rate during warmup (default: --min-lr)")
    min_lr: float = opt(0.0, "minimum learning rate of the cosine")
    t_mult: float = opt(1.0, "factor to grow the length of each period")
    lr_period_updates: float = opt(
        -1.0, "initial number of updates per period (default: --max-update minus --warmup-updates)"
    )
    lr_shrink: float = opt(0.1, "shrink factor of the peak and minimum after each period")
    lr: float = opt(0.25, "learning rate")
    max_update: int = opt(0, "stop after this many updates (0: no limit)")


@dataclass
class TriStageLRScheduleConfig:
    warmup_steps: int = opt(0, "warmup the learning rate linearly for the first N updates")
    hold_steps: int = opt(0, "updates held at --lr after the warmup")
    decay_steps: int = opt(0, "updates of exponential decay after the hold")
    phase_ratio: Optional[Tuple[float, ...]] = opt(
        None,
        "W,H,D: shares of --max-update for warmup, hold and decay (adding up to 1); replaces the three step counts",
        type=float_list,
        metavar="W,H,D",
    )
    init_lr_scale: float = opt(0.01, "initial learning rate scale during warmup phase")
    final_lr_scale: float = opt(0.01, "final learning rate scale")
    lr: float = opt(0.25, "learning rate")
    max_update: int = opt(0, "stop after this many updates (0: no limit)")


@dataclass
class ReduceLROnPlateauLRScheduleConfig:
    lr_shrink: float = opt(0.1, "shrink factor for annealing")
    lr_threshold: float = opt(1e-4, "threshold for measuring the new optimum, to only focus on significant changes")
    lr_patience: int = opt(0, "number of epochs with no improvement after which learning rate will be reduced")
    warmup_updates: int = opt(0, "warmup the learning rate linearly for the first N updates")
    warmup_init_lr: float = opt(-1.0, "initial learning rate during warmup phase; default is --lr")
    lr: float = opt(0.25, "learning rate")
    maximize_best_checkpoint_metric: bool = opt(False, "a larger metric is better")


@dataclass
class WSDLRScheduleConfig:
    warmup_updates: int = opt(0, "warmup the learning rate linearly for the first N updates")
    decay_fraction: float = opt(
        0.1,
        "share of the run (--total-num-update, else --max-update) spent decaying, at its end",
        type=non_negative_float,
    )
    decay_shape: str = opt(
        "1-sqrt", "shape of the decay from --lr to --min-lr (1-sqrt: Hägele et al. 2024)", choices=list(DECAY_SHAPES)
    )
    wsd_decay_start: Optional[int] = opt(
        None,
        "update at which the decay starts (default: from --decay-fraction); "
        "set it to a stable-phase checkpoint's update to decay from there",
    )
    min_lr: float = opt(0.0, "learning rate at the end of the decay")
    total_num_update: Optional[int] = opt(None, "total number of updates; the decay ends there (default: --max-update)")
    lr: float = opt(0.25, "learning rate")
    max_update: int = opt(0, "stop after this many updates (0: no limit)")
