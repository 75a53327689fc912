"""A rotary decoder family's transformers folders (saved by transformers) read as our checkpoint
(``toolkit-export --from hf``) and our model as one (``--format hf``), through the family's adapter (its
``hf.py``, an ``HFAdapter``: config.json <-> options and the tensor names). The exporter writes the folders
(``toolkit.export.hf_family``).

The folder written holds ``model.pt`` (a checkpoint as the trainer writes it), ``dict.txt``, the
model's own tokenizer files (``tokenizer.json`` as ``AutoTokenizer`` builds it, see :func:`reference_tokenizer`),
that tokenizer recorded as the folder's ``--bpe hf_byte_bpe``
(``bpe.json``: what ``toolkit-preprocess`` reads; the hub encodes with ``tokenizer.json`` itself, see
``toolkit/inference/model_tokenizer.py``) and
its ``config.json`` as ``hf_config.json`` (``--format hf`` writes the same class back from it).

Token ids stay the model's own: ``dict.txt`` is the tokenizer's vocabulary in id order
(``Dictionary.from_vocabulary``), followed by unused rows up to the embedding's ``vocab_size``
(Qwen2 has more rows than tokens). BOS and EOS are the config's; the dictionary's pad (targets
the loss ignores) must be an id text never encodes to: an unused row, else a pad token distinct
from EOS, else a special token named like a pad or reserved one, else the unknown token.

Continued pretraining: binarize text with ``toolkit-preprocess --srcdict OUT/dict.txt --bpe hf_byte_bpe
--bpe-model OUT/tokenizer.json`` (the pieces are the tokenizer's tokens, so the ids are its ids, and
each line or record ends with its EOS), then ``toolkit-train ... --finetune-from-model OUT/model.pt``, which
takes the model's conventions from the checkpoint (BOS first when the tokenizer puts it first, its context;
``hf_checkpoint.model_conventions``); the log prints both commands. (``--finetune-from-model``,
not ``--restore-file OUT/model.pt --reset-optimizer``: a run restarted after a crash then resumes from its
own ``checkpoint_last.pt`` instead of starting over from the imported weights.)

Weights are read tensor by tensor from the safetensors files (sharded or not) and converted to
fp32 as they come, so the import holds one copy of the model, never the original beside it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from toolkit.core.errors import UserError, malformed_file, read_json_object, require
from toolkit.core.protocols import HFCheckpoint, HFWeights
from toolkit.models.hf_checkpoint import (
    CHECKPOINT,
    check_every_tensor_read,
    check_finite,
    check_option_values,
    checkpoint,
    training_flags,
)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",  # transformers >= 4.5x saves the chat template beside tokenizer_config.json
)
HF_CONFIG = "hf_config.json"
UNUSED = "<toolkit_unused_{}>"
RESAVE = "save the model again with save_pretrained (or download the folder again)"


def _token_name(value) -> Optional[str]:
    return value.get("content") if isinstance(value, dict) else value


def _first_id(value) -> Optional[int]:
    return value[0] if isinstance(value, list) and value else value if isinstance(value, int) else None


def _pad_id(symbols: List[str], n_tokens: int, ids: Dict[str, Optional[int]], specials: List[int]) -> int:
    if len(symbols) > n_tokens:
        return n_tokens  # an unused row: no text encodes to it
    if ids["pad"] is not None and ids["pad"] not in (ids["eos"], ids["bos"]):
        return ids["pad"]
    for hint in ("pad", "reserved"):
        named = [i for i in specials if hint in symbols[i].lower() and i not in (ids["eos"], ids["bos"])]
        if named:
            return named[-1]
    if ids["unk"] is not None:
        return ids["unk"]
    raise UserError(
        "--from hf: the tokenizer has no pad, unknown or reserved token and the embedding no unused row; "
        "the loss needs an id no text encodes to (add a pad token to the tokenizer)"
    )


def reference_tokenizer(folder: str) -> str:
    """The folder's tokenizer as JSON, as transformers builds it: ``AutoTokenizer.from_pretrained(folder)``.

    Why not the file as it is: transformers builds some model types' tokenizers with their own class, whatever
    tokenizer.json holds (transformers 5's ``Qwen2Tokenizer`` puts Qwen2's digit-splitting pre-tokenizer and NFC
    normalizer over the file's vocabulary and merges), and the promise is ``AutoTokenizer``'s ids. Without
    transformers installed, the file (what ``PreTrainedTokenizerFast`` reads).
    """
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise UserError(
            f"--path {folder}: no tokenizer.json; save the tokenizer beside the model "
            "(tokenizer.save_pretrained) so the token ids stay the model's own"
        )
    try:
        import transformers
    except ImportError:
        return _load_tokenizer(path).to_str()
    _load_tokenizer(path)  # a file that is no tokenizer: one line naming it, before transformers' traceback
    _read_json(os.path.join(folder, "tokenizer_config.json"))  # likewise for its settings
    with malformed_file(os.path.join(folder, "config.json"), RESAVE, errors=(Exception,)):
        transformers.AutoConfig.from_pretrained(folder)  # AutoTokenizer reads it too: its errors are config.json's
    with malformed_file(path, RESAVE, errors=(Exception,)):
        backend = getattr(transformers.AutoTokenizer.from_pretrained(folder), "backend_tokenizer", None)
    if backend is None:
        raise UserError(
            f"--path {folder}: transformers builds no fast tokenizer from it; save one "
            "(tokenizer.json) so the token ids are the tokenizer's"
        )
    return backend.to_str()


def tokenizer_dictionary(folder: str, config: Dict[str, Any], tokenizer_json: str):
    """The tokenizer's vocabulary as a ``Dictionary`` with its own ids (see the module docstring)."""
    from toolkit.data.dictionary import Dictionary

    path = os.path.join(folder, "tokenizer.json")
    tokenizers = require("tokenizers", "tokenizers")
    with malformed_file(path, RESAVE, errors=(Exception,)):
        tok = tokenizers.Tokenizer.from_str(tokenizer_json)
    vocab = tok.get_vocab(with_added_tokens=True)
    n_tokens = len(vocab)
    if sorted(vocab.values()) != list(range(n_tokens)):
        raise UserError(f"{path}: token ids are not 0..{n_tokens - 1}; cannot keep them as they are")
    _check_token_ids(folder, config, n_tokens)
    symbols = sorted(vocab, key=vocab.get) + [UNUSED.format(i) for i in range(config["vocab_size"] - n_tokens)]
    tok_config = _read_json(os.path.join(folder, "tokenizer_config.json")) or {}
    unk_name = _token_name(tok_config.get("unk_token")) or json.loads(tokenizer_json)["model"].get("unk_token")
    ids = {
        "bos": _first_id(config.get("bos_token_id")),
        "eos": _first_id(config.get("eos_token_id")),
        "pad": _first_id(config.get("pad_token_id")) if _is_row(config.get("pad_token_id"), config) else None,
        "unk": vocab.get(unk_name) if unk_name else None,
    }
    if ids["eos"] is None:
        raise UserError(f"{folder}/config.json: no eos_token_id; the toolkit's LM data ends documents with it")
    specials = [i for i, added in tok.get_added_tokens_decoder().items() if added.special]
    pad = _pad_id(symbols, n_tokens, ids, specials)
    bos = ids["bos"] if ids["bos"] is not None else ids["eos"]
    try:
        return Dictionary.from_vocabulary(
            symbols, bos=bos, pad=pad, eos=ids["eos"], unk=ids["unk"] if ids["unk"] is not None else pad
        )
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None


def _check_token_ids(folder: str, config: Dict[str, Any], n_tokens: int) -> None:
    """config.json's vocab_size holds the tokenizer's ids, and its BOS and EOS ids are rows of it (refused naming
    config.json, the file to fix, not the tokenizer's). A pad id outside them is read as none (older Llama
    configs write -1): the dictionary picks its own, see :func:`_pad_id`."""
    where, size = os.path.join(folder, "config.json"), config.get("vocab_size")
    if type(size) is not int or size < n_tokens:
        raise UserError(
            f"{where}: vocab_size {size!r} is not a count of at least the tokenizer's {n_tokens} ids "
            "(tokenizer.json); give the config.json saved with the model"
        )
    for key in ("bos_token_id", "eos_token_id"):
        if config.get(key) is not None and not _is_row(config[key], config):
            raise UserError(
                f"{where}: {key} {config[key]!r} is not a token id of the vocabulary (0..{size - 1}); "
                "give the config.json saved with the model"
            )


def _is_row(value, config: Dict[str, Any]) -> bool:
    first = _first_id(value)
    return type(first) is int and 0 <= first < config["vocab_size"]


def _load_tokenizer(path: str):
    """The ``tokenizers.Tokenizer`` saved in ``path``; one line naming the file when it is not one."""
    tokenizers = require("tokenizers", "tokenizers")
    with malformed_file(path, RESAVE, errors=(Exception,)):  # tokenizers raises a plain Exception
        return tokenizers.Tokenizer.from_file(path)


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    return read_json_object(path, RESAVE) if os.path.isfile(path) else None


def _safetensors_files(folder: str) -> Tuple[List[str], Dict[str, str]]:
    """The folder's safetensors files, and the index's tensor -> file map (empty for one ``model.safetensors``)."""
    index_path = os.path.join(folder, "model.safetensors.index.json")
    index = _read_json(index_path)
    if index is not None:
        with malformed_file(index_path, RESAVE):
            weight_map = {name: _inside(folder, file, index_path) for name, file in index["weight_map"].items()}
        return sorted(set(weight_map.values())), weight_map
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single], {}
    raise UserError(
        f"--path {folder}: no model.safetensors or model.safetensors.index.json; save with "
        "safe_serialization (the default of save_pretrained)"
    )


