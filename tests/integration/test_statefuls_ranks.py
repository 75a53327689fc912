"""Entries added to ``Trainer.statefuls`` through a sharded save on 2 FSDP2 gloo ranks, resumed in one process:
the plain entry is rank 0's, the tensor entry and the model come back as the ranks held them.

The worker is tests/helpers/statefuls.py (``python -m tests.helpers.statefuls``).
"""

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers.statefuls import Counter, assert_same, probe_module, resume

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")


def test_new_entries_saved_on_two_fsdp2_ranks_resume_in_one_process(tmp_path):
    from toolkit.checkpoint.consolidated import model_state
    from toolkit.checkpoint.stateful import ModelState

    data_bin = H.make_lm_data_bin(str(tmp_path / "bin"))
    save_dir, out = str(tmp_path / "save"), str(tmp_path / "ranks.pt")
    proc = H.run_cli("tests.helpers.statefuls", [data_bin, save_dir, out], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = torch.load(out, weights_only=True)

    counter, probe = Counter(), probe_module()
    torch.nn.init.zeros_(probe.weight)
    trainer, _, _ = resume(
        data_bin, save_dir, "--use-sharded-state", extra={"counter": counter, "probe": ModelState(probe)}
    )
    assert counter.value == 5  # rank 0's (rank 1 held 6): plain entries are written once
    assert_same(ranks["probe"], probe.state_dict())
    assert_same(ranks["model"], model_state(trainer.model))
    assert trainer.num_updates == ranks["num_updates"] == 2
