"""``--bpe gpt2``: GPT-2's byte-level BPE from its ``encoder.json`` and ``vocab.bpe``.

As in fairseq, a line encodes to GPT-2 BPE ids written as strings ("31373 995"),
and those strings are the tokens of ``dict.txt``. Encoding runs in HF
``tokenizers`` (same pre-tokenization regex and merge order as OpenAI's encoder).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from toolkit.core.errors import UserError
from toolkit.core.registry import register_bpe
from toolkit.tokenizers import Tokenizer


@dataclass
class Gpt2BpeConfig:
    gpt2_encoder_json: Optional[str] = field(
        default=None, metadata={"help": "path of GPT-2's encoder.json (BPE token -> id)", "metavar": "PATH"}
    )
    gpt2_vocab_bpe: Optional[str] = field(
        default=None,
        metadata={"help": "path of GPT-2's vocab.bpe (the merges, first line '#version: ...')", "metavar": "PATH"},
    )


@register_bpe("gpt2", dataclass=Gpt2BpeConfig)
class Gpt2Bpe(Tokenizer):
    model_files = {"gpt2_encoder_json": "encoder.json", "gpt2_vocab_bpe": "vocab.bpe"}
    trainable = False

    def __init__(self, cfg: Gpt2BpeConfig):
        super().__init__(cfg)
        self.check_config(cfg)
        from tokenizers import ByteLevelBPETokenizer

        try:
            self.tok = ByteLevelBPETokenizer.from_file(cfg.gpt2_encoder_json, cfg.gpt2_vocab_bpe)
        except Exception as e:  # tokenizers raises its own Exception subclass
            raise UserError(
                f"--gpt2-encoder-json {cfg.gpt2_encoder_json} / --gpt2-vocab-bpe {cfg.gpt2_vocab_bpe}: "
                f"cannot read GPT-2 BPE files ({e}); give GPT-2's encoder.json and vocab.bpe"
            ) from None

    def encode(self, line: str) -> str:
        return " ".join(map(str, self.tok.encode(line.strip()).ids))

    def encode_lines(self, lines: List[str]) -> List[str]:
        return [" ".join(map(str, e.ids)) for e in self.tok.encode_batch([l.strip() for l in lines])]

    def id_pieces(self) -> List[str]:
        return [str(i) for i in range(self.tok.get_vocab_size())]  # fairseq's pieces: the ids as text

    def encode_lines_to_ids(self, lines: List[str]) -> List[List[int]]:
        return [e.ids for e in self.tok.encode_batch([l.strip() for l in lines])]

    def decode(self, text: str) -> str:
        """Ids back to text; a token that is not an id (``<unk>``, ``madeupword0000``) is kept as is."""
        out: List[str] = []
        run: List[int] = []
        for tok in text.split():
            if tok.isdigit():
                run.append(int(tok))
                continue
            if run:
                out.append(self.tok.decode(run))
                run = []
            out.append(tok)
        if run:
            out.append(self.tok.decode(run))
        return "".join(out)

    def __getstate__(self):
        return {"cfg": self.cfg}

    def __setstate__(self, state):
        self.__init__(state["cfg"])

    @classmethod
    def check_config(cls, cfg: Gpt2BpeConfig, flag: str = "--bpe gpt2") -> None:
        for name in ("gpt2_encoder_json", "gpt2_vocab_bpe"):
            if getattr(cfg, name) is None:
                raise UserError(f"{flag}: needs --{name.replace('_', '-')} PATH (GPT-2's {cls.model_files[name]})")
        super().check_config(cfg, flag)
