"""Text <-> token ids for evaluation, with the tokenizer the model was trained or imported with.

Three cases, in this order:

- the data folder holds ``tokenizer.json`` and its ``dict.txt`` is that tokenizer's vocabulary
  (``toolkit-export --from hf``): the Hugging Face tokenizer's ids are the dictionary's ids;
- the data-bin records a BPE (``bpe.json``): pieces, then ``dict.txt`` ids (as the hub encodes);
- a whitespace data-bin: words looked up in ``dict.txt``.

The folder is the task's ``model_files_dir()``: DATA's first folder or a ``--data-mixture`` run's first
source, the import's folder or a data-bin binarized with its command (``hf_byte_bpe.json``, the copy).

Decoding drops the specials (``<unk>`` too), as the Hugging Face export's tokenizer does.
``encode`` adds no specials; ``encode_with_specials`` gives what the exported tokenizer gives by default:
the model's own tokenizer's specials, else ``prefix`` first, the symbol the LM sees before a text
(``</s>``, or ``<s>`` with ``--add-bos-token``), which ``toolkit-export --format hf`` makes its BOS.
"""

from __future__ import annotations

from typing import List, Sequence

from toolkit.inference.model_tokenizer import load_model_tokenizer
from toolkit.tokenizers import load_tokenizer_for_data_bin


class TextCodec:
    def __init__(self, dictionary, data_dir: str, add_bos_token: bool):
        self.dictionary = dictionary
        self.prefix = dictionary.bos() if add_bos_token else dictionary.eos()
        self.eos = dictionary.eos()
        self.hf = load_model_tokenizer(data_dir, dictionary)
        self.bpe = None if self.hf is not None else load_tokenizer_for_data_bin(data_dir)

    @property
    def kind(self) -> str:
        return "tokenizer.json" if self.hf is not None else "bpe.json" if self.bpe is not None else "whitespace"

    def encode(self, text: str) -> List[int]:
        if self.hf is not None:
            return self.hf.encode(text, add_special_tokens=False).ids
        pieces = self.bpe.encode(text) if self.bpe is not None else text
        return self.dictionary.encode_line(pieces, append_eos=False).tolist()

    def encode_with_specials(self, text: str) -> List[int]:
        """``AutoTokenizer(export)(text)["input_ids"]``: what lm_eval's ``hf`` model encodes by default."""
        if self.hf is not None:
            return self.hf.encode(text).ids
        return [self.prefix] + self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        if self.hf is not None:
            return self.hf.decode(list(ids), skip_special_tokens=True)
        d = self.dictionary  # the specials dropped, as the exported tokenizer's decode(skip_special_tokens=True)
        text = d.string(list(ids), extra_symbols_to_ignore=(d.bos(), d.unk()))
        return self.bpe.decode(text) if self.bpe is not None else text

    def token_string(self, token_id: int) -> str:
        """The text a special id stands for (the harness adds EOS's string to the stop strings)."""
        return self.dictionary[token_id]
