"""The released Qwen3.5 folders (``toolkit-export --from hf``): vision-language models, ``Qwen3_5ForConditionalGeneration``
and ``Qwen3_5MoeForConditionalGeneration`` (``model_type`` ``qwen3_5`` / ``qwen3_5_moe``), read as their text model.

The text model is what the family computes: the ``text_config`` (:func:`text_model`), the tensors under
``model.language_model.`` and ``lm_head`` (:func:`language_tensors`), its embeddings tied as transformers ties the
vision-language class's (by the top level's ``tie_word_embeddings``). The vision tower (``model.visual.``) is left
out with one log line; the multi-token prediction layer (``mtp.``) goes to the family's adapter where the model read
has one (its ``--mtp-depth``), else it is left out too, in the same line. ``--format hf`` writes the text model as
``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``, saying so in one log line.

Why text positions need no M-RoPE: transformers' text rotary (``Qwen3_5TextRotaryEmbedding``) computes a table per
position stream (temporal, height, width) and takes the frequencies of each ``mrope_section`` from its stream; a
text token has the same position in all three, so the three tables are one and the result is ordinary RoPE over
the rotated part of each head, whatever the section sizes and whether they interleave
(``tests/unit/test_qwen3_next.py`` checks it against transformers' module). What differs is images' and videos'
positions, which a text model never sees.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Iterable, Iterator, Optional, Tuple

import torch

from toolkit.core.errors import UserError
from toolkit.models.common.hf_config import DecoderClass
from toolkit.models.common.hf_folder import tensor_names
from toolkit.models.qwen3_next.hf import KINDS, Qwen3NextAdapter

logger = logging.getLogger(__name__)

RELEASED = {  # the released folder's model_type -> (its class, its text model's model_type)
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text"),
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "qwen3_5_text"),
}
LANGUAGE, VISION, MTP = "model.language_model.", "model.visual.", "mtp."  # a released folder's tensor names
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


class Qwen3NextReleasedAdapter(Qwen3NextAdapter):
    """The family's adapter (:class:`Qwen3NextAdapter`) that also reads the released vision-language folders as
    their text model (see the module docstring); a text folder is read as the family's adapter reads it."""

    KINDS = {**KINDS, **{kind: DecoderClass(name) for kind, (name, _) in RELEASED.items()}}
    text_prefix = "model."  # where the folder read holds the text model's tensors (a released one: LANGUAGE)
    mtp_kept = False  # whether the model read has the folder's multi-token prediction layer (its --mtp-depth)

    def read(self, folder: str, config: Dict[str, Any], out_dir: str, tokens_per_sample: Optional[int], advance):
        """The family's import, of a released folder's text model, with one log line saying what is left out."""
        if config.get("model_type") not in RELEASED:
            return super().read(folder, config, out_dir, tokens_per_sample, advance)
        self.text_prefix = LANGUAGE
        text = text_model(config, os.path.join(folder, "config.json"))
        imported = super().read(folder, text, out_dir, tokens_per_sample, advance)
        names = tensor_names(folder)
        vision, mtp = (sum(name.startswith(prefix) for name in names) for prefix in (VISION, MTP))
        imported.log = (
            f"{folder}: {RELEASED[config['model_type']][0]} imported as its text model "
            f"({self.CLASSES[text['model_type']]}, the class --format hf writes); left out the vision tower's "
            f"{vision} tensors (model.visual.*)"
            + ("" if self.mtp_kept or not mtp else f" and the multi-token prediction layer's {mtp} (mtp.*)"),
        ) + tuple(imported.log)
        return imported

    def options_from_hf(self, config: Dict[str, Any], where: str) -> Dict[str, Any]:
        """The family's reading, of a released folder's text model (:func:`text_model`)."""
        return super().options_from_hf(text_model(config, where), where)

    def state_from_hf(self, tensors, given: Dict[str, Any], model_type: str) -> Dict[str, torch.Tensor]:
        """The family's conversion, of a released folder's text model (:func:`language_tensors`)."""
        self.mtp_kept = bool(given.get("mtp_depth"))
        if self.text_prefix == LANGUAGE:
            tensors = language_tensors(tensors, keep_mtp=self.mtp_kept)
        return super().state_from_hf(tensors, given, model_type)

    def state_to_hf(self, state, model_type: str):
        """The family's names; the text model's under ``model.language_model.`` where the folder read is a
        released one."""
        out = super().state_to_hf(state, model_type)
        if self.text_prefix != LANGUAGE:
            return out
        return {LANGUAGE + k[len("model.") :] if k.startswith("model.") else k: v for k, v in out.items()}

    def hf_config(self, cfg, vocab_size: int, base: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
        """The family's class and config.json; a model read from a released folder as its text model's (the
        sections of M-RoPE kept, for a reader that adds the vision tower back)."""
        if (base or {}).get("model_type") not in RELEASED:
            return super().hf_config(cfg, vocab_size, base)
        released = RELEASED[base["model_type"]][0]
        base = text_model(base, "hf_config.json")
        name, config = super().hf_config(cfg, vocab_size, base)
        mrope = {k: v for k, v in (base.get("rope_parameters") or {}).items() if k.startswith("mrope_")}
        config["rope_parameters"] = {**config["rope_parameters"], **mrope}
        logger.info(f"--format hf: the model read from a {released} folder is written as its text model, {name}")
        return name, config


def text_model(config: Dict[str, Any], where: str) -> Dict[str, Any]:
    """The config.json of a released folder's text model (any other returned as it is): its ``text_config`` as the
    text class's (``model_type`` qwen3_5_text / qwen3_5_moe_text), the token ids of the top level where it has
    none, and the embeddings tied as transformers ties the vision-language class's: by the top level's
    ``tie_word_embeddings``, else the text_config's. An ``mrope_section`` that is not counts is refused in one line
    (transformers indexes its three sections)."""
    kind = config.get("model_type")
    if kind not in RELEASED:
        return config
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise UserError(
            f"{where}: model_type {kind!r} without a text_config object (the text model's settings); give the "
            "config.json saved with the model"
        )
    out = dict(text, model_type=RELEASED[kind][1])
    out.update({k: config[k] for k in TOKEN_KEYS if out.get(k) is None and config.get(k) is not None})
    tied = config.get("tie_word_embeddings")
    out["tie_word_embeddings"] = bool(text.get("tie_word_embeddings", False) if tied is None else tied)
    section = (out.get("rope_parameters") or {}).get("mrope_section")
    if section is not None and not (
        isinstance(section, list) and len(section) >= 3 and all(type(s) is int and s >= 0 for s in section)
    ):
        raise UserError(
            f"{where}: text_config.rope_parameters.mrope_section {section!r}: the rotary frequencies of the "
            "temporal, height and width positions, three counts (the releases' [11, 11, 10])"
        )
    return out


def language_tensors(tensors: Iterable[Tuple[str, torch.Tensor]], keep_mtp: bool) -> Iterator[Tuple[str, torch.Tensor]]:
    """A released folder's (name, tensor) pairs as its text model's: ``model.language_model.x`` as ``model.x``,
    ``lm_head`` as it is, the vision tower's (``model.visual.``) left out, and the multi-token prediction layer's
    (``mtp.``) kept only where the model has one (``keep_mtp``)."""
    for name, tensor in tensors:
        if name.startswith(LANGUAGE):
            yield "model." + name[len(LANGUAGE) :], tensor
        elif not name.startswith(VISION) and (keep_mtp or not name.startswith(MTP)):
            yield name, tensor
