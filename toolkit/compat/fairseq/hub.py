"""The parts of fairseq's hub interface that scripts reach for, beside encode/score/sample.

Why: code written against fairseq's ``GeneratorHubInterface`` (XGLM and MoE-LM few-shot scripts,
the language-model READMEs) reads ``lm.cfg``, ``lm.src_dict``, ``lm.max_positions``, calls
``tokenize``/``apply_bpe``/``binarize`` one by one, scores lists of sentences, and loads with
``bpe=``/``tokenizer=`` keywords from a release folder holding ``model.pt``. These give the
toolkit's hub (:mod:`toolkit.inference.hub_utils`) the same surface, with fairseq's semantics.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from toolkit.core.errors import UserError
from toolkit.tokenizers import Tokenizer, build_tokenizer, load_tokenizer_for_data_bin, make_config, tokenizer_class

#: what ``from_pretrained`` looks for when no ``checkpoint_file`` is named: fairseq's release name first
CHECKPOINT_NAMES = ("model.pt", "checkpoint_best.pt", "checkpoint_last.pt", "model.safetensors")

#: fairseq's config groups -> the flat option naming the group's component (``_name``), or None
GROUPS = {
    "common": None,
    "common_eval": None,
    "distributed_training": None,
    "dataset": None,
    "optimization": None,
    "checkpoint": None,
    "generation": None,
    "eval_lm": None,
    "interactive": None,
    "task": "task",
    "model": "arch",
    "criterion": "criterion",
    "optimizer": "optimizer",
    "lr_scheduler": "lr_scheduler",
    "bpe": "bpe",
    "tokenizer": "tokenizer",
}


class GroupedConfig(argparse.Namespace):
    """A flat options namespace that also answers fairseq's groups (``cfg.task``, ``cfg.model``, ...).

    fairseq's ``cfg`` is grouped (``cfg.task.tokens_per_sample``, ``cfg.model._name``); the toolkit
    saves one flat dict. A group is a namespace of all options plus ``_name`` (the chosen task,
    arch, criterion, ...); the flat option of a group's name stays readable inside it
    (``cfg.task.task`` is ``"language_modeling"``).
    """

    def __getattribute__(self, name: str) -> Any:
        if name in GROUPS:
            flat = dict(vars(self))
            key = GROUPS[name]
            return argparse.Namespace(**flat, _name=flat.get(key) if key else None)
        return super().__getattribute__(name)

    def __getitem__(self, name: str) -> Any:  # omegaconf-style cfg["model"]
        return getattr(self, name)

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name, default)


def checkpoint_path(folder: str, checkpoint_file: Optional[str]) -> str:
    """The checkpoint inside a model folder: the file named, else the first of :data:`CHECKPOINT_NAMES` there."""
    if checkpoint_file is not None:
        path = os.path.join(folder, checkpoint_file)
        exported = os.path.join(folder, "model.safetensors")
        return exported if not os.path.isfile(path) and os.path.isfile(exported) else path
    for name in CHECKPOINT_NAMES:
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    raise UserError(
        f"{folder}: none of {', '.join(CHECKPOINT_NAMES)} there; name the file "
        f"(from_pretrained(folder, 'checkpoint_N.pt'))"
    )


class MosesTokenizer:
    """fairseq's ``tokenizer='moses'``: sacremoses' word tokenizer and detokenizer."""

    def __init__(self, lang: str):
        try:
            import sacremoses
        except ImportError:
            raise UserError("tokenizer='moses' needs sacremoses: pip install sacremoses") from None
        self.tok, self.detok = sacremoses.MosesTokenizer(lang), sacremoses.MosesDetokenizer(lang)

    def encode(self, line: str) -> str:
        return self.tok.tokenize(line, aggressive_dash_splits=True, return_str=True, escape=False)

    def decode(self, line: str) -> str:
        return self.detok.detokenize(line.split())


def build_tokenizer_kwarg(name: Optional[str], kwargs: Dict[str, Any]) -> Optional[MosesTokenizer]:
    """``tokenizer=``: None or ``"space"`` (whitespace), or ``"moses"`` (``moses_source_lang``, default en)."""
    if name in (None, "space"):
        return None
    if name != "moses":
        raise UserError(f"tokenizer={name!r}: not available; use 'moses' or 'space' (or none)")
    return MosesTokenizer(kwargs.pop("moses_source_lang", kwargs.pop("source_lang", "en")))


def build_bpe_kwarg(name: Optional[str], data_dir: str, kwargs: Dict[str, Any]) -> Optional[Tokenizer]:
    """``bpe=``: the data-bin's recorded BPE when it is that one (or none is named), else one built from the
    keywords its options take (``gpt2_encoder_json``, ``sentencepiece_model``, ...)."""
    recorded = load_tokenizer_for_data_bin(data_dir)
    if name is None:
        return recorded
    cls = tokenizer_class(name)
    if isinstance(recorded, cls):
        return recorded
    import dataclasses

    names = {f.name for f in dataclasses.fields(make_config(name))}
    given = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    missing = [f for f in cls.model_files if given.get(f) is None]
    if missing:
        raise UserError(
            f"bpe={name!r}: the data-bin {data_dir} records no such BPE; pass "
            f"{', '.join(f'{m}=PATH' for m in missing)} (fairseq downloads these files; here they are given)"
        )
    cls.check_config(make_config(name, given), f"bpe={name!r}")
    return build_tokenizer(name, given)


class FairseqHubMethods:
    """fairseq's ``GeneratorHubInterface`` methods; the host class sets ``models``, ``task``, ``args``,
    ``tokenizer`` (word level: moses, or None) and ``bpe`` (subwords, or None)."""

    @property
    def cfg(self) -> GroupedConfig:
        return GroupedConfig(**vars(self.args))

    @property
    def src_dict(self):
        return self.task.source_dictionary

    @property
    def tgt_dict(self):
        return self.task.target_dictionary

    @property
    def max_positions(self) -> int:
        limits = [self.task.max_positions()] + [m.max_positions() for m in self.models]
        return min(int(x) for x in limits if x is not None)

    def tokenize(self, sentence: str) -> str:
        return self.tokenizer.encode(sentence) if self.tokenizer is not None else sentence

    def detokenize(self, sentence: str) -> str:
        return self.tokenizer.decode(sentence) if self.tokenizer is not None else sentence

    def apply_bpe(self, sentence: str) -> str:
        return self.bpe.encode(sentence) if self.bpe is not None else sentence

    def remove_bpe(self, sentence: str) -> str:
        return self.bpe.decode(sentence) if self.bpe is not None else sentence

    def binarize(self, sentence: str) -> torch.LongTensor:
        """Pieces -> ids, ending with ``</s>``; unknown pieces become ``<unk>`` (the dictionary is not grown)."""
        return self.src_dict.encode_line(sentence, add_if_not_exist=False).long()

    def string(self, tokens: torch.Tensor) -> str:
        return self.tgt_dict.string(tokens)

    def encode(self, sentence: str) -> torch.LongTensor:
        """fairseq's order: tokenize, apply_bpe, binarize."""
        return self.binarize(self.apply_bpe(self.tokenize(sentence)))

    def decode(self, tokens: torch.Tensor) -> str:
        return self.detokenize(self.remove_bpe(self.string(tokens)))

    def score(
        self, sentences: Union[str, List[str]], replace_newlines_with_eos: bool = False, **kwargs: Any
    ) -> Union[Dict[str, object], List[Dict[str, object]]]:
        """Per-token log-probabilities of each sentence (a dict per sentence; one dict for one string).

        ``replace_newlines_with_eos``: each line is encoded on its own and the lines joined, so a
        newline becomes ``</s>`` (fairseq's few-shot scoring of multi-line prompts).
        """
        if isinstance(sentences, str):
            return self.score([sentences], replace_newlines_with_eos, **kwargs)[0]
        out = []
        for sentence in sentences:
            if replace_newlines_with_eos:
                tokens = self.encode_lines(sentence.splitlines())
            else:
                tokens = self.encode(sentence)
            out.append(self.score_tokens(tokens, **kwargs))
        return out

    def encode_lines(self, lines: List[str]) -> torch.LongTensor:
        """The lines as one text, each line's ids ending with ``</s>`` (a data-bin's stream)."""
        return torch.cat([self.encode(line) for line in lines])

    def score_tokens(self, tokens: torch.Tensor, **kwargs: Any) -> Dict[str, object]:
        raise NotImplementedError


def split_hub_kwargs(kwargs: Dict[str, Any]) -> Tuple[Optional[str], Optional[str], Dict[str, Any]]:
    """(bpe, tokenizer, the rest) of ``from_pretrained``'s keywords."""
    rest = dict(kwargs)
    return rest.pop("bpe", None), rest.pop("tokenizer", None), rest
