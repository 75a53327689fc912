"""--task sft's samples: whole conversations, targets padded where not trained, each conversation alone."""

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers.chat import make_chat_data_bin, trained_targets, varied_conversations
from tests.helpers.models import tiny_model
from toolkit.core.errors import UserError
from toolkit.data.indexed_dataset import MMapIndexedDatasetBuilder
from toolkit.data.sft_dataset import SFTDataset
from toolkit.tasks.sft import SFTTask

PAD = 1
CONVERSATIONS = [
    ([5, 6, 7, 8, 9], [0, 0, 1, 1, 0]),
    ([10, 11, 12], [0, 1, 1]),
    ([13], [1]),  # one token: nothing predicts it, no sample
    ([14, 15, 16, 17, 18, 19, 20], [0, 0, 0, 0, 1, 1, 1]),
]


@pytest.fixture
def chat_bin(tmp_path):
    make_chat_data_bin(tmp_path, {"train": CONVERSATIONS})
    return os.path.join(tmp_path, "train")


def test_targets_are_padding_where_not_trained_and_documents_restart(chat_bin):
    data = SFTDataset([chat_bin], PAD, tokens_per_sample=8)
    assert data.samples.tolist() == [[0, 2], [2, 3]]  # 4 + 2 positions packed, then 6 alone
    first = data[0]
    assert first["source"].tolist() == [5, 6, 7, 8, 10, 11]
    assert first["target"].tolist() == [PAD, 7, 8, PAD, 11, 12]
    assert first["document_ids"].tolist() == [0, 0, 0, 0, 1, 1]
    assert first["positions"].tolist() == [0, 1, 2, 3, 0, 1]
    batch = data.collater([data[0], data[1]])
    assert batch["ntokens"] == 2 + 2 + 3 == trained_targets(CONVERSATIONS) == data.trained_tokens()
    assert batch["net_input"]["document_ids"][0].tolist() == [0, 0, 0, 0, 1, 1]  # [1]'s padding: its own document
    assert batch["net_input"]["document_ids"][1].tolist() == [0] * 6
    assert batch["net_input"]["positions"][1].tolist() == list(range(6))


def test_one_conversation_a_sample_and_truncation(chat_bin):
    assert SFTDataset([chat_bin], PAD, 8, break_mode="eos").sizes.tolist() == [4, 2, 6]
    cut = SFTDataset([chat_bin], PAD, 3, break_mode="eos", truncate=True)
    assert cut.sizes.tolist() == [3, 2, 3]
    assert cut[2]["target"].tolist() == [PAD, PAD, PAD] and cut.trained_tokens() == 2 + 2 + 0
    whole = SFTDataset([chat_bin], PAD, 3, break_mode="eos")
    assert whole.sizes.tolist() == [4, 2, 6]  # longer than --tokens-per-sample: the size filter's business


def test_a_packed_conversation_scores_as_it_does_alone(tmp_path):
    model = tiny_model(max_target_positions=64).eval()
    conversations = varied_conversations(6, seed=4, vocab=37)

    def summed_loss(batch):
        logits = model(batch["net_input"]["src_tokens"], **extra(batch))
        return F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), ignore_index=PAD, reduction="sum")

    def extra(batch):
        return {k: v for k, v in batch["net_input"].items() if k in ("document_ids", "positions")}

    make_chat_data_bin(tmp_path, {"train": conversations})
    packed = SFTDataset([str(tmp_path / "train")], PAD, tokens_per_sample=64)
    alone = SFTDataset([str(tmp_path / "train")], PAD, tokens_per_sample=64, break_mode="eos")
    assert len(packed) < len(alone) == 6
    with torch.no_grad():
        together = summed_loss(packed.collater([packed[i] for i in range(len(packed))]))
        apart = sum(summed_loss(alone.collater([alone[i]])) for i in range(len(alone)))
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-5)


def test_a_data_bin_without_masks_or_with_other_sizes_is_one_line(tmp_path, chat_bin):
    make_chat_data_bin(tmp_path / "plain", {"train": CONVERSATIONS})
    for ext in ("bin", "idx"):
        os.remove(tmp_path / "plain" / f"train.loss_mask.{ext}")
    with pytest.raises(UserError, match="loss_mask.bin/.idx: not found beside"):
        SFTDataset([str(tmp_path / "plain" / "train")], PAD, 8)
    builder = MMapIndexedDatasetBuilder(chat_bin + ".loss_mask.bin", dtype=np.uint8)
    builder.add_item(np.ones(3, dtype=np.uint8))
    builder.finalize(chat_bin + ".loss_mask.idx")
    with pytest.raises(UserError, match="do not match the 4 conversations"):
        SFTDataset([chat_bin], PAD, 8)


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"sample_break_mode": "none"}, "keeps conversations whole"),
        ({"shorten_method": "random_crop"}, "use --shorten-method truncate"),
    ],
)
def test_the_task_refuses_what_would_cut_conversations(tmp_path, flags, message):
    dictionary = make_chat_data_bin(tmp_path, {"train": CONVERSATIONS})
    with pytest.raises(UserError, match=message):
        SFTTask({"data": str(tmp_path), **flags}, dictionary)
