"""What toolkit-eval-lm must compute, written out directly against the model (the integration tests' reference)."""

from __future__ import annotations

import torch


def reference_eval(model, stream, block):
    """(sum of natural-log scores, count): blocks of ``block`` targets, each predicted from the tokens
    before it in its block, ``</s>`` before the first (eval-lm without a context window)."""
    total = 0.0
    for s in range(0, len(stream), block):
        targets = stream[s : s + block]
        inputs = torch.tensor([[stream[s - 1] if s else 2] + targets[:-1]])
        with torch.no_grad():
            lp = model.get_normalized_probs(model(inputs))[0]
        total += float(lp.gather(1, torch.tensor(targets)[:, None]).sum())
    return total, len(stream)
