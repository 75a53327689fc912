"""torch.hub / ``from_pretrained`` interface: text in, scores and samples out.

The data-bin's tokenizer (whitespace or the BPE it was built with) is applied,
so users pass raw sentences. fairseq's hub methods and keywords (``cfg``, ``src_dict``, ``binarize``,
``score([...])``, ``bpe=``, ...) come from :mod:`toolkit.compat.fairseq.hub`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Dict, List, Optional, Tuple, Union

import torch

from toolkit import inference
from toolkit.compat.fairseq import adapter as fairseq_adapter
from toolkit import ops
from toolkit.core import registry
from toolkit.core.errors import UserError
from toolkit.generation import GenerationConfig, SequenceGenerator
from toolkit.inference import model_tokenizer as hf_ids
from toolkit.compat.fairseq.hub import (
    FairseqHubMethods,
    build_bpe_kwarg,
    build_tokenizer_kwarg,
    checkpoint_path,
    split_hub_kwargs,
)

logger = logging.getLogger("toolkit.hub_utils")  # the logger name log lines and filters already use


def from_pretrained(
    model_name_or_path: str,
    checkpoint_file: Optional[str] = None,
    data_name_or_path: str = ".",
    device: Optional[str] = None,
    cpu_matmul: str = "auto",
    **kwargs,
) -> LMHubInterface:
    """``model_name_or_path`` is a folder holding the checkpoint; the data-bin path is relative to it.

    With no ``checkpoint_file``, the folder's ``model.pt`` (fairseq's release name), else
    ``checkpoint_best.pt``, ``checkpoint_last.pt``, or the ``model.safetensors`` a ``toolkit-export
    --format safetensors`` folder holds (beside ``config.json`` and ``dict.txt``; loaded with no pickle).
    fairseq's keywords: ``bpe=`` / ``tokenizer=`` (with their options, e.g. ``gpt2_encoder_json=``)
    choose the text processing (default: the data-bin's recorded BPE); ``user_dir=`` imports a plugin
    folder first; the rest override saved options. ``cpu_matmul``: the commands' ``--cpu-matmul`` (fp32 products
    on a CPU by oneDNN or torch's BLAS, ``toolkit.ops``), for the process from here on.
    """
    path = checkpoint_path(model_name_or_path, checkpoint_file)
    data = data_folder(model_name_or_path, data_name_or_path, path)
    bpe_name, tokenizer_name, rest = split_hub_kwargs(kwargs)
    if rest.get("user_dir"):  # fairseq's keyword: the plugin folder that registers the model
        registry.import_user_module(rest.pop("user_dir"))
    tokenizer = build_tokenizer_kwarg(tokenizer_name, rest)
    bpe = build_bpe_kwarg(bpe_name, data.split(":")[0], rest)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ops.select(cpu_matmul, dev)
    models, task, args = inference.load_ensemble(path, data, dev, overrides=rest or None)
    own = None  # an imported model's own tokenizer, unless bpe=/tokenizer= choose the text processing
    if bpe_name is None and tokenizer_name is None:
        own = hf_ids.load_model_tokenizer(task.model_files_dir(), task.dictionary)
    models = [fairseq_adapter.with_fairseq_outputs(m) for m in models]  # hub.models[0](src): (logits, extra)
    return LMHubInterface(models, task, args, tokenizer=tokenizer, bpe=bpe, model_tokenizer=own)


def data_folder(model_name_or_path: str, data_name_or_path: str, checkpoint: str) -> str:
    """The data-bin(s) of ``data_name_or_path`` (':'-separated shards): fairseq's rule first (a path starting with
    '.' is relative to the model folder, any other as given), then relative to the model folder. A folder without
    ``dict.txt`` is one line naming the data-bin the checkpoint was trained on, so pointing at a training run's
    save dir says what to pass instead."""
    shards = data_name_or_path.split(":")
    readings = [[os.path.join(model_name_or_path, shard) for shard in shards]]
    if not shards[0].startswith("."):
        readings.insert(0, shards)
    for reading in readings:
        if os.path.isfile(os.path.join(reading[0], "dict.txt")):
            return ":".join(reading)
    trained_on = _recorded_data(checkpoint)
    hint = f"; the checkpoint was trained on {trained_on}" if trained_on else ""
    raise UserError(
        f"data_name_or_path={data_name_or_path!r}: {readings[-1][0]} holds no dict.txt (not a data-bin made by "
        f"toolkit-preprocess){hint}; pass that data-bin as data_name_or_path (absolute, relative to the working "
        f"directory, or './...' relative to {model_name_or_path})"
    )


def _recorded_data(checkpoint: str) -> Optional[str]:
    """The data-bin a toolkit checkpoint records (``cfg['data']``), if it can be read cheaply; else None."""
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
        return str(state["cfg"]["data"]).split(":")[0]
    except Exception:
        return None


class LMHubInterface(FairseqHubMethods, torch.nn.Module):
    """``model_tokenizer``: an imported model's own tokenizer (:mod:`toolkit.inference.model_tokenizer`);
    then ``encode`` gives its ids exactly, and ``score``/``generate`` read them as transformers does."""

    def __init__(self, models: List[torch.nn.Module], task, args, tokenizer=None, bpe=None, model_tokenizer=None):
        super().__init__()
        self.models = torch.nn.ModuleList(models)
        self.task, self.args, self.tokenizer, self.bpe = task, args, tokenizer, bpe
        self.model_tokenizer = model_tokenizer
        self.dictionary = task.dictionary

    def encode(self, sentence: str) -> torch.LongTensor:
        if self.model_tokenizer is not None:
            return hf_ids.encode_ids(self.model_tokenizer, sentence)
        return super().encode(sentence)

    def encode_lines(self, lines: List[str]) -> torch.LongTensor:
        """With the model's own tokenizer: BOS (when it puts one first) once, then each line's ids and EOS, as
        eval-lm and training read a data-bin of those lines; never BOS in the middle of the text."""
        if self.model_tokenizer is not None:
            return hf_ids.encode_lines(self.model_tokenizer, lines, self.dictionary)
        return super().encode_lines(lines)

    def decode(self, tokens: torch.Tensor) -> str:
        if self.model_tokenizer is not None:
            return hf_ids.decode_ids(self.model_tokenizer, tokens)
        return super().decode(tokens)

    @property
    def device(self) -> torch.device:
        return next(self.models[0].parameters()).device

    @property
    def max_positions(self) -> int:
        """The model's context: the most positions one forward pass reads (the least of an ensemble's)."""
        return min(int(m.max_positions()) for m in self.models)

    def scoring_window(self, tokens_per_sample: Optional[int] = None, context_window: int = 0) -> Tuple[int, int]:
        """(ids scored per forward pass, earlier ids read before them): by default the model's whole context
        (``max_positions``) and no overlap; ``tokens_per_sample`` + ``context_window`` choose (eval-lm's names and
        meaning), within the model's positions."""
        window = self.max_positions if tokens_per_sample is None else int(tokens_per_sample)
        context_window = int(context_window)
        if window < 1 or context_window < 0 or window + context_window > self.max_positions:
            raise UserError(
                f"score: tokens_per_sample {window} + context_window {context_window} must be within the "
                f"model's {self.max_positions} positions (tokens_per_sample >= 1, context_window >= 0)"
            )
        return window, context_window

    @torch.no_grad()
    def score_tokens(
        self, tokens: torch.Tensor, tokens_per_sample: Optional[int] = None, context_window: int = 0, **kwargs
    ) -> Dict[str, object]:
        """Per-token log-probabilities (natural log) of encoded tokens and their perplexity.

        With the model's own tokenizer the first id is the context (``tokens`` are then the ids after it);
        else every token is scored after ``</s>``, as fairseq's hub does. A text within the model's context
        (``max_positions``) is scored in one pass, as transformers scores it; a longer one in windows of that
        many ids, each after ``context_window`` earlier ids (one INFO line says so); ``tokens_per_sample``
        and ``context_window`` choose the window (:meth:`scoring_window`), which the result names.
        """
        first = self.dictionary.eos()
        if self.model_tokenizer is not None:
            first, tokens = hf_ids.split_context(tokens, "score")
        window, context_window = self.scoring_window(tokens_per_sample, context_window)
        if len(tokens) > window:
            logger.info(
                f"score: {len(tokens):,} ids scored in windows of {window} (the model's context is "
                f"{self.max_positions} positions), each after {context_window} earlier ids; "
                f"score(..., tokens_per_sample=N, context_window=M) chooses"
            )
        lprobs = inference.score_stream(
            list(self.models), tokens, first, window, context_window=context_window, device=self.device
        )
        return {
            "tokens": tokens,
            "positional_scores": lprobs,
            "score": lprobs.mean().item(),
            "perplexity": math.exp(-lprobs.mean().item()),
            "window": {"tokens_per_sample": window, "context_window": context_window},
        }

    @torch.no_grad()
    def sample(
        self, sentences: Union[str, List[str]] = "", beam: int = 1, verbose: bool = False, **kwargs
    ) -> Union[str, List[str]]:
        """Continue each prompt (fairseq's ``sample``): the best hypothesis, prompt included, as text.

        Keyword arguments are fairseq's generation names (``sampling``, ``sampling_topk``,
        ``sampling_topp``, ``temperature``, ``max_len_a``, ``max_len_b``, ``min_len``, ``lenpen``,
        ``unkpen``, ``no_repeat_ngram_size``) plus ``seed`` and the short forms ``topk``, ``topp``
        and ``max_len`` (at most this many new tokens). Top-k / top-p imply ``sampling=True``.
        """
        if isinstance(sentences, str):
            return self.sample([sentences], beam=beam, verbose=verbose, **kwargs)[0]
        hypos = self.generate([self.encode(s) for s in sentences], beam=beam, verbose=verbose, **kwargs)
        return [self.decode(h[0]["tokens"]) for h in hypos]

    @torch.no_grad()
    def chat(self, messages: List[Dict[str, str]], chat_template: Optional[str] = None, beam: int = 1, **kwargs) -> str:
        """The assistant's reply to ``messages`` (``[{"role": "user", "content": ...}, ...]``): the conversation
        rendered with the model's chat template (its folder's, or ``chat_template``: a tokenizer folder,
        ``tokenizer_config.json`` or ``.jinja``) and its generation prompt, encoded as transformers'
        ``apply_chat_template(tokenize=True)``; the tokens generated after it, decoded. ``kwargs``: as
        :meth:`sample`'s."""
        from toolkit.data.chat_template import ChatTemplate

        if self.model_tokenizer is None:
            raise UserError("chat: needs the model's own tokenizer (a model imported with toolkit-export --from hf)")
        template = ChatTemplate.load(chat_template or self.task.model_files_dir())
        prompt = hf_ids.chat_ids(template, self.model_tokenizer, messages, "chat")
        best = self.generate(prompt, beam=beam, **kwargs)[0]
        return self.decode(best["tokens"][len(prompt) :]).strip()

    @torch.no_grad()
    def generate(
        self,
        tokenized_sentences: Union[torch.Tensor, List[torch.Tensor]],
        beam: int = 5,
        verbose: bool = False,
        batch_size: int = 16,
        **kwargs,
    ) -> List[List[Dict[str, object]]]:
        """Hypotheses (``tokens``, ``score``, ``positional_scores``; natural log) per encoded prompt.

        With the model's own tokenizer each prompt's first id is the context it starts from (prompts are
        batched by it) and comes back at the front of ``tokens``, as in transformers' ``generate``.
        """
        if torch.is_tensor(tokenized_sentences) and tokenized_sentences.dim() == 1:
            return self.generate([tokenized_sentences], beam, verbose, batch_size, **kwargs)[0]
        seed = kwargs.pop("seed", None)
        cfg = hub_generation_config(beam, kwargs)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        start = self.dictionary.bos() if self.args_add_bos else self.dictionary.eos()
        prompts = [strip_eos(t, self.dictionary.eos()) for t in tokenized_sentences]
        groups = (
            hf_ids.group_by_context(prompts, start)
            if self.model_tokenizer is not None
            else {start: list(enumerate(prompts))}
        )
        out: List[List[Dict[str, object]]] = [[] for _ in prompts]
        for first, group in groups.items():
            gen = SequenceGenerator(list(self.models), self.dictionary, cfg, generator=generator, bos=first)
            for i in range(0, len(group), batch_size):
                chunk = group[i : i + batch_size]
                hypos_of_chunk = gen.generate([p for _, p in chunk])
                for (index, _), hypos in zip(chunk, hypos_of_chunk):
                    out[index] = hf_ids.with_context(hypos, first) if self.model_tokenizer is not None else hypos
        if verbose:
            for prompt, hypos in zip(prompts, out):
                logger.info(f"S\t{self.dictionary.string(prompt)}")
                for h in hypos:
                    logger.info(f"H\t{h['score']}\t{self.decode(h['tokens'])}")
                    logger.info("P\t" + " ".join(f"{x:.4f}" for x in h["positional_scores"].tolist()))
        return out

    @property
    def args_add_bos(self) -> bool:
        return bool(vars(self.args).get("add_bos_token", False))


