"""``--bpe sentencepiece``: a SentencePiece BPE model, given (``--bpe-model``) or trained here."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable, List, Optional

from toolkit.core.errors import UserError
from toolkit.core.registry import register_bpe
from toolkit.tokenizers import Tokenizer


def _usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _encode_threads() -> int:
    """SentencePiece's batch encode uses every core by default (-1); a binarizer worker, one of several processes
    (``binarizer._init_worker`` sets ``TOKENIZERS_PARALLELISM=false``, the Hugging Face tokenizers' switch), takes
    one thread, or N workers on C cores would run N x C threads."""
    return 1 if os.environ.get("TOKENIZERS_PARALLELISM", "").lower() == "false" else -1


@dataclass
class SentencepieceBpeConfig:
    bpe_model: Optional[str] = field(
        default=None,
        metadata={
            "help": "SentencePiece model file to use; leave out to train one on the train split with --bpe-vocab-size",
            "aliases": ("--sentencepiece-model",),
            "metavar": "PATH",
        },
    )
    bpe_vocab_size: Optional[int] = field(
        default=None,
        metadata={
            "help": "train a model of this many pieces on the train split and save it in the data-bin",
            "metavar": "N",
        },
    )
    bpe_character_coverage: float = field(
        default=1.0,
        metadata={"help": "share of characters the trained model must cover (SentencePiece's character_coverage)"},
    )
    bpe_train_max_lines: int = field(
        default=1_000_000,
        metadata={"help": "train on at most this many lines (a random sample when the split has more)"},
    )


@register_bpe("sentencepiece", dataclass=SentencepieceBpeConfig)
class SentencepieceBpe(Tokenizer):
    model_files = {"bpe_model": "sentencepiece.bpe.model"}
    trainable = True

    def __init__(self, cfg: SentencepieceBpeConfig):
        super().__init__(cfg)
        import sentencepiece as spm

        if cfg.bpe_model is None:
            raise UserError("--bpe sentencepiece: give --bpe-model PATH (or --bpe-vocab-size N to train one)")
        try:
            self.sp = spm.SentencePieceProcessor(model_file=cfg.bpe_model)
        except (OSError, RuntimeError) as e:
            raise UserError(
                f"--bpe-model {cfg.bpe_model}: not a SentencePiece model ({e}); "
                f"give a .model file written by SentencePiece"
            ) from None

    def encode(self, line: str) -> str:
        return " ".join(self.sp.encode(line.strip(), out_type=str))

    def encode_lines(self, lines: List[str]) -> List[str]:
        return [
            " ".join(pieces)
            for pieces in self.sp.encode([l.strip() for l in lines], out_type=str, num_threads=_encode_threads())
        ]

    def id_pieces(self) -> List[Optional[str]]:
        """Each id's piece, None at the unknown id (``encode`` writes the unknown characters themselves, not
        ``<unk>``) and at control ids (their text is empty; ``encode`` never gives them): a line holding
        one of these takes the binarizer's text path."""
        sp = self.sp
        return [None if sp.is_unknown(i) or sp.is_control(i) else sp.id_to_piece(i) for i in range(sp.get_piece_size())]

    def encode_lines_to_ids(self, lines: List[str]) -> List[List[int]]:
        return self.sp.encode([l.strip() for l in lines], num_threads=_encode_threads())

    def decode(self, text: str) -> str:
        return self.sp.decode(text.split())

    def __getstate__(self):  # SentencePieceProcessor does not pickle: rebuild from the file
        return {"cfg": self.cfg}

    def __setstate__(self, state):
        self.__init__(state["cfg"])

    @classmethod
    def needs_training(cls, cfg: SentencepieceBpeConfig) -> bool:
        return cfg.bpe_model is None

    @classmethod
    def check_config(cls, cfg: SentencepieceBpeConfig, flag: str = "--bpe sentencepiece") -> None:
        super().check_config(cfg, flag)
        if cfg.bpe_model is None and cfg.bpe_vocab_size is None:
            raise UserError(f"{flag}: give --bpe-model PATH to use a model, or --bpe-vocab-size N to train one")
        if cfg.bpe_model is not None and cfg.bpe_vocab_size is not None:
            raise UserError(f"{flag}: --bpe-model and --bpe-vocab-size exclude each other; give one of them")
        if cfg.bpe_vocab_size is not None and cfg.bpe_vocab_size < 2:
            raise UserError(f"--bpe-vocab-size {cfg.bpe_vocab_size}: must be at least 2")

    @classmethod
    def train(cls, cfg: SentencepieceBpeConfig, lines: Iterable[str], out_dir: str) -> SentencepieceBpeConfig:
        import dataclasses

        import sentencepiece as spm

        prefix = os.path.join(out_dir, os.path.splitext(cls.model_files["bpe_model"])[0])
        sentences = (line.strip() for line in lines)
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=(s for s in sentences if s),
                model_prefix=prefix,
                model_type="bpe",
                vocab_size=cfg.bpe_vocab_size,
                character_coverage=cfg.bpe_character_coverage,
                input_sentence_size=cfg.bpe_train_max_lines,
                shuffle_input_sentence=True,
                max_sentence_length=1 << 16,
                bos_id=-1,
                eos_id=-1,
                num_threads=_usable_cpus(),
                minloglevel=2,
            )
        except RuntimeError as e:
            reason = str(e).split("]")[-1].strip() or str(e)
            raise UserError(f"--bpe-vocab-size {cfg.bpe_vocab_size}: SentencePiece training failed: {reason}") from None
        vocab_file = prefix + ".vocab"
        if os.path.exists(vocab_file):
            os.remove(vocab_file)
        return dataclasses.replace(cfg, bpe_model=prefix + ".model")
