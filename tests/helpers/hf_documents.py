"""Tiny Hugging Face folders whose tokenizer encodes any text (a byte-level BPE: every byte has a token, so code,
indentation and newlines keep their own ids), and documents to binarize with them: code with indentation,
multi-paragraph prose, CRLF line ends, leading spaces, tabs, an empty record.

``make_byte_level(folder, bos=True)``: a random Llama whose tokenizer puts BOS first (Llama's convention);
``bos=False``: a random Qwen2 whose tokenizer adds no special token (Qwen's); ``eos_after=True``: a Llama whose
template also ends each text with EOS (what ``add_eos_token`` makes of Llama's). Import only after
``pytest.importorskip("transformers")`` / ``("tokenizers")``.
"""

from __future__ import annotations

from typing import Iterable

import tokenizers
import torch
import transformers

from tests.helpers.hf_llama import KINDS, SHAPES

CODE = 'def f(x):\n    if x:\n        return 1\n\treturn "  two  spaces"\n'
PROSE = (
    "The tower is 324 metres tall.\n\nIt was the tallest structure in the world\nfor 41 years.\n\n\n"
    "  An indented third paragraph, after two blank lines."
)
DOCUMENTS = [
    CODE,
    PROSE,
    " a record with a leading space and a trailing one ",
    "windows line ends\r\nsecond line\r\n",
    "",
    "class A:\n    pass\n\n\nclass B(A):\n    def g(self):\n        return [i * 2 for i in range(10)]",
    "\u00e9t\u00e9 \u00e0 Z\u00fcrich \u2014 caf\u00e9 \u4e2d\u6587",
]
TRAIN_TEXT = "\n".join(DOCUMENTS * 3)
BOS, EOS = "<s>", "</s>"


def byte_level_tokenizer(
    bos: bool, eos_after: bool = False, texts: Iterable[str] = (TRAIN_TEXT,), vocab_size: int = 400
) -> tokenizers.Tokenizer:
    """A byte-level BPE of ``vocab_size`` tokens trained on ``texts`` (the documents), with BOS and EOS tokens; BOS
    put first by the template when ``bos``, EOS last when ``eos_after``."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    if bos:
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{BOS} $A" + (f" {EOS}" if eos_after else ""),
            special_tokens=[(BOS, tok.token_to_id(BOS)), (EOS, tok.token_to_id(EOS))],
        )
    return tok


def make_byte_level(
    folder: str, bos: bool = True, eos_after: bool = False, texts: Iterable[str] = (TRAIN_TEXT,), vocab_size=400, **over
):
    """A random tiny model saved with the byte-level tokenizer (trained on ``texts``): a Llama (BOS first) or a Qwen2
    (no BOS); ``over`` replace config values (max_position_embeddings)."""
    tok = byte_level_tokenizer(bos, eos_after, texts, vocab_size)
    names = dict(bos_token=BOS, eos_token=EOS) if bos else dict(eos_token=EOS, pad_token=EOS)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **names).save_pretrained(folder)
    ids = dict(
        bos_token_id=tok.token_to_id(BOS) if bos else None,
        eos_token_id=tok.token_to_id(EOS),
        vocab_size=tok.get_vocab_size() + 16,  # unused rows: the pad id no text encodes to
    )
    config_cls, extra = KINDS["llama" if bos else "qwen2"]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**{**SHAPES, **extra, **ids, **over})).eval()
    hf.save_pretrained(folder)
    return hf