def _inside(folder: str, name: Any, index_path: str) -> str:
    """``folder/name`` for a file name of the index that stays in ``folder``; anything else (an absolute path,
    ``..``) is refused: the index says where the model's shards are, never which other file to read. (A
    symlink in the folder is followed: the Hugging Face cache's snapshot folders are links into its blobs.)"""
    parts = name.replace("\\", "/").split("/") if isinstance(name, str) else []
    if not parts or os.path.isabs(name) or any(p in ("", ".", "..") for p in parts):
        raise UserError(
            f"{index_path}: weight_map names {name!r}, not a file inside {folder}; an index names its shards "
            f"by their names in the folder (model-00001-of-00002.safetensors); {RESAVE}"
        )
    return os.path.join(folder, *parts)


def _open_shard(path: str):
    """safe_open(``path``), one line naming it when it is missing or no safetensors file."""
    safe_open = require("safetensors", "safetensors").safe_open
    if not os.path.isfile(path):
        raise UserError(f"{path}: missing (model.safetensors.index.json names it); {RESAVE}")
    with malformed_file(path, RESAVE, errors=(Exception,)):  # SafetensorError: cut short, not safetensors
        return safe_open(path, framework="pt")


def tensor_names(folder: str) -> List[str]:
    """The names of the tensors in the folder's safetensors shards (the index's, else the file's header)."""
    files, weight_map = _safetensors_files(folder)
    if weight_map:
        return sorted(weight_map)
    with _open_shard(files[0]) as f:
        return list(f.keys())


