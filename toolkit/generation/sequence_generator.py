"""Generate continuations of prompts with a language model (or an ensemble), fairseq's way.

Semantics are those of fairseq's ``SequenceGenerator`` driven by the
``language_modeling`` task: the prompt is a prefix the search is forced through,
``</s>`` stands before it, and every hypothesis is ``prompt + continuation + </s>``.

- Scores are natural-log probabilities. A hypothesis's ``positional_scores`` hold one
  per token, prompt tokens included; its ``score`` is their sum divided by
  ``len ** lenpen`` (``len`` counts the final ``</s>``), unless ``unnormalized``.
- ``max_len = min(int(max_len_a * (prompt_len + 1) + max_len_b), max_positions - 1)`` (the prompt counted, as
  fairseq); with ``max_new_tokens`` ``min(prompt_len + max_new_tokens, max_positions - 1)`` instead
  tokens before ``</s>``; ``min_len`` counts prompt tokens too (fairseq's step index). A prompt longer
  than ``max_len`` is forced up to ``max_len`` and ends there with ``</s>``, as fairseq's
  ``prefix_tokens``: so ``toolkit-generate`` without ``--prefix-size``, whose prompts are whole samples
  (up to ``--tokens-per-sample`` = the model's positions), gives fairseq's output; only a prompt longer
  than the model's positions is refused, as fairseq refuses such a sample.
- Beam search keeps K hypotheses, scores 2K candidates, finalizes those ending in
  ``</s>`` among the first K, and finishes a prompt once K are final (or at max_len).
  Sampling draws K independent samples. ``--temperature`` divides the model output.

Batching: prompts of different lengths are right-padded and handled per row, as
fairseq's ``prefix_tokens``: at each step a row still inside its prompt is forced to
the prompt's next token, the others search. The tokens all rows share
(the shortest prompt) are read in one forward pass (prefill). Limits (max_len,
min_len) are per row, so a prompt's result does not depend on its batch; that is
where this differs from fairseq, which takes ``x`` and the min_len start from the
padded batch width. Prompt tokens are never n-gram blocked and a ``</s>`` inside a
prompt does not end it.

With ``incremental=True`` (the default) each step feeds only the new token and the
model keeps keys/values per layer; ``incremental=False`` recomputes the whole prefix
every step (the reference the cache is tested and benchmarked against).

Host cost of a step: on a GPU each read of a device value on the host (``.item()``, ``bool()``,
``.tolist()``, ``nonzero``, boolean-mask indexing) waits for every queued kernel, so the host can
no longer queue the next step's kernels while the GPU runs this one. Everything the host can know
(prompt lengths, per-row limits, which rows are inside their prompt) is therefore kept on the
host as lists, masks are applied with ``masked_fill`` rather than boolean indexing, greedy and
single-sample rows are never reordered, and a step reads the device once: the ``</s>`` candidates
(with the all-NaN check folded in), and only at steps where ``</s>`` can be chosen (none before
``min_len``). With ``eos_check_interval=n > 1`` greedy search (one hypothesis, no n-gram
blocking, no ``stop``) reads that every n steps instead: the steps' candidates wait on the device,
then are finalized in order, as if read at once; a prompt that ended keeps its row (wasted work)
until the read. Scores may then differ from n = 1's in the last bits (a batch of another size
may round differently; so may a token, at a near tie); the default, 1, keeps every result.
Sampling checks NaN at once (``multinomial`` would fail on it first); n-gram blocking and
``stop`` callbacks read the tokens on the host, as fairseq's.
``benchmarks/generate.py --profile-step`` counts operators and synchronizations per step.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from toolkit.core.errors import UserError
from toolkit.generation.config import GenerationConfig, check_generation_config
from toolkit.generation.search import beam_search_step, block_repeated_ngrams, sample_step

Hypothesis = Dict[str, object]  # {"tokens": LongTensor, "score": float, "positional_scores": FloatTensor}


class BrokenModelOutput(UserError):
    """Every next token has a NaN probability: no hypothesis can be made (fairseq printed none and exited 0)."""


@dataclass
class _Search:
    """The rows being searched: K hypotheses for each of N unfinished prompts."""

    tokens: torch.Tensor  # [N*K, L+2]: </s>, then the tokens chosen at steps 0, 1, ...
    token_scores: torch.Tensor  # [N*K, L+1]: log-probability of the token chosen at each step
    cum: torch.Tensor  # [N*K]: summed log-probability of each hypothesis (-inf: not alive)
    ignore: torch.Tensor  # [N, K]: sampling slots whose sample is already final
    prompts: torch.Tensor  # [N, P]: right-padded prompts
    prompt_len: torch.Tensor  # [N]
    max_len: torch.Tensor  # [N]
    ids: List[int]  # each row group's index in the caller's list
    states: List[Dict]  # one incremental state per model
    prompt_len_h: List[int]  # prompt_len and max_len on the host: no device read to branch on them
    max_len_h: List[int]
    broken: torch.Tensor  # [] bool: some row's probabilities were all NaN (read with the </s> hits)
    stop: Optional[Callable[[int, torch.Tensor], bool]] = None  # (prompt index, tokens after the prompt)
    interval: int = 1  # read the </s> candidates every this many steps (greedy only)
    pending: List[Tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)


class SequenceGenerator:
    def __init__(
        self,
        models: Sequence[torch.nn.Module],
        dictionary,
        cfg: GenerationConfig,
        incremental: bool = True,
        generator: Optional[torch.Generator] = None,
        bos: Optional[int] = None,
        eos_check_interval: int = 1,
    ):
        """``eos_check_interval``: greedy search reads which rows ended every this many steps (a GPU
        then queues that many steps' kernels without waiting; ended rows run on until the read)."""
        check_generation_config(cfg)
        if eos_check_interval < 1:
            raise ValueError(f"eos_check_interval {eos_check_interval}: must be at least 1")
        self.eos_check_interval = eos_check_interval
        self.models, self.cfg, self.incremental, self.generator = list(models), cfg, incremental, generator
        self.pad, self.unk, self.eos = dictionary.pad(), dictionary.unk(), dictionary.eos()
        self.bos = self.eos if bos is None else bos
        self.vocab_size = len(dictionary)
        self.beam = min(cfg.beam, self.vocab_size - 1)  # never pad, as fairseq
        self.max_positions = min(m.max_positions() for m in self.models)

    @property
    def device(self) -> torch.device:
        return next(self.models[0].parameters()).device

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[torch.Tensor], stop: Optional[Callable[[int, torch.Tensor], bool]] = None
    ) -> List[List[Hypothesis]]:
        """For each prompt (1-D token ids, no ``</s>``), its hypotheses, best first.

        ``stop(i, tokens)``, when given, is asked after every step with prompt ``i``'s tokens past
        the prompt; once it answers True that hypothesis may only end (``</s>`` next), as at max_len:
        stop strings for lm-evaluation-harness's ``generate_until``.
        """
        if not prompts:
            return []
        finalized: List[List[Hypothesis]] = [[] for _ in prompts]
        s, lprobs, step = self._start(prompts)
        s.stop = stop
        greedy = self.beam == 1 and not self.cfg.sampling and self.cfg.no_repeat_ngram_size == 0 and stop is None
        s.interval = self.eos_check_interval if greedy else 1
        while True:
            cand = self._candidates(s, step, lprobs)
            eos_mask, done = self._finalize(s, step, cand, finalized)
            if len(done) == len(s.ids):
                break
            self._select(s, step, cand, eos_mask, done)
            lprobs = self._next_lprobs(s, step + 1)
            step += 1
        return [sorted(h, key=lambda x: -x["score"]) for h in finalized]

    # ---- model calls ----

    def _lprobs(self, tokens: torch.Tensor, states: Optional[List[Dict]], last_only: bool):
        """Adjusted log-probabilities [B, T, V] (T = 1 when last_only), averaged over the ensemble,
        and a [] bool flag: some position's probabilities are all NaN (see ``_check_broken``)."""
        per_model = []
        for i, model in enumerate(self.models):
            out = model(tokens, incremental_state=states[i]) if states is not None else model(tokens)
            out = out[0] if isinstance(out, tuple) else out  # fairseq-style models return (logits, extra)
            out = out[:, -1:] if last_only else out
            if self.cfg.temperature != 1.0:
                out = out / self.cfg.temperature
            per_model.append(model.get_normalized_probs(out, log_probs=True))
        lp = (
            per_model[0]
            if len(per_model) == 1
            else torch.logsumexp(torch.stack(per_model), dim=0) - math.log(len(per_model))
        )
        nan = torch.isnan(lp)
        broken = nan.all(dim=-1).any()
        lp = lp.masked_fill(nan, -math.inf)  # fairseq's: a single NaN token is never chosen
        lp[..., self.pad] = -math.inf
        if self.cfg.unkpen != 0:
            lp[..., self.unk] -= self.cfg.unkpen
        return lp, broken

    @staticmethod
    def _check_broken(broken: bool) -> None:
        if broken:
            raise BrokenModelOutput(
                "the model's next-token probabilities are all NaN: the checkpoint looks broken "
                "(NaN weights?); generate with an earlier checkpoint"
            )

    def _next_lprobs(self, s: _Search, step: int) -> torch.Tensor:
        """[N*K, V] for the token at ``step``, given tokens[:, :step + 1]."""
        if self.incremental:
            lp, broken = self._lprobs(s.tokens[:, step : step + 1], s.states, last_only=True)
        else:
            lp, broken = self._lprobs(s.tokens[:, : step + 1], None, last_only=True)
        if self.cfg.sampling:  # multinomial fails on a NaN distribution before the step's read
            self._check_broken(bool(broken))
        else:
            s.broken |= broken
        return lp[:, 0]

    # ---- setup: limits, prefill ----

    def _limits(self, prompt_len: torch.Tensor) -> torch.Tensor:
        longest = int(prompt_len.max())
        if longest > self.max_positions:  # fairseq refuses such a sample ("Size of sample ... is invalid")
            raise UserError(
                f"prompt of {longest} tokens is longer than the model's {self.max_positions} positions; shorten it"
            )
        cfg = self.cfg
        if cfg.max_new_tokens is not None:
            max_len = prompt_len + cfg.max_new_tokens
        else:
            max_len = (cfg.max_len_a * (prompt_len + 1).double() + cfg.max_len_b).long()
        max_len = max_len.clamp(max=self.max_positions - 1)
        if cfg.min_len > int(max_len.min()):
            raise UserError(
                f"--min-len {cfg.min_len} is larger than the maximum length {int(max_len.min())}; "
                f"lower it or raise --max-len-b (or --max-new-tokens)"
            )
        return max_len

    def _start(self, prompts: Sequence[torch.Tensor]) -> Tuple[_Search, torch.Tensor, int]:
        """Read the tokens every row is forced through in one pass; return the state at the first open step."""
        dev, N, K = self.device, len(prompts), self.beam
        prompt_len = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        max_len = self._limits(prompt_len)
        padded = torch.full((N, max(1, int(prompt_len.max()))), self.pad, dtype=torch.long)
        for i, p in enumerate(prompts):
            padded[i, : len(p)] = p.long()
        shared = int(torch.minimum(prompt_len, max_len).min())
        states = [{} for _ in self.models] if self.incremental else None
        inputs = torch.cat([torch.full((N, 1), self.bos, dtype=torch.long), padded[:, :shared]], dim=1).to(dev)
        lp, broken = self._lprobs(inputs, states, last_only=False)  # [N, shared + 1, V]
        self._check_broken(bool(broken))
        forced = lp[:, :-1].gather(-1, inputs[:, 1:, None]).squeeze(-1)  # prompt tokens' scores

        expand = torch.arange(N, device=dev).repeat_interleave(K)
        for model, state in zip(self.models, states or []):
            model.reorder_incremental_state(state, expand)
        L = int(max_len.max())
        tokens = torch.full((N * K, L + 2), self.pad, dtype=torch.long, device=dev)
        tokens[:, : shared + 1] = inputs[expand]
        token_scores = torch.zeros(N * K, L + 1, device=dev)
        token_scores[:, :shared] = forced[expand]
        cum = forced.sum(dim=1)[expand].view(N, K).clone()
        if not self.cfg.sampling:
            cum[:, 1:] = -math.inf  # beam search grows from one hypothesis
        s = _Search(
            tokens,
            token_scores,
            cum.view(-1),
            torch.zeros(N, K, dtype=torch.bool, device=dev),
            padded.to(dev),
            prompt_len.to(dev),
            max_len.to(dev),
            list(range(N)),
            states if states is not None else [],
            prompt_len.tolist(),
            max_len.tolist(),
            torch.zeros((), dtype=torch.bool, device=dev),
        )
        return s, lp[:, -1][expand], shared

    # ---- one step ----

    def _forced(self, s: _Search, step: int) -> Tuple[List[bool], Optional[torch.Tensor]]:
        """Which prompts are still inside their prompt: on the host, and [N] on the device (None when none is)."""
        host = [step < min(p, m) for p, m in zip(s.prompt_len_h, s.max_len_h)]
        if not any(host):
            return host, None
        return host, step < torch.minimum(s.prompt_len, s.max_len)

    def _constrain(self, s: _Search, step: int, lprobs: torch.Tensor, forced) -> None:
        """max_len, min_len and n-gram blocking, in place on [N*K, V]; masks, never a boolean index (a sync)."""
        K, (forced_h, forced_d) = self.beam, forced
        if s.stop is not None or any(step >= m for m in s.max_len_h):
            at_max = (step >= s.max_len).repeat_interleave(K)
            if s.stop is not None:
                at_max |= self._stopped(s, step, forced_h)
            keep_eos = lprobs[:, self.eos].clone()
            lprobs.masked_fill_(at_max.unsqueeze(1), -math.inf)
            lprobs[:, self.eos] = keep_eos
        if step < self.cfg.min_len:
            if forced_d is None:
                lprobs[:, self.eos] = -math.inf
            else:
                lprobs[:, self.eos].masked_fill_(~forced_d.repeat_interleave(K), -math.inf)
        if self.cfg.no_repeat_ngram_size > 0:
            free_rows = [n * K + k for n, f in enumerate(forced_h) if not f for k in range(K)]
            block_repeated_ngrams(s.tokens[:, : step + 1], lprobs, self.cfg.no_repeat_ngram_size, free_rows)

    def _stopped(self, s: _Search, step: int, forced_h: List[bool]) -> torch.Tensor:
        """[N*K]: hypotheses past their prompt whose tokens so far satisfy ``s.stop``."""
        K = self.beam
        out = [False] * (len(s.ids) * K)
        for n in (n for n, f in enumerate(forced_h) if not f):
            for row in range(n * K, n * K + K):
                generated = s.tokens[row, s.prompt_len_h[n] + 1 : step + 1]
                out[row] = len(generated) > 0 and bool(s.stop(s.ids[n], generated.cpu()))
        return torch.tensor(out, dtype=torch.bool, device=s.tokens.device)

    def _candidates(self, s: _Search, step: int, lprobs: torch.Tensor):
        """(scores, tokens, beams, token log-probs, forced) of this step's candidates, [N, C] each
        (forced: [N] on the device, None when no prompt is inside its prompt)."""
        N, K, V = len(s.ids), self.beam, lprobs.size(-1)
        forced = self._forced(s, step)
        self._constrain(s, step, lprobs, forced)
        lp, cum = lprobs.view(N, K, V), s.cum.view(N, K)
        if self.cfg.sampling:
            scores, tokens, beams = sample_step(lp, cum, self.cfg.sampling_topk, self.cfg.sampling_topp, self.generator)
        else:
            scores, tokens, beams = beam_search_step(lp, cum)
        forced = forced[1]
        if forced is not None:  # rows inside their prompt: every hypothesis takes the prompt's token
            C = scores.size(1)
            slot = torch.arange(C, device=lp.device)
            prompt_tok = s.prompts[:, min(step, s.prompts.size(1) - 1)]
            tok_lp = lp.gather(-1, prompt_tok.view(N, 1, 1).expand(N, K, 1)).squeeze(-1)
            f_scores = torch.full((N, C), -math.inf, device=lp.device)
            f_scores[:, :K] = cum + tok_lp
            rows = forced.unsqueeze(1)
            scores = torch.where(rows, f_scores, scores)
            tokens = torch.where(rows, prompt_tok.unsqueeze(1).expand(N, C), tokens)
            beams = torch.where(rows, (slot % K).expand(N, C), beams)
        token_lp = lp.view(N, K * V).gather(1, beams * V + tokens)
        return scores, tokens, beams, token_lp, forced

    def _eos_hits(self, s: _Search, step: int, eos_mask: torch.Tensor) -> List[Tuple[int, int]]:
        """(prompt, candidate) of the first K candidates ending in </s>: the step's one device read.

        Before ``min_len`` no </s> can score above -inf, so there is nothing to read. The NaN flag
        of the steps so far rides along: the last step of every prompt is read (step >= min_len)."""
        if step < self.cfg.min_len:
            return []
        K = self.beam
        flags = torch.cat([s.broken.view(1), eos_mask[:, :K].flatten()]).tolist()
        self._check_broken(flags[0])
        return [divmod(i, K) for i, hit in enumerate(flags[1:]) if hit]

    def _record(
        self, s: _Search, step: int, row: int, score: torch.Tensor, last_lp: torch.Tensor, out: List[Hypothesis]
    ) -> None:
        """Finalize hypothesis ``row`` ending in </s> at ``step`` (``score`` its summed log-probability)."""
        positional = torch.cat([s.token_scores[row, :step], last_lp]).float().cpu()
        if not self.cfg.unnormalized:  # float32 arithmetic, as fairseq's
            score = score / (step + 1) ** self.cfg.lenpen
        hyp_tokens = torch.cat([s.tokens[row, 1 : step + 1], s.tokens.new_tensor([self.eos])]).cpu()
        out.append({"tokens": hyp_tokens, "score": float(score), "positional_scores": positional})

    def _read_pending(self, s: _Search, finalized: List[List[Hypothesis]]) -> None:
        """Finalize the waiting greedy steps' </s> candidates, oldest first, in one device read."""
        if not s.pending:
            return
        N = len(s.ids)
        flags = torch.cat([s.broken.view(1)] + [eos for _, eos, _, _ in s.pending]).tolist()
        self._check_broken(flags[0])
        for i, (step, _, scores, token_lp) in enumerate(s.pending):
            for n in (n for n in range(N) if flags[1 + i * N + n] and not finalized[s.ids[n]]):
                self._record(s, step, n, scores[n], token_lp[n : n + 1], finalized[s.ids[n]])
        s.pending = []

    def _finalize(self, s: _Search, step: int, cand, finalized: List[List[Hypothesis]]):
        """Record hypotheses ending in </s> among the first K candidates; return (eos mask, finished rows)."""
        scores, tokens, beams, token_lp, forced = cand
        K = self.beam
        eos_mask = tokens.eq(self.eos) & scores.ne(-math.inf)
        if forced is not None:
            eos_mask &= ~forced.unsqueeze(1)
        eos_mask[:, :K] &= ~s.ignore
        if s.interval > 1:  # greedy: K = 1, the row is the prompt's and stays put until the read
            if step >= self.cfg.min_len:
                s.pending.append((step, eos_mask[:, 0], scores[:, 0], token_lp[:, 0]))
            if len(s.pending) >= s.interval or any(step >= m for m in s.max_len_h):
                self._read_pending(s, finalized)
        for n, c in [] if s.interval > 1 else self._eos_hits(s, step, eos_mask):
            out = finalized[s.ids[n]]
            if len(out) < K:
                self._record(s, step, n * K + int(beams[n, c]), scores[n, c], token_lp[n, c : c + 1], out)
        done = [n for n in range(len(s.ids)) if len(finalized[s.ids[n]]) >= K or step >= s.max_len_h[n]]
        return eos_mask, done

    def _select(self, s: _Search, step: int, cand, eos_mask: torch.Tensor, done: List[int]) -> None:
        """Drop finished prompts; continue each prompt's first K candidates that did not end.

        With one hypothesis per prompt (greedy, one sample) the row stays the row: nothing moves
        unless a prompt finished. Beam search moves its rows (and caches) every step."""
        scores, tokens, beams, token_lp, _ = cand
        K, dev = self.beam, scores.device
        if done:
            finished = set(done)
            keep = [n for n in range(len(s.ids)) if n not in finished]
            keep_t = torch.tensor(keep, dtype=torch.long, device=dev)
            scores, tokens, beams, token_lp, eos_mask = (x[keep_t] for x in (scores, tokens, beams, token_lp, eos_mask))
            s.ignore, s.prompts, s.prompt_len, s.max_len = (
                x[keep_t] for x in (s.ignore, s.prompts, s.prompt_len, s.max_len)
            )
            s.ids, s.prompt_len_h, s.max_len_h = ([x[n] for n in keep] for x in (s.ids, s.prompt_len_h, s.max_len_h))
        C = scores.size(1)
        blocked = eos_mask.clone()
        blocked[:, :K] |= s.ignore
        key = blocked.long() * C + torch.arange(C, device=dev)
        new_key, active = key.topk(K, dim=1, largest=False)
        s.ignore = new_key >= C
        if done or K > 1:
            base = keep_t if done else torch.arange(len(s.ids), device=dev)
            src_rows = (base.unsqueeze(1) * K + beams.gather(1, active)).view(-1)
            s.tokens, s.token_scores = s.tokens[src_rows], s.token_scores[src_rows]
            for model, state in zip(self.models, s.states):
                model.reorder_incremental_state(state, src_rows)
        s.tokens[:, step + 1] = tokens.gather(1, active).view(-1)
        s.token_scores[:, step] = token_lp.gather(1, active).view(-1)
        s.cum = scores.gather(1, active).view(-1)