#: the hub's short names for fairseq's generation options
HUB_ALIASES = {"topk": "sampling_topk", "topp": "sampling_topp", "max_len": "max_new_tokens"}


def hub_generation_config(beam: int, kwargs: Dict[str, object]) -> GenerationConfig:
    """fairseq's generation kwargs (and the hub's short forms) as a GenerationConfig."""
    names = {f.name for f in dataclasses.fields(GenerationConfig)}
    values: Dict[str, object] = {"beam": beam}
    for key, value in kwargs.items():
        name = HUB_ALIASES.get(key, key)
        if name not in names:
            raise UserError(
                f"generate(): unknown argument {key!r}; use fairseq's generation names "
                f"({', '.join(sorted(names - {'max_new_tokens'}))}) or {', '.join(HUB_ALIASES)}"
            )
        values[name] = value
    truncated = values.get("sampling_topk", -1) > 0 or values.get("sampling_topp", -1.0) > 0
    if values.get("sampling") is None:
        values["sampling"] = truncated
    values.setdefault("nbest", beam)
    return GenerationConfig(**values)


def strip_eos(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """A prompt is the sentence without its final </s> (fairseq's build_dataset_for_inference)."""
    tokens = tokens.long()
    return tokens[:-1] if len(tokens) and int(tokens[-1]) == eos else tokens
