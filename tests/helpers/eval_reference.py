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


def assert_eval_lm_equals_forward(ckpt: str, data_bin: str, block: int = 32) -> None:
    """toolkit-eval-lm on checkpoint ``ckpt`` over ``data_bin``'s valid split (blocks of ``block``) equals
    :func:`reference_eval` of the model it loads: the same count, the same loss in bits."""
    import math
    import os

    import pytest

    from toolkit.data.indexed_dataset import MMapIndexedDataset
    from toolkit.inference import load_model
    from toolkit.inference.eval_lm_main import EvalLMConfig, main

    result = main(EvalLMConfig(data=data_bin, path=ckpt, gen_subset="valid", tokens_per_sample=block, batch_size=3))
    model, _, _ = load_model(ckpt, data_bin)
    valid = MMapIndexedDataset(os.path.join(data_bin, "valid"))
    total, count = reference_eval(model, [int(t) for i in range(len(valid)) for t in valid[i]], block)
    assert result["count"] == count
    assert result["loss"] == pytest.approx(-total / count / math.log(2), rel=1e-5)
