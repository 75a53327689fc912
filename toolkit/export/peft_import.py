"""``toolkit-export --from peft``: a PEFT LoRA adapter folder and the transformers model it adapts as one toolkit
checkpoint that evaluates as peft's model and continues training.

    toolkit-export --from peft --path ADAPTER/ [--base HF_FOLDER/] --out imported/
    toolkit-train DATA <the flags it logs> --finetune-from-model imported/model.pt --lora-rank R ...

``ADAPTER`` is what ``PeftModel.save_pretrained`` writes (``adapter_config.json`` + ``adapter_model.safetensors``);
the base is ``--base`` or, as ``PeftModel.from_pretrained`` reads it, the config's ``base_model_name_or_path``
(a local transformers folder). The base is imported as ``--from hf`` imports it and the adapters are added under
our names (``layers.0.self_attn.q_proj.lora_A.weight``, through the family's key map), with the checkpoint's
``--lora-*`` options set from the config: ``r``, ``lora_alpha``, ``lora_dropout`` and the adapted layers' last
names. rsLoRA's scale ``alpha / sqrt(r)`` is ours (``alpha / r``) with ``lora_alpha * sqrt(r)``. Every other
setting that changes what the adapted model computes or trains (DoRA, ``modules_to_save``, per-layer ranks,
adapter biases, ...) is refused in one line, as is an adapter on only some of the layers its names match: the
toolkit's ``--lora-targets`` adapts every block's layer of that name.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from typing import Any, Dict, List, Optional

import torch

from toolkit.core.errors import UserError, read_json_object
from toolkit.export.common import StepProgress
from toolkit.export.peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX
from toolkit.export.target import export_directory

logger = logging.getLogger("toolkit.export.peft_import")
RESAVE = "give the folder PeftModel.save_pretrained wrote"
#: adapter_config.json settings we cannot represent: (key, its value when unused, what it is)
UNSUPPORTED = (
    ("use_dora", False, "DoRA's magnitude vectors"),
    ("modules_to_save", None, "fully trained copies of other modules (modules_to_save)"),
    ("rank_pattern", {}, "per-layer ranks (rank_pattern)"),
    ("alpha_pattern", {}, "per-layer alphas (alpha_pattern)"),
    ("layers_to_transform", None, "adapters on some layers only (layers_to_transform)"),
    ("bias", "none", "trained biases (bias)"),
    ("lora_bias", False, "a bias on lora_B (lora_bias)"),
    ("fan_in_fan_out", False, "transposed (Conv1D) base weights (fan_in_fan_out)"),
    ("trainable_token_indices", None, "trained embedding rows (trainable_token_indices)"),
    ("target_parameters", None, "adapted parameters (target_parameters)"),
    ("use_qalora", False, "QA-LoRA's pooled inputs (use_qalora)"),
    ("alora_invocation_tokens", None, "activated LoRA (alora_invocation_tokens)"),
    ("layer_replication", None, "replicated layers (layer_replication)"),
)
ADAPTER_KEY = re.compile(r"(?P<module>.+)\.(?P<part>lora_[AB])\.weight")


@dataclasses.dataclass(frozen=True)
class PeftLoRA:
    """An adapter folder's settings as the toolkit's ``--lora-*`` options."""

    rank: int
    alpha: float
    dropout: float


def lora_settings(config: Dict[str, Any], where: str) -> PeftLoRA:
    """``adapter_config.json``'s LoRA settings, or one line naming the first setting we cannot represent."""
    if config.get("peft_type") != "LORA":
        raise UserError(f"{where}: peft_type {config.get('peft_type')!r}; --from peft imports LORA adapters")
    for key, unused, what in UNSUPPORTED:
        value = config.get(key, unused)
        if value not in (unused, None, {}, [], False):
            raise UserError(
                f"{where}: {key} {value!r}: {what} has no toolkit LoRA equivalent; train the adapter without it, "
                f"or merge it (PeftModel.merge_and_unload) and import the merged folder with --from hf"
            )
    rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    if rank <= 0:
        raise UserError(f"{where}: r {rank}; a LoRA rank is positive")
    if config.get("use_rslora"):
        alpha *= math.sqrt(rank)  # rsLoRA scales by alpha / sqrt(r): the same scale as ours, alpha' / r
    return PeftLoRA(rank, alpha, float(config.get("lora_dropout", 0.0)))


def base_folder(config: Dict[str, Any], base: Optional[str], where: str) -> str:
    """The transformers folder the adapter was trained on: ``--base``, else the config's own."""
    folder = base or config.get("base_model_name_or_path") or ""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        named = f"--base {base}" if base else f"{where}'s base_model_name_or_path {folder!r}"
        raise UserError(
            f"{named}: not a local transformers folder (no config.json); give --base, the folder of the model "
            f"the adapter was trained on (download it with huggingface-cli download)"
        )
    return folder


