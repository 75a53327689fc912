"""The model's own Hugging Face tokenizer, for models imported with ``toolkit-export --from hf``.

Why: such a folder's ``dict.txt`` is the tokenizer's vocabulary in id order, so the ids the tokenizer
gives are the model's ids. Encoding with it (specials included) gives exactly what
``AutoTokenizer.from_pretrained(folder)(text)["input_ids"]`` gives: BOS first when that tokenizer
adds it, no EOS unless it appends one. Those ids are read as transformers reads them: the first id is
the context the model starts from (Llama's BOS; for a tokenizer without BOS, such as Qwen2's, the first
text token), never scored or generated; every id after it is. Models trained on the toolkit's own
data-bins keep fairseq's encoding (``</s>`` appended; ``</s>`` or ``<s>`` as the context before it).
"""

from __future__ import annotations

import os
from typing import Dict, List, Sequence, Tuple

import torch

from toolkit.core.errors import UserError


#: the model's tokenizer in an imported folder, and the copy of it a data-bin binarized with the import's
#: command keeps (``--bpe hf_byte_bpe --bpe-model OUT/tokenizer.json`` writes it as ``hf_byte_bpe.json``)
TOKENIZER_NAMES = ("tokenizer.json", "hf_byte_bpe.json")


def load_model_tokenizer(data_dir: str, dictionary):
    """The model's tokenizer in ``data_dir`` (the import's folder or a data-bin made with its command) when
    ``dict.txt`` holds its vocabulary (ids unchanged), else None.

    Why the data-bin's copy too: every consumer given either folder must read text as the model's tokenizer
    does (BOS first as transformers puts it), not as a BPE data-bin (``</s>`` first).
    """
    names = TOKENIZER_NAMES
    found = [os.path.join(data_dir, n) for n in names if os.path.isfile(os.path.join(data_dir, n))]
    if not found or not getattr(dictionary, "fixed_ids", False):
        return None
    path = found[0]
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError(f"{path}: reading it needs the tokenizers package; pip install tokenizers") from None
    tok = Tokenizer.from_file(path)
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > len(dictionary):
        raise UserError(
            f"{path}: {size} tokens but dict.txt has {len(dictionary)}; the folder is not one "
            f"toolkit-export --from hf wrote (re-import the model)"
        )
    return tok


def encode_ids(tok, text: str) -> torch.LongTensor:
    """The tokenizer's ids for ``text`` with its specials, as ``AutoTokenizer(text)["input_ids"]``."""
    return torch.tensor(tok.encode(text).ids, dtype=torch.long)


def encode_lines(tok, lines: Sequence[str], dictionary) -> torch.LongTensor:
    """Lines as one text: the tokenizer's BOS once (when it puts one first), then each line's ids followed by
    EOS: what a data-bin of those lines gives eval-lm and training (``--bpe hf_byte_bpe``, BOS as the context;
    see :func:`toolkit.tasks.language_modeling.bos_as_context`), and what the tokenizer gives for the lines
    joined by its EOS token. A newline thus becomes EOS, never EOS followed by BOS."""
    first = tok.encode("").ids
    ids = [first[0]] if first and first[0] == dictionary.bos() != dictionary.eos() else []
    for line in lines:
        ids += tok.encode(line, add_special_tokens=False).ids + [dictionary.eos()]
    return torch.tensor(ids, dtype=torch.long)


def split_context(tokens: torch.Tensor, what: str) -> Tuple[int, torch.Tensor]:
    """(the first id, the ids after it): the context transformers starts from, and the ids it scores."""
    if len(tokens) < 2:
        raise UserError(
            f"{what}: {len(tokens)} id(s) after encoding; the first id is the context the model "
            f"starts from, so at least two are needed (lengthen the text)"
        )
    return int(tokens[0]), tokens[1:].long()


def group_by_context(prompts: Sequence[torch.Tensor], default: int) -> Dict[int, List[Tuple[int, torch.Tensor]]]:
    """Prompts (indices kept) grouped by their first id, each without it; an empty prompt starts from ``default``.

    Why: the generator puts one start symbol before every prompt of a batch; Llama's prompts all share
    BOS, a tokenizer without BOS starts each prompt with its own first token.
    """
    groups: Dict[int, List[Tuple[int, torch.Tensor]]] = {}
    for i, prompt in enumerate(prompts):
        start, rest = (int(prompt[0]), prompt[1:]) if len(prompt) else (default, prompt)
        groups.setdefault(start, []).append((i, rest.long()))
    return groups


def with_context(hypos: List[Dict[str, object]], start: int) -> List[Dict[str, object]]:
    """Hypotheses whose ``tokens`` begin with the context id again (the ids transformers' generate returns);
    ``positional_scores`` stay those of the ids after it."""
    return [dict(h, tokens=torch.cat([h["tokens"].new_tensor([start]), h["tokens"]])) for h in hypos]


def chat_ids(template, tok, messages: Sequence[Dict], where: str) -> torch.LongTensor:
    """``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``: the conversation rendered
    with the chat template (``toolkit.data.chat_template.ChatTemplate``) and encoded without the tokenizer's own
    specials (the template writes them); one line naming ``where`` for a conversation it cannot render."""
    from toolkit.data.chat_template import SkippedRecord

    try:
        text = template.prompt_text(messages, add_generation_prompt=True)
    except SkippedRecord as e:
        raise UserError(f"{where}: cannot render the conversation ({e.detail})") from None
    return torch.tensor(tok.encode(text, add_special_tokens=False).ids, dtype=torch.long)


def decode_ids(tok, tokens: torch.Tensor) -> str:
    """Text of the ids, specials dropped (``decode(..., skip_special_tokens=True)``)."""
    return tok.decode([int(t) for t in tokens], skip_special_tokens=True)
