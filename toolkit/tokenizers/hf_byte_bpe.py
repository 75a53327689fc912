"""``--bpe hf_byte_bpe``: a byte-level BPE of HF ``tokenizers`` (GPT-2 style), given or trained here, or any
tokenizer a Hugging Face model saved (``toolkit-export --from hf`` writes its ``tokenizer.json``).

The pieces are the tokenizer's own strings (``Ġthe``), so ``dict.txt`` stays readable. Text reaches the
tokenizer as written, whitespace included (a line's leading spaces are tokens of such a tokenizer, unlike
fairseq's ``--bpe gpt2``, whose lines are stripped as fairseq's encoder strips them): a line is encoded
without the tokenizer's special tokens (the model reads BOS as its context, see
``toolkit.tasks.language_modeling.bos_as_context``), a document with them, so each document's ids are exactly
``AutoTokenizer(text)["input_ids"]``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Iterable, List, Optional

from toolkit.core.errors import UserError
from toolkit.core.registry import register_bpe
from toolkit.tokenizers import Tokenizer

BYTE_ALPHABET = 256


@dataclass
class HfByteBpeConfig:
    bpe_model: Optional[str] = field(
        default=None,
        metadata={
            "help": "tokenizer JSON file (tokenizers' Tokenizer.save) to use; leave out to train one on the "
            "train split with --bpe-vocab-size",
            "metavar": "PATH",
        },
    )
    bpe_vocab_size: Optional[int] = field(
        default=None,
        metadata={
            "help": "train a byte-level BPE of this many tokens (more than 256) on the train split and save it "
            "in the data-bin",
            "metavar": "N",
        },
    )
    bpe_min_frequency: int = field(
        default=2, metadata={"help": "when training, merge only pairs seen at least this often"}
    )
    bpe_add_prefix_space: bool = field(
        default=False,
        metadata={"help": "when training, add a space before each line so its first word encodes as the others do"},
    )


@register_bpe("hf_byte_bpe", dataclass=HfByteBpeConfig)
class HfByteBpe(Tokenizer):
    model_files = {"bpe_model": "hf_byte_bpe.json"}
    trainable = True

    def __init__(self, cfg: HfByteBpeConfig):
        super().__init__(cfg)
        from tokenizers import Tokenizer as HfTokenizer

        if cfg.bpe_model is None:
            raise UserError("--bpe hf_byte_bpe: give --bpe-model PATH (or --bpe-vocab-size N to train one)")
        try:
            self.tok = HfTokenizer.from_file(cfg.bpe_model)
        except Exception as e:  # tokenizers raises its own Exception subclass
            raise UserError(
                f"--bpe-model {cfg.bpe_model}: not a tokenizers JSON file ({e}); "
                f"give a file written by tokenizers' Tokenizer.save"
            ) from None
        if self.tok.decoder is None:
            from tokenizers import decoders

            self.tok.decoder = decoders.ByteLevel()

    def encode(self, line: str) -> str:
        return " ".join(self.tok.encode(line, add_special_tokens=False).tokens)

    def encode_lines(self, lines: List[str]) -> List[str]:
        return [" ".join(e.tokens) for e in self.tok.encode_batch(lines, add_special_tokens=False)]

    def id_pieces(self) -> List[Optional[str]]:
        return [self.tok.id_to_token(i) for i in range(self.tok.get_vocab_size(with_added_tokens=True))]

    def encode_lines_to_ids(self, lines: List[str]) -> List[List[int]]:
        return [e.ids for e in self.tok.encode_batch(lines, add_special_tokens=False)]

    def encode_documents(self, texts: List[str]) -> List[str]:
        return [" ".join(e.tokens) for e in self.tok.encode_batch(texts, add_special_tokens=True)]

    def encode_documents_to_ids(self, texts: List[str]) -> List[List[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=True)]

    def decode(self, text: str) -> str:
        return self.tok.decoder.decode(text.split())

    def __getstate__(self):
        return {"cfg": self.cfg}

    def __setstate__(self, state):
        self.__init__(state["cfg"])

    @classmethod
    def needs_training(cls, cfg: HfByteBpeConfig) -> bool:
        return cfg.bpe_model is None

    @classmethod
    def check_config(cls, cfg: HfByteBpeConfig, flag: str = "--bpe hf_byte_bpe") -> None:
        super().check_config(cfg, flag)
        if cfg.bpe_model is None and cfg.bpe_vocab_size is None:
            raise UserError(f"{flag}: give --bpe-model PATH to use a tokenizer, or --bpe-vocab-size N to train one")
        if cfg.bpe_model is not None and cfg.bpe_vocab_size is not None:
            raise UserError(f"{flag}: --bpe-model and --bpe-vocab-size exclude each other; give one of them")
        if cfg.bpe_vocab_size is not None and cfg.bpe_vocab_size <= BYTE_ALPHABET:
            raise UserError(
                f"--bpe-vocab-size {cfg.bpe_vocab_size}: a byte-level BPE already has "
                f"{BYTE_ALPHABET} byte tokens; give a size above {BYTE_ALPHABET}"
            )

    @classmethod
    def train(cls, cfg: HfByteBpeConfig, lines: Iterable[str], out_dir: str) -> HfByteBpeConfig:
        from tokenizers import ByteLevelBPETokenizer

        tok = ByteLevelBPETokenizer(add_prefix_space=cfg.bpe_add_prefix_space)
        tok.train_from_iterator(
            (text for text in lines if text.strip()),  # the texts as they will be encoded, whitespace included
            vocab_size=cfg.bpe_vocab_size,
            min_frequency=cfg.bpe_min_frequency,
            show_progress=False,
            special_tokens=[],
        )
        path = os.path.join(out_dir, cls.model_files["bpe_model"])
        tok.save(path)
        return dataclasses.replace(cfg, bpe_model=path)
