"""torch.hub / ``from_pretrained`` interface: text in, scores and samples out.

The data-bin's tokenizer (whitespace or the BPE it was built with) is applied,
so users pass raw sentences.
"""
from __future__ import annotations

import math
import os
from typing import Dict, List, Optional

import torch

from toolkit import inference
from toolkit.tokenizers import load_tokenizer_for_data_bin


def from_pretrained(model_name_or_path: str, checkpoint_file: str = "checkpoint_best.pt",
                    data_name_or_path: str = ".", device: Optional[str] = None) -> "LMHubInterface":
    """``model_name_or_path`` is a folder holding the checkpoint; the data-bin path is relative to it.

    A folder written by ``toolkit-export --format safetensors`` (``model.safetensors`` beside
    ``config.json`` and ``dict.txt``) loads as it is, with no pickle.
    """
    path = os.path.join(model_name_or_path, checkpoint_file)
    exported = os.path.join(model_name_or_path, "model.safetensors")
    if not os.path.isfile(path) and os.path.isfile(exported):
        path = exported
    data = data_name_or_path if os.path.isabs(data_name_or_path) else os.path.join(model_name_or_path,
                                                                                    data_name_or_path)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    models, task, args = inference.load_ensemble(path, data, dev)
    return LMHubInterface(models, task, args, tokenizer=load_tokenizer_for_data_bin(task.cfg.data.split(":")[0]))


class LMHubInterface(torch.nn.Module):
    def __init__(self, models: List[torch.nn.Module], task, args, tokenizer=None):
        super().__init__()
        self.models = torch.nn.ModuleList(models)
        self.task, self.args, self.tokenizer = task, args, tokenizer
        self.dictionary = task.dictionary

    @property
    def device(self) -> torch.device:
        return next(self.models[0].parameters()).device

    def encode(self, sentence: str) -> torch.LongTensor:
        """Text -> token ids, ending with </s> as in the data-bin."""
        pieces = self.tokenizer.encode(sentence) if self.tokenizer else sentence
        return self.dictionary.encode_line(pieces, append_eos=True).long()

    def decode(self, tokens: torch.Tensor) -> str:
        text = self.dictionary.string(tokens)
        return self.tokenizer.decode(text) if self.tokenizer else text

    @torch.no_grad()
    def score(self, sentence: str) -> Dict[str, object]:
        """Per-token log-probabilities (natural log) of the sentence and its perplexity."""
        tokens = self.encode(sentence)
        lprobs = inference.score_stream(list(self.models), tokens, self.dictionary.eos(),
                                        tokens_per_sample=self.args.tokens_per_sample, device=self.device)
        return {
            "tokens": tokens,
            "positional_scores": lprobs,
            "score": lprobs.mean().item(),
            "perplexity": math.exp(-lprobs.mean().item()),
        }

    @torch.no_grad()
    def sample(self, prefix: str = "", beam: int = 1, sampling: bool = True, topk: int = -1,
               topp: float = -1.0, temperature: float = 1.0, max_len: int = 50,
               seed: Optional[int] = None) -> str:
        """Continue ``prefix``: sampling (top-k / top-p / temperature) or beam search."""
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        prefix_ids = self.encode(prefix)[:-1] if prefix else torch.zeros(0, dtype=torch.long)
        start = torch.cat([prefix_ids.new_tensor([self.dictionary.eos()]), prefix_ids])
        limit = min(max_len + len(start), self.models[0].max_positions())
        if sampling:
            out = self._sample(start, limit, topk, topp, temperature, generator)
        else:
            out = self._beam_search(start, limit, beam)
        return self.decode(out[1:])

    def _next_log_probs(self, tokens: torch.Tensor) -> torch.Tensor:
        return inference.ensemble_log_probs(list(self.models), tokens.to(self.device))[:, -1].cpu()

    def _sample(self, tokens, limit, topk, topp, temperature, generator) -> torch.Tensor:
        eos = self.dictionary.eos()
        while len(tokens) < limit:
            logp = self._next_log_probs(tokens[None])[0] / max(temperature, 1e-5)
            logp[self.dictionary.pad()] = -math.inf
            if topk > 0:
                kth = torch.topk(logp, min(topk, len(logp))).values[-1]
                logp[logp < kth] = -math.inf
            probs = torch.softmax(logp, dim=-1)
            if 0 < topp < 1:
                sorted_p, order = probs.sort(descending=True)
                drop = sorted_p.cumsum(0) - sorted_p > topp
                probs[order[drop]] = 0.0
                probs /= probs.sum()
            nxt = torch.multinomial(probs, 1, generator=generator)
            tokens = torch.cat([tokens, nxt])
            if nxt.item() == eos:
                break
        return tokens

    def _beam_search(self, tokens, limit, beam: int) -> torch.Tensor:
        eos, pad = self.dictionary.eos(), self.dictionary.pad()
        beams = [(0.0, tokens)]
        finished: List = []
        while beams and len(beams[0][1]) < limit:
            batch = torch.stack([t for _, t in beams])
            logp = self._next_log_probs(batch)
            logp[:, pad] = -math.inf
            candidates = []
            for (score, seq), row in zip(beams, logp):
                top = torch.topk(row, beam)
                candidates += [(score + v.item(), torch.cat([seq, seq.new_tensor([i.item()])]))
                               for v, i in zip(top.values, top.indices)]
            candidates.sort(key=lambda c: c[0], reverse=True)
            beams = []
            for score, seq in candidates[:beam]:
                (finished if seq[-1].item() == eos else beams).append((score, seq))
            if len(finished) >= beam:
                break
        pool = finished + beams
        return max(pool, key=lambda c: c[0] / (len(c[1]) - len(tokens) + 1e-9))[1]
