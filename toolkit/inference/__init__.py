"""Load trained models for evaluation and the hub, and score token streams.

Scoring follows fairseq's language-model convention: the stream's tokens are
all targets, and each is predicted from the tokens before it, with ``</s>``
standing before the first. A sliding ``context_window`` gives every block of
``tokens_per_sample`` targets up to that many earlier tokens as (unscored)
context, which lowers perplexity because fewer predictions start cold.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from argparse import Namespace
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from toolkit.config import options
from toolkit.core import registry
from toolkit.checkpoint import identity
from toolkit.checkpoint.common import check_compatible
from toolkit.checkpoint.consolidated import embed_rows
from toolkit.compat.fairseq import adapter as fairseq_adapter
from toolkit.models import build_for_loading
from toolkit.models.lora import SavedLoRA, apply_lora, merged_state
from toolkit.core.errors import UserError

logger = logging.getLogger(__name__)


def load_model(
    path: str,
    data_dir: Optional[str] = None,
    device: torch.device = torch.device("cpu"),
    overrides: Optional[Dict] = None,
    merge_adapters: bool = True,
) -> Tuple[torch.nn.Module, object, Namespace]:
    """A checkpoint's model in eval mode, with the task (dictionary) it was trained on.

    Reads toolkit checkpoints, fairseq ``transformer_lm`` ones (see
    :mod:`toolkit.compat.fairseq.checkpoint`) and the ``model.safetensors`` of a
    ``toolkit-export --format safetensors`` folder (no pickle; options from its ``config.json``);
    ``overrides`` replace saved options (fairseq's ``--model-overrides``). A LoRA run's adapters are merged into
    the weights they adapt, or with ``merge_adapters=False`` kept as the run trained them (``LoRALinear`` modules).
    """
    registry.import_all_components()
    if path.endswith(".safetensors"):
        from toolkit.inference.safetensors_read import read_exported

        state = read_exported(path)
    else:
        state = fairseq_adapter.read_checkpoint(path)
    state = fairseq_adapter.as_toolkit_state(path, state)
    if "cfg" not in state or "model" not in state:
        raise UserError(f"{path}: not a toolkit or fairseq checkpoint (no 'cfg'/'model' entries)")
    cfg = dict(state["cfg"])
    if data_dir is not None:
        cfg["data"] = data_dir
        if cfg.get("data_mixture"):  # the given folder replaces --data-mixture's sources too (for the
            cfg["data_mixture"] = None  # dictionary: the hash check below refuses one not the model's)
    warn_unknown_overrides(path, overrides, cfg)
    cfg.update(switched_task_defaults(cfg.get("task"), (overrides or {}).get("task")))
    cfg.update(overrides or {})
    args = Namespace(**cfg)
    if registry.registered_arch(args.arch) is None:
        used = f" (the run used --user-dir {cfg['user_dir']})" if cfg.get("user_dir") else ""
        raise UserError(f"{path}: {registry.unknown_arch_message(args.arch)}{used}")
    task_entry = registry.TASK_REGISTRY.get(args.task)
    task = task_entry.cls.setup_task(options.config_from_args(task_entry.config, args))
    check_compatible(path, cfg, args, embed_rows(state["model"]), len(task.dictionary))
    identity.check_dictionary(
        path, identity.saved_hash(state.get("extra_state")), task.dictionary, identity.dict_path_of(task)
    )
    model = build_for_loading(args.arch, args, task, device)
    state["model"] = fairseq_adapter.model_weights(path, model, state)
    lora = SavedLoRA.of(cfg)
    if lora.rank and merge_adapters:
        state["model"] = merged_state(state["model"], lora.scaling)
    elif lora.rank:
        apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.targets)
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    if missing or unexpected:
        raise UserError(
            f"{path}: checkpoint does not match --arch {args.arch} (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    return model.eval(), task, args


def switched_task_defaults(saved: Optional[str], wanted: Optional[str]) -> Dict:
    """A checkpoint read as another task (``--task``) keeps its options, but where the two tasks' options have
    different defaults (``--task sft`` packs whole conversations with document masks, ``language_modeling``
    cuts the stream into blocks) the saved value is the old task's default and the new task's is taken."""
    if wanted is None or wanted == saved:
        return {}
    old_entry, new_entry = (
        registry.TASK_REGISTRY.get(saved or registry.TASK_REGISTRY.default),
        registry.TASK_REGISTRY.get(wanted),
    )
    if old_entry.config is None or new_entry.config is None:
        return {}
    old, new = vars(old_entry.config()), vars(new_entry.config())
    return {name: value for name, value in new.items() if name in old and old[name] != value}


def warn_unknown_overrides(path: str, overrides: Optional[Dict], saved: Dict) -> None:
    """--model-overrides keys that are no option of the checkpoint's model or task: one line (fairseq ignores
    them without a word, so a misspelt key silently changed nothing)."""
    known = set(saved) | set(model_option_names(saved.get("arch")))
    unknown = sorted(set(overrides or {}) - known)
    if unknown:
        logger.warning(
            f"--model-overrides: {', '.join(unknown)} not an option of {path}'s model or task "
            f"(--arch {saved.get('arch')}); ignored"
        )


def model_option_names(arch: Optional[str]) -> List[str]:
    """The options of ``arch``'s model (none for an unregistered arch: :func:`load_model` refuses it next)."""
    entry = registry.registered_arch(arch)
    return [f.name for f in dataclasses.fields(entry.config)] if entry is not None and entry.config else []


