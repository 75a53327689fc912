"""Checks that turn load-time crashes into one line: another architecture, bad positions.

- :func:`check_model`: a checkpoint whose parameters (names or shapes) differ from this
  run's model is refused before anything loads, naming the model flags that differ
  (e.g. ``--share-decoder-input-output-embed``, ``--decoder-learned-pos``), not the
  unexpected key or missing optimizer state that would come out of torch.
- :func:`check_positions`: ``--tokens-per-sample`` longer than ``--max-target-positions``
  is caught at parse time, not at the first forward.

fairseq's own files are read by ``toolkit.compat.fairseq.checkpoint`` (its ``is_fairseq_checkpoint``
is the one test of where a file comes from).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from toolkit.core.errors import UserError

Shapes = Mapping[str, Tuple[int, ...]]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def differing_options(saved_cfg: Mapping[str, Any], current: Mapping[str, Any], names: Iterable[str]) -> List[str]:
    """``--flag saved -> current`` for each model option whose value differs (options absent from the checkpoint skipped)."""
    out = []
    for name in names:
        if name in saved_cfg and name in current and saved_cfg[name] != current[name]:
            out.append(f"{flag(name)} {saved_cfg[name]} in the checkpoint, {current[name]} now")
    return out


def check_model(
    path: str,
    saved_shapes: Shapes,
    model_shapes: Shapes,
    saved_cfg: Mapping[str, Any],
    current_cfg: Mapping[str, Any],
    model_options: Iterable[str],
) -> None:
    """Refuse a checkpoint whose parameter names or shapes differ from the model's (one line)."""
    missing = [k for k in model_shapes if k not in saved_shapes]
    unexpected = [k for k in saved_shapes if k not in model_shapes]
    wrong = [k for k in model_shapes if k in saved_shapes and tuple(saved_shapes[k]) != tuple(model_shapes[k])]
    if not (missing or unexpected or wrong):
        return
    flags = differing_options(saved_cfg, current_cfg, model_options)
    if flags:
        why = "model flags differ: " + "; ".join(flags)
    elif wrong:
        why = f"{wrong[0]} has shape {tuple(saved_shapes[wrong[0]])} in the checkpoint, {tuple(model_shapes[wrong[0]])} now"
    else:
        why = (
            f"parameters differ ({len(missing)} missing, e.g. {missing[:1]}; {len(unexpected)} unexpected, "
            f"e.g. {unexpected[:1]})"
        )
    raise UserError(
        f"{path}: checkpoint does not fit this model: {why}; use the checkpoint's model flags, "
        f"or another --save-dir to start afresh"
    )


def check_weights(
    where: str,
    saved: Mapping[str, Any],
    expected: Mapping[str, Any],
    saved_as: str = "the checkpoint",
    describe: Callable[[str], str] = str,
    fix: str = "use the same model options",
) -> None:
    """Refuse, in one line, weights that cannot load into a model: the first of ``saved`` the model lacks or holds
    in another shape, else the first of the model's (``expected``) that ``saved`` lacks. Checked before
    ``load_state_dict``, whose error lists every key of a wrong layout and names no option to change.

    Values are tensors or shapes; ``describe`` names a key (e.g. with its fairseq name), ``fix`` says what to do.
    """
    for name, value in saved.items():
        if name not in expected:
            raise UserError(f"{where}: {saved_as} has {describe(name)}, which this model does not; {fix}")
        if _shape(value) != _shape(expected[name]):
            raise UserError(
                f"{where}: {describe(name)} has shape {_shape(value)} in {saved_as}, "
                f"{_shape(expected[name])} in this model; {fix}"
            )
    missing = next((name for name in expected if name not in saved), None)
    if missing is not None:
        raise UserError(f"{where}: {saved_as} has no weight for {describe(missing)}; {fix}")


def _shape(value: Any) -> Tuple[int, ...]:
    return tuple(value.shape) if hasattr(value, "shape") else tuple(value)


def model_option_names(config_cls: Optional[type]) -> List[str]:
    """The fields of a model's config dataclass: the options that may change its parameters."""
    if config_cls is None or not dataclasses.is_dataclass(config_cls):
        return []
    return [f.name for f in dataclasses.fields(config_cls)]


def check_positions(
    max_target_positions: Optional[int], tokens_per_sample: int, prepends_bos: bool, sample_break_mode: str
) -> None:
    """Samples must fit the model's positions (fixed-size break modes; 'eos' samples vary in length).
    ``prepends_bos``: ``--add-bos-token`` adds a token to every sample (fairseq's ``<s>``; a tokenizer's BOS
    read as context takes the place of ``</s>`` and adds none)."""
    if max_target_positions is None or sample_break_mode == "eos":
        return
    longest = tokens_per_sample + (1 if prepends_bos else 0)
    if longest > max_target_positions:
        raise UserError(
            f"--tokens-per-sample {tokens_per_sample} makes samples of {longest} tokens but "
            f"--max-target-positions is {max_target_positions}; lower --tokens-per-sample or raise "
            f"--max-target-positions"
        )


def model_shapes(model) -> Dict[str, Tuple[int, ...]]:
    """Parameter and buffer names (unwrapped, as checkpoints store them) with their global shapes; a pipeline
    stage's model (which holds some layers) answers with the whole model's (``whole_model_shapes``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    whole = getattr(model, "whole_model_shapes", None)
    if whole is not None:
        return dict(whole)

    return {k: tuple(v.shape) for k, v in get_model_state_dict(model).items()}


def check_resume(path: str, saved_shapes: Shapes, saved_cfg: Mapping[str, Any], model_cfg: Any, model) -> None:
    """:func:`check_model` for a resume: this run's model options and (wrapped) model against the checkpoint's."""
    options = model_option_names(type(model_cfg) if dataclasses.is_dataclass(model_cfg) else None)
    current = dataclasses.asdict(model_cfg) if dataclasses.is_dataclass(model_cfg) else {}
    check_model(path, saved_shapes, model_shapes(model), saved_cfg, current, options)