def safetensors_tensors(folder: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the folder's safetensors shards, read one at a time; a NaN or
    infinite value is refused naming the tensor (``hf_checkpoint.check_finite``)."""
    for path in _safetensors_files(folder)[0]:
        with _open_shard(path) as f:
            for name in f.keys():
                with malformed_file(path, RESAVE, errors=(Exception,)):
                    tensor = f.get_tensor(name)
                check_finite(name, tensor, path)
                yield name, tensor


def check_folder_holds(folder: str, needed: Dict[str, Tuple[int, ...]]) -> None:
    """Every tensor ``needed`` (name -> shape) is in the folder's safetensors files with that shape, read from
    their headers before any weight is (``hf_checkpoint.check_every_tensor_read``)."""
    files, weight_map = _safetensors_files(folder)
    found: Dict[str, Tuple[str, Tuple[int, ...]]] = {}
    for path in files:
        with _open_shard(path) as f:
            for name in f.keys():
                with malformed_file(path, RESAVE, errors=(Exception,)):
                    found[name] = (path, tuple(f.get_slice(name).get_shape()))
    index = os.path.join(folder, "model.safetensors.index.json")
    check_every_tensor_read(found, needed, lambda name: weight_map.get(name, index if weight_map else files[0]))


def check_state(state: Dict[str, torch.Tensor], model: torch.nn.Module, folder: str) -> None:
    """Every tensor of our model present with its shape, nothing left over (one line otherwise)."""
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    wrong = [k for k in want if k in state and tuple(state[k].shape) != want[k]]
    if missing or extra or wrong:
        raise UserError(
            f"--path {folder}: weights do not match config.json (missing {missing[:3]}, unexpected "
            f"{extra[:3]}, other shapes {wrong[:3]})"
        )


def read_folder(
    adapter,
    folder: str,
    config: Dict[str, Any],
    out_dir: str,
    tokens_per_sample: Optional[int],
    advance,
) -> HFCheckpoint:
    """The model in ``folder`` (a class of ``adapter``'s family) as our checkpoint (``out_dir``: where it will be
    written): options and tensors through the adapter; the tokenizer, dictionary and checkpoint made here."""
    from toolkit import models

    given = adapter.options_from_hf(config, os.path.join(folder, "config.json"))
    tokenizer_json = reference_tokenizer(folder)
    dictionary = tokenizer_dictionary(folder, config, tokenizer_json)
    advance(
        f"{folder}: {config['model_type']}, {given['decoder_layers']} layers, tokenizer of "
        f"{len(dictionary)} ids (bos {dictionary.bos()}, eos {dictionary.eos()}, pad {dictionary.pad()})"
    )
    arch = models.matching_arch(adapter.FAMILY, given)
    model = _checked_model(adapter, folder, config, arch, given, len(dictionary), dictionary.pad())
    state = adapter.state_from_hf(safetensors_tensors(folder), given, config["model_type"])
    check_state(state, model, folder)
    advance(f"converted to --arch {arch} ({len(state)} tensors)")
    add_bos = _adds_bos(tokenizer_json, dictionary)  # BOS is read as context: a sample stays tokens_per_sample long
    tokens_per_sample = tokens_per_sample or min(given["max_target_positions"], 2048)
    ckpt = checkpoint(state, arch, given, out_dir, tokens_per_sample, add_bos)
    copied = [name for name in TOKENIZER_FILES[1:] if os.path.isfile(os.path.join(folder, name))]
    files = {**{name: os.path.join(folder, name) for name in copied}, HF_CONFIG: os.path.join(folder, "config.json")}
    # bpe.json: the hub (from_pretrained(OUT, "model.pt")) and eval tokenize with the model's tokenizer
    bpe = ("hf_byte_bpe", {"bpe_model": "tokenizer.json"})
    log = (
        f"binarize with: toolkit-preprocess --only-source --srcdict {os.path.join(out_dir, 'dict.txt')} "
        f"--bpe hf_byte_bpe --bpe-model {os.path.join(out_dir, 'tokenizer.json')} --trainpref ... --destdir DATA",
        f"fine-tune with: toolkit-train DATA {training_flags(arch, given)} --tokens-per-sample "
        f"{tokens_per_sample} --finetune-from-model {os.path.join(out_dir, CHECKPOINT)}",
    )
    return HFCheckpoint(
        ckpt,
        dictionary,
        f"wrote {CHECKPOINT} and dict.txt",
        f"wrote tokenizer.json as AutoTokenizer builds it, copied {', '.join(copied)}, config.json as "
        f"{HF_CONFIG}, and the tokenizer as --bpe hf_byte_bpe",
        files,
        bpe,
        log,
        dictionary_hash=True,
        texts={"tokenizer.json": tokenizer_json},
    )


def _checked_model(adapter, folder: str, config: Dict[str, Any], arch: str, given, vocab_size: int, pad: int):
    """Our model on the meta device, once config.json's values pass toolkit-train's checks (naming the config
    key, ``adapter.config_keys``), its size fits this machine (the import holds it in fp32) and the folder holds
    every tensor it needs, with its shape (read from the safetensors headers, before any weight)."""
    from toolkit import models
    from toolkit.core import preflight, registry

    where = os.path.join(folder, "config.json")
    check_option_values(registry.resolve_arch(arch).config, given, where, adapter.config_keys(config))
    try:
        model = models.build_on_meta(arch, vocab_size, padding_idx=pad, **given)
    except UserError as e:  # a combination of values toolkit-train refuses, named by its flags
        raise UserError(f"{where}: {e}") from None
    parameters = models.count_params(model)[0]
    preflight.check_fits_memory(
        f"{where}: the model",
        parameters,
        4 * parameters,
        1,
        preflight.physical_memory(),
        "the import holds the model in fp32: give the config.json saved with the model, on a larger machine",
    )
    needed = adapter.state_to_hf(model.state_dict(), config["model_type"])
    check_folder_holds(folder, {name: tuple(t.shape) for name, t in needed.items()})
    return model


def _adds_bos(tokenizer_json: str, dictionary) -> bool:
    """Whether the tokenizer puts BOS before a text (what its post-processor makes of the empty text)."""
    tokenizers = require("tokenizers", "tokenizers")
    ids = tokenizers.Tokenizer.from_str(tokenizer_json).encode("").ids
    return bool(ids) and ids[0] == dictionary.bos() != dictionary.eos()


# ---- --format hf: the same class back -----------------------------------------------------------


def _token_ids(dictionary, first_symbol: int, base: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The imported model's own token ids, else the dictionary's (BOS = what our LMs see first)."""
    if base is not None:
        return {k: base[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in base}
    return {"bos_token_id": first_symbol, "eos_token_id": dictionary.eos(), "pad_token_id": dictionary.pad()}


def own_tokenizer_files(data_dir: str, dictionary) -> Dict[str, str]:
    """{name in the export: path} of the model's own tokenizer files; empty when ``dict.txt`` is no tokenizer's
    vocabulary. Found in the import's folder, or in a data-bin binarized with the import's command: its copy of
    tokenizer.json (``hf_byte_bpe.json``), the other files and ``hf_config.json`` from the folder its
    ``bpe.json`` records the tokenizer came from, while that folder still holds the same tokenizer.json."""
    if not dictionary.fixed_ids:
        return {}
    if os.path.isfile(os.path.join(data_dir, "tokenizer.json")):
        home: Optional[str] = data_dir
        files = {}
    else:
        copy = os.path.join(data_dir, "hf_byte_bpe.json")
        if not os.path.isfile(copy):
            return {}
        files = {"tokenizer.json": copy}
        source = ((_read_json(os.path.join(data_dir, "bpe.json")) or {}).get("source") or {}).get("bpe_model")
        home = os.path.dirname(source) if source and _same_bytes(source, copy) else None
    for name in TOKENIZER_FILES + (HF_CONFIG,):
        if home is not None and os.path.isfile(os.path.join(home, name)):
            files.setdefault(name, os.path.join(home, name))
    return files


def _same_bytes(a: str, b: str) -> bool:
    if not os.path.isfile(a):
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def hf_weights(adapter, model, hf_class: str, dictionary, first_symbol: int, data_dir: str) -> HFWeights:
    """The imported class (from ``hf_config.json``), else the class its options need (the adapter's); the
    model's own tokenizer files wherever ``data_dir`` leads to them (:func:`own_tokenizer_files`)."""
    if hf_class != "auto":
        raise UserError(
            f"--hf-class {hf_class}: applies to transformer_lm; a {adapter.FAMILY} model is written as "
            f"its own class (one of {', '.join(adapter.CLASSES.values())}); nothing written"
        )
    files = own_tokenizer_files(data_dir, dictionary)
    base = _read_json(files.pop(HF_CONFIG)) if HF_CONFIG in files else None
    architecture, config = adapter.hf_config(model.cfg, len(dictionary), base)
    config.update(_token_ids(dictionary, first_symbol, base))
    state = adapter.state_to_hf(model.state_dict(), config["model_type"])
    return HFWeights(architecture, config, state, files)