def load_ensemble(
    paths: str, data_dir: Optional[str], device: torch.device, overrides: Optional[Dict] = None
) -> Tuple[List[torch.nn.Module], object, Namespace]:
    models, task, args = [], None, None
    for path in paths.split(":"):
        model, task_i, args_i = load_model(path, data_dir, device, overrides)
        if task is not None and task_i.dictionary != task.dictionary:
            raise UserError(f"{path}: ensemble members must share one dictionary")
        models.append(model)
        task, args = task or task_i, args or args_i
    return models, task, args


def stream_blocks(num_tokens: int, tokens_per_sample: int, context_window: int) -> Iterator[Tuple[int, int, int]]:
    """(input_start, target_start, end) per block: inputs [input_start, end), scored [target_start, end)."""
    for start in range(0, num_tokens, tokens_per_sample):
        end = min(start + tokens_per_sample, num_tokens)
        yield max(0, start - context_window), start, end


def _positions_of(net_output, select) -> object:
    """``select`` applied to the positions of forward's output, whether a tensor or ``(tensor, extra)``."""
    if isinstance(net_output, (tuple, list)):
        return (select(net_output[0]), *net_output[1:])
    return select(net_output)


def _average(models: List[torch.nn.Module], outputs: list) -> torch.Tensor:
    """log of the mean probability over the ensemble, each model normalizing its own output (fp32)."""
    logps = [m.get_normalized_probs(out, log_probs=True) for m, out in zip(models, outputs)]  # adaptive softmax too
    if len(logps) == 1:
        return logps[0]
    return torch.logsumexp(torch.stack(logps), dim=0) - math.log(len(logps))


@torch.no_grad()
def ensemble_log_probs(
    models: List[torch.nn.Module], inputs: torch.Tensor, positions: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """log p(next token) averaged over the ensemble in probability space, [B, T, V] fp32: the one scorer.

    Every model normalizes through its own ``get_normalized_probs`` (a plain softmax, or the
    adaptive softmax's head and tails, whose input is features, not logits); an ensemble averages
    probabilities, as fairseq's SequenceScorer. eval-lm, the hub (:func:`target_log_probs`) and the
    evaluation harness all score through here, so they cannot disagree.
    ``positions`` [B, K] (optional): normalize only those positions of each row, [B, K, V]; the
    softmax over the vocabulary at every other position is never computed (memory and time).
    """

    def select(out: torch.Tensor) -> torch.Tensor:
        out = out[0] if isinstance(out, tuple) else out  # fairseq-style models return (logits, extra)
        if positions is None:
            return out
        return out.gather(1, positions[:, :, None].expand(-1, -1, out.size(-1)))

    return _average(models, [_positions_of(m(inputs), select) for m in models])


@torch.no_grad()
def target_log_probs(
    models: List[torch.nn.Module], inputs: torch.Tensor, targets: torch.Tensor, softmax_batch: int = 0
) -> torch.Tensor:
    """log p(target) per position [B, T] (natural log, fp32): :func:`ensemble_log_probs`' distribution, gathered
    at the targets. ``softmax_batch`` > 0 normalizes at most that many positions at a time (memory only)."""
    outputs = [_positions_of(m(inputs), lambda out: out.reshape(1, -1, out.size(-1))) for m in models]
    flat_tgt = targets.reshape(-1)
    n = flat_tgt.numel()
    step = softmax_batch if 0 < softmax_batch < n else max(n, 1)
    parts = []
    for s in range(0, n, step):
        chunk = [_positions_of(out, lambda x: x[:, s : s + step]) for out in outputs]
        parts.append(_average(models, chunk)[0].gather(1, flat_tgt[s : s + step, None])[:, 0])
    return torch.cat(parts).float().view(targets.shape)


@torch.no_grad()
def score_stream(
    models: List[torch.nn.Module],
    stream: torch.Tensor,
    eos: int,
    tokens_per_sample: int,
    context_window: int = 0,
    max_tokens: Optional[int] = None,
    batch_size: Optional[int] = None,
    device: torch.device = torch.device("cpu"),
) -> torch.Tensor:
    """Per-token log-probabilities (natural log) of every token of ``stream``."""
    stream = stream.long()
    inputs_all = torch.cat([stream.new_tensor([eos]), stream[:-1]])
    out = torch.empty(len(stream), dtype=torch.float32)
    blocks = list(stream_blocks(len(stream), tokens_per_sample, context_window))
    width = tokens_per_sample + context_window
    per_batch = max(1, min(batch_size or 1 << 30, (max_tokens or width * 8) // width))
    for i in range(0, len(blocks), per_batch):
        group = blocks[i : i + per_batch]
        lengths = [end - s for s, _, end in group]
        batch = torch.full((len(group), max(lengths)), eos, dtype=torch.long)
        targets = torch.full_like(batch, eos)
        for row, (s, _, end) in enumerate(group):
            batch[row, : end - s] = inputs_all[s:end]
            targets[row, : end - s] = stream[s:end]
        logp = target_log_probs(models, batch.to(device), targets.to(device)).cpu()
        for row, (s, t, end) in enumerate(group):
            out[t:end] = logp[row, t - s : end - s]
    return out
