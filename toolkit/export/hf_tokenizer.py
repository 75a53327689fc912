"""A transformers tokenizer (``tokenizer.json``) that gives the ids our hub gives, where one can.

- whitespace data-bins: a WordLevel model over ``dict.txt`` split on whitespace, ``<unk>`` for
  the rest: exactly ``Dictionary.encode_line``.
- ``--bpe hf_byte_bpe`` / ``--bpe gpt2``: the data-bin's byte-level BPE with its vocabulary
  renumbered to our dictionary's ids. Possible only when every BPE token is in ``dict.txt``: a
  BPE token outside it becomes ``<unk>`` in the toolkit, which a BPE model cannot express
  (renumbering would need an id for it), so then no tokenizer is written and the log says why.
- ``--bpe sentencepiece``: not converted (the log says so).

Encoding puts the symbol our LMs see before a sentence (``</s>``, or ``<s>`` with
``--add-bos-token``) in front, so ``model(**tokenizer(text))`` scores the text as the toolkit does.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Dict, Optional

from toolkit.tokenizers import BPE_JSON, load_tokenizer_for_data_bin


def _specials(d) -> list:
    return [
        {
            "id": i,
            "content": d[i],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i in (d.bos(), d.pad(), d.eos(), d.unk())
    ]


def _template(d, first: int) -> dict:
    sym = d[first]
    return {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": sym, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": sym, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 0}},
        ],
        "special_tokens": {sym: {"id": sym, "ids": [first], "tokens": [sym]}},
    }


def _word_level(d) -> dict:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({sym: i for i, sym in enumerate(d.symbols)}, unk_token=d.unk_word))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return json.loads(tok.to_str())


def _renumbered_bpe(bpe, d, piece: Callable[[str, int], str]) -> Optional[dict]:
    """The BPE's JSON with token ids replaced by our dictionary's; None when a token is missing."""
    inner = getattr(bpe.tok, "_tokenizer", bpe.tok)  # ByteLevelBPETokenizer wraps a Tokenizer
    spec = json.loads(inner.to_str())
    vocab: Dict[str, int] = spec["model"]["vocab"]
    missing = [tok for tok, i in vocab.items() if piece(tok, i) not in d]
    if missing:
        return None
    spec["model"]["vocab"] = {tok: d.index(piece(tok, i)) for tok, i in vocab.items()}
    # The specials in the model's vocabulary too: tokenizers renumbers added tokens it cannot find there.
    spec["model"]["vocab"].update({d[i]: i for i in range(d.nspecial)})
    if spec.get("decoder") is None:
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    return spec


def build_tokenizer_spec(data_dir: str, d) -> tuple:
    """(tokenizer.json content or None, what was done)."""
    if not os.path.isfile(os.path.join(data_dir, BPE_JSON)):
        return _word_level(d), "tokenizer: WordLevel over dict.txt (whitespace data-bin)"
    bpe = load_tokenizer_for_data_bin(data_dir)
    name = json.load(open(os.path.join(data_dir, BPE_JSON), encoding="utf-8"))["bpe"]
    pieces = {"hf_byte_bpe": lambda tok, i: tok, "gpt2": lambda tok, i: str(i)}
    if bpe is None or name not in pieces:
        return None, f"no tokenizer written: --bpe {name} has no transformers tokenizer here"
    spec = _renumbered_bpe(bpe, d, pieces[name])
    if spec is None:
        return None, (
            f"no tokenizer written: some --bpe {name} tokens are not in dict.txt (the toolkit maps "
            f"them to <unk>, which a BPE tokenizer cannot)"
        )
    return spec, f"tokenizer: --bpe {name} renumbered to dict.txt ids"


def write_tokenizer(loaded, out_dir: str) -> str:
    """Write tokenizer.json + tokenizer_config.json when possible; returns a line for the log."""
    d = loaded.dictionary
    spec, message = build_tokenizer_spec(loaded.data_dir, d)
    if spec is None:
        return message
    first = loaded.first_symbol
    spec["added_tokens"] = _specials(d)
    spec["post_processor"] = _template(d, first)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    write_tokenizer_config(loaded, out_dir, first)
    return message


def write_tokenizer_config(loaded, out_dir: str, bos: int) -> None:
    """tokenizer_config.json: the tokenizer.json as it is (``PreTrainedTokenizerFast``), with the specials' names."""
    d = loaded.dictionary
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": d[bos],
        "eos_token": d[d.eos()],
        "unk_token": d[d.unk()],
        "pad_token": d[d.pad()],
        "model_max_length": loaded.model.max_positions(),
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
