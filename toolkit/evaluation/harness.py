"""lm-evaluation-harness on toolkit models: ``ToolkitLM``, an ``lm_eval`` model (``--model toolkit``).

    import lm_eval
    from toolkit.evaluation.harness import ToolkitLM
    lm = ToolkitLM(path="checkpoints/checkpoint_best.pt", batch_size=16)
    results = lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

What it computes is what ``lm_eval --model hf`` computes with its default ``model_args`` on this model's
Hugging Face export (``toolkit-export --format hf``), request by request. The user compares against that
command as it is, so every step below is ``HFLM``'s (lm_eval 0.4's ``models/huggingface.py``):

- ``tok_encode`` is the exported tokenizer's default encoding (:mod:`toolkit.evaluation.text`): its
  specials included, i.e. the symbol the LM sees before a text first (``</s>``, ``<s>`` with
  ``--add-bos-token``, an imported Llama's BOS; an imported Qwen2 adds none); ``prefix_token_id`` is the
  tokenizer's BOS, else its EOS;
- ``loglikelihood``: the harness's ``TemplateLM`` splits context and continuation; batched, longest first,
  inputs truncated from the left to ``max_length`` (the model's positions), scored by the model's
  ``get_normalized_probs`` (:mod:`toolkit.evaluation.scoring`);
- ``loglikelihood_rolling``: the document's default encoding (so the leading symbol is scored too, as
  ``hf`` scores it), cut by ``lm_eval.utils.get_rolling_token_windows`` with ``max_length`` and
  ``prefix_token_id``, each window a ``loglikelihood`` request; ``context_window`` > 0 gives every window
  after the first that many more tokens of context (the windows' ``context_len`` - 1; ``hf``: 0);
- ``generate_until``: the context's default encoding, its last ``max_length - max_gen_toks`` ids, the
  first of them the start symbol; the KV-cache ``SequenceGenerator`` (greedy, or sampling with
  ``temperature``/``top_k``/``top_p``), stopping at the stop strings or EOS or ``max_gen_toks``.
"""

from __future__ import annotations

