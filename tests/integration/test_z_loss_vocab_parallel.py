"""``--z-loss-coef`` under ``vocab_parallel_cross_entropy``: 2 gloo ranks with the vocabulary split give the
one-process loss, ``z_loss`` and gradients."""

import torch

from tests.helpers import tp_helpers, z_loss_helpers


def test_z_loss_on_vocabulary_sharded_logits_is_the_whole_ones(tmp_path):
    tp_helpers.spawn(z_loss_helpers.worker_vocab_parallel_z_loss, 2, str(tmp_path))
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    for name, (got, want) in result.items():
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    assert result["z_loss"][1] > 0