def read_adapters(folder: str) -> Dict[str, torch.Tensor]:
    """The folder's adapter tensors by their peft names (``base_model.model.<module>.lora_A.weight``), in fp32."""
    from safetensors.torch import load_file

    path = os.path.join(folder, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        raise UserError(f"--path {folder}: no {ADAPTER_WEIGHTS}; {RESAVE} (safe_serialization=True)")
    return {name: tensor.float() for name, tensor in load_file(path).items()}


def our_adapters(tensors: Dict[str, torch.Tensor], key_map, state: Dict[str, torch.Tensor], rank: int, where: str):
    """(``{our adapter name: tensor}``, our adapted modules) of peft's tensors, each checked against the base's
    weight it adapts ([r, in] and [out, r])."""
    ours, modules = {}, set()
    for name, tensor in tensors.items():
        m = ADAPTER_KEY.fullmatch(name[len(PEFT_PREFIX) :]) if name.startswith(PEFT_PREFIX) else None
        module = m and key_map.from_hf(f"{m.group('module')}.weight")
        if module is None or module not in state or not module.startswith("layers."):
            raise UserError(
                f"{where}: {name} adapts no Linear layer of the base's blocks; --from peft imports lora_A/lora_B "
                "of the blocks' Linear layers"
            )
        module = module[: -len(".weight")]
        ours[f"{module}.{m.group('part')}.weight"] = tensor
        modules.add(module)
    for module in sorted(modules):
        a, b = ours.get(f"{module}.lora_A.weight"), ours.get(f"{module}.lora_B.weight")
        out_features, in_features = state[f"{module}.weight"].shape
        if a is None or b is None or tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise UserError(
                f"{where}: the adapter of {module} is not lora_A [{rank}, {in_features}] with lora_B "
                f"[{out_features}, {rank}] (r {rank}); {RESAVE}"
            )
    return ours, sorted(modules)


def lora_targets(modules: List[str], state: Dict[str, torch.Tensor], where: str) -> str:
    """``--lora-targets`` adapting exactly ``modules``: their last names, which must name no other block Linear."""
    names = sorted({module.rsplit(".", 1)[-1] for module in modules})
    matched = {
        key[: -len(".weight")]
        for key, value in state.items()
        if key.startswith("layers.") and key.endswith(".weight") and value.dim() == 2
    }
    matched = {module for module in matched if module.rsplit(".", 1)[-1] in names}
    left_out = sorted(matched - set(modules))
    if left_out:
        raise UserError(
            f"{where}: the adapter leaves out {left_out[0]} ({len(left_out)} layers in all) that its target names "
            f"({', '.join(names)}) match; the toolkit adapts every block's layer of a name"
        )
    return ",".join(names)


def import_peft(folder: str, out_dir: str, base: Optional[str] = None, tokens_per_sample: Optional[int] = None) -> str:
    """Write ``out_dir`` (atomically; module docstring) from the adapter folder ``folder``."""
    from toolkit.export.hf_family import RESAVE as HF_RESAVE
    from toolkit.export.hf_family import importing_family, write_checkpoint

    where = os.path.join(folder, ADAPTER_CONFIG)
    if not os.path.isfile(where):
        raise UserError(f"--path {folder}: no {ADAPTER_CONFIG}; {RESAVE}")
    settings = lora_settings(read_json_object(where, RESAVE), where)
    hf_folder = base_folder(read_json_object(where, RESAVE), base, where)
    hf_config = read_json_object(os.path.join(hf_folder, "config.json"), HF_RESAVE)
    family = importing_family(hf_config, os.path.join(hf_folder, "config.json"))
    key_map = _key_map(family, hf_config["model_type"], where)
    tensors = read_adapters(folder)
    with StepProgress(5, "import") as progress, export_directory(out_dir) as tmp:
        imported = family.from_hf(hf_folder, hf_config, out_dir, tokens_per_sample, progress.advance)
        state = imported.checkpoint["model"]
        adapters, modules = our_adapters(tensors, key_map, state, settings.rank, where)
        targets = lora_targets(modules, state, where)
        state.update(adapters)
        flags = _record(imported.checkpoint["cfg"], settings, targets)
        progress.advance(f"{len(modules)} adapted layers ({targets}), {flags}")
        log = tuple(line + f" {flags}" if line.startswith("fine-tune with:") else line for line in imported.log)
        write_checkpoint(dataclasses.replace(imported, log=log), tmp, out_dir, progress)
    for line in log:
        logger.info(line)
    return out_dir


def _key_map(family, model_type: str, where: str):
    from toolkit.models.common.hf_adapter import DecoderHFAdapter

    adapter_cls = getattr(family, "HF_ADAPTER", None)
    if adapter_cls is None or not issubclass(adapter_cls, DecoderHFAdapter):
        raise UserError(
            f"{where}: the base is a {model_type} model, whose Linear layers are not one-to-one with the toolkit's "
            f"(GPT-2 fuses q/k/v into c_attn); merge the adapter (PeftModel.merge_and_unload) and import the merged "
            f"folder with --from hf"
        )
    return adapter_cls().key_map(model_type)


def _record(cfg: Dict[str, Any], settings: PeftLoRA, targets: str) -> str:
    """Set the checkpoint's ``--lora-*`` options; returns them as toolkit-train flags."""
    cfg.update(lora_rank=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout, lora_targets=targets)
    return (
        f"--lora-rank {settings.rank} --lora-alpha {settings.alpha!r} --lora-dropout {settings.dropout:g} "
        f"--lora-targets {targets}"
    )