import json
import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from toolkit import ops
from toolkit.core.errors import UserError

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import (
        handle_stop_sequences,
        has_bos_prefix,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError:  # pragma: no cover - the command says how to install it
    raise UserError("lm-eval is not installed; pip install lm-eval (or: pip install toolkit[eval])") from None

from toolkit.evaluation import scoring
from toolkit.evaluation.loading import load_for_eval
from toolkit.evaluation.text import TextCodec
from toolkit.generation import GenerationConfig, SequenceGenerator
from toolkit.inference.model_tokenizer import group_by_context

logger = logging.getLogger(__name__)

#: generation kwargs the generator implements (anything else is refused rather than ignored)
GEN_KWARGS = {"do_sample", "temperature", "top_k", "top_p", "until", "max_gen_toks"}


def _last(ids: List[int], n: int) -> List[int]:
    """The last ``n`` ids (none for n <= 0): the harness's left truncation."""
    return ids[max(0, len(ids) - n) :] if n > 0 else []


@register_model("toolkit")
class ToolkitLM(TemplateLM):
    """A toolkit checkpoint (or models already in memory) as an ``lm_eval`` model. ``cpu_matmul``: the process's
    fp32 CPU matmul library (``--cpu-matmul``, ``toolkit.ops.select``); None keeps the one chosen before (a harness
    run inside training), else ``auto``."""

    backend = "causal"

    def __init__(
        self,
        path: Optional[str] = None,
        data: Optional[str] = None,
        batch_size: int = 8,
        device: Optional[str] = None,
        context_window: int = 0,
        max_gen_toks: int = 256,
        seed: int = 1234,
        models: Optional[List[torch.nn.Module]] = None,
        task=None,
        add_bos_token: Optional[bool] = None,
        cpu_matmul: Optional[str] = None,
        chat_template: Optional[str] = None,
    ):
        super().__init__()
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        ops.select(cpu_matmul, self._device)
        if models is None:
            if path is None:
                raise UserError("--path is required: the checkpoint to evaluate")
            model, task, args = load_for_eval(path, data, self._device)
            models, add_bos_token = [model], bool(vars(args).get("add_bos_token", False))
        self.models, self.task = list(models), task
        self.dictionary = task.dictionary
        bos = task.cfg.add_bos_token if add_bos_token is None else add_bos_token
        self.codec = TextCodec(self.dictionary, task.model_files_dir(), bool(bos))
        self.batch_size = int(batch_size)
        self.max_length = min(m.max_positions() for m in self.models)
        self.context_window = int(context_window)
        self._max_gen_toks, self.seed = int(max_gen_toks), int(seed)
        self._chat_spec, self._chat = chat_template, None
        if not 0 <= self.context_window < self.max_length:
            raise UserError(
                f"--context-window {context_window}: must be in [0, {self.max_length}) (the model's positions)"
            )

    # ---- identity ----

    @property
    def eot_token_id(self) -> int:
        return self.dictionary.eos()

    @property
    def prefix_token_id(self) -> int:
        return self.codec.prefix

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return f"toolkit-{self.codec.kind}-{len(self.dictionary)}"

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> List[int]:
        """The exported tokenizer's ids: its specials unless ``add_special_tokens=False`` or the text already
        starts with the prefix symbol's string (``HFLM.tok_encode``)."""
        if add_special_tokens is None and has_bos_prefix(string, self.codec.token_string(self.prefix_token_id)):
            add_special_tokens = False
        return self.codec.encode(string) if add_special_tokens is False else self.codec.encode_with_specials(string)

    def tok_decode(self, tokens: Sequence[int], **kwargs) -> str:
        return self.codec.decode(tokens)

    # ---- chat template (lm_eval --apply_chat_template) ----

    def _template(self):
        """The model's chat template (its folder's, or ``chat_template``), loaded at first use."""
        if self._chat is None:
            from toolkit.data.chat_template import ChatTemplate

            self._chat = ChatTemplate.load(self._chat_spec or self.task.model_files_dir())
        return self._chat

    def chat_template(self, chat_template=False) -> str:
        """The template's text (the harness keys its request cache on it)."""
        return self._template().text if chat_template else ""

    def apply_chat_template(self, chat_history: List[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        """``HFLM.apply_chat_template``: the tokenizer's ``apply_chat_template(tokenize=False,
        continue_final_message=not add_generation_prompt)``, retried without the system turns where the
        template cannot render them. The text is then encoded as any context (``tok_encode``: no specials added
        when it starts with the prefix symbol's string, as a template that writes ``bos_token`` does)."""
        from toolkit.data.chat_template import SkippedRecord

        try:
            return self._template().prompt_text(chat_history, add_generation_prompt)
        except SkippedRecord:
            logger.warning("Failed to apply chat template. removing the system role in chat history.")
            rest = [m for m in chat_history if m["role"] != "system"]
            try:
                return self._template().prompt_text(rest, add_generation_prompt)
            except SkippedRecord as e:
                raise UserError(f"--apply-chat-template: {self._template().source} cannot render a request ({e})")

    # ---- scoring ----

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> List[Tuple[float, bool]]:
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        results = scoring.loglikelihood_tokens(
            self.models, pairs, self.max_length, self.dictionary.pad(), self.batch_size, self._device
        )
        for (request, _, _), answer in zip(requests, results):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        """``HFLM.loglikelihood_rolling``: the windows of every document scored as loglikelihood requests."""
        windows, owner = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for context, continuation in rolling_windows(
                self.tok_encode(string), self.prefix_token_id, self.max_length, self.context_window
            ):
                windows.append((None, context, continuation))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[index] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation ----

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        groups: Dict[str, List[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out: List[str] = [""] * len(requests)
        for indices in groups.values():
            contexts = [requests[i].args[0] for i in indices]
            for i, text in zip(indices, self._generate_group(contexts, requests[indices[0]].args[1])):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    def _generate_group(self, contexts: List[str], gen_kwargs: dict) -> List[str]:
        """Continuations of ``contexts`` sharing one set of generation kwargs, in their order."""
        kwargs = dict(normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks))
        unknown = sorted(set(kwargs) - GEN_KWARGS)
        if unknown:
            raise UserError(
                f"generate_until: generation arguments {unknown} are not implemented by the toolkit's "
                f"generator (it implements {sorted(GEN_KWARGS)})"
            )
        until = handle_stop_sequences(kwargs["until"], eos=self.codec.token_string(self.eot_token_id))
        max_gen = kwargs["max_gen_toks"]
        if max_gen >= self.max_length:
            raise UserError(
                f"generate_until: max_gen_toks {max_gen} must be less than the model's {self.max_length} positions"
            )
        # HFLM: the default encoding, left-truncated to max_length - max_gen; its first id is the start symbol
        prompts = [
            torch.tensor(_last(self.tok_encode(c), self.max_length - max_gen), dtype=torch.long) for c in contexts
        ]
        config = self._generation_config(kwargs, max_gen)

        def stop(_: int, tokens: torch.Tensor) -> bool:
            text = self.codec.decode(tokens.tolist())
            return any(s and s in text for s in until)

        texts: List[str] = [""] * len(prompts)
        for start, members in group_by_context(prompts, self.prefix_token_id).items():
            generator = SequenceGenerator(
                self.models,
                self.dictionary,
                config,
                bos=start,
                generator=torch.Generator(device=self._device).manual_seed(self.seed),
            )
            members = sorted(members, key=lambda m: -len(m[1]))
            for first in range(0, len(members), max(1, self.batch_size)):
                chunk = members[first : first + max(1, self.batch_size)]
                hypos = generator.generate([rest for _, rest in chunk], stop=stop)
                for (i, rest), hyps in zip(chunk, hypos):
                    tokens = hyps[0]["tokens"][len(rest) :].tolist()
                    tokens = tokens[:-1] if tokens and tokens[-1] == self.eot_token_id else tokens
                    texts[i] = postprocess_generated_text(self.codec.decode(tokens), until, None)
        return texts

    def _generation_config(self, kwargs: dict, max_gen: int) -> GenerationConfig:
        sampling = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature") or 0.0) > 0
        return GenerationConfig(
            beam=1,
            nbest=1,
            sampling=sampling,
            min_len=0,
            max_len_a=0.0,
            max_len_b=self.max_length,
            max_new_tokens=max_gen,
            temperature=float(kwargs["temperature"]) if sampling else 1.0,
            sampling_topk=int(kwargs.get("top_k") or -1) if sampling else -1,
            sampling_topp=float(kwargs.get("top_p") or -1.0) if sampling else -1.0,
        )


def rolling_windows(tokens: List[int], prefix: int, max_length: int, context_window: int = 0):
    """(context, continuation) pairs covering ``tokens`` as ``HFLM`` cuts a document (``context_window``
    more tokens of context for every window after the first)."""
    return [
        make_disjoint_window(w)
        for w in get_rolling_token_windows(
            token_list=tokens, prefix_token=prefix, max_seq_len=max_length, context_len=1 + context_window
        )
    ]
