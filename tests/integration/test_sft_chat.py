"""Chat data end to end: toolkit-preprocess --chat-template, then toolkit-validate --task sft, against transformers.

A tiny imported Llama whose tokenizer has a chat template with {% generation %} marks: the data-bin holds exactly the
ids and assistant masks of ``apply_chat_template(..., return_assistant_tokens_mask=True)``, the same template without
its marks gives the same masks by rendering the conversations' prefixes, and ``toolkit-validate --task sft`` gives
the mean loss transformers' model gives the marked tokens (fp32, relative 2e-4). Records not to train on are counted
and named.
"""

import json
import math
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from tests.helpers import cli as H  # noqa: E402
from tests.helpers.chat import chat_messages  # noqa: E402
from tests.helpers.hf_llama import CHAT_TEMPLATE, UNMARKED_CHAT_TEMPLATE, make_hf  # noqa: E402
from toolkit.config.commands import ValidateConfig  # noqa: E402
from toolkit.data.sft_dataset import ChatSplit  # noqa: E402


GOOD = [chat_messages(k) for k in range(12)]
BAD = [
    [{"role": "user", "content": "w1"}, {"role": "assistant", "content": ""}],  # an empty assistant turn
    [{"role": "user", "content": "w1"}],  # no assistant turn
    "w1 w2",  # not a list of messages
]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    hf = make_hf(str(root / "hf"), "llama", chat_template=CHAT_TEMPLATE)
    run = H.run_cli("toolkit_cli.export", ["--from", "hf", "--path", str(root / "hf"), "--out", str(root / "imp")])
    assert run.returncode == 0, run.stderr[-2000:]
    records = root / "chats.jsonl"
    records.write_text("".join(json.dumps({"messages": m}) + "\n" for m in GOOD[:1] + BAD + GOOD[1:]))
    return root, hf


def preprocess(root, name, template, *extra):
    run = H.run_cli(
        "toolkit_cli.preprocess",
        [
            "--chat-template",
            str(template),
            "--trainpref",
            str(root / "chats.jsonl"),
            "--validpref",
            str(root / "chats.jsonl"),
            "--destdir",
            str(root / name),
            *extra,
        ],
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run


def hf_reference(root):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(root / "hf"))
    out = [tokenizer.apply_chat_template(m, return_dict=True, return_assistant_tokens_mask=True) for m in GOOD]
    return [(list(o["input_ids"]), list(o["assistant_masks"])) for o in out]


def stored(folder, split="valid"):
    chats = ChatSplit(os.path.join(folder, split))
    starts = [0, *torch.tensor(chats.sizes).cumsum(0).tolist()]
    return [
        (chats.tokens[a:b].astype(int).tolist(), chats.mask[a:b].astype(int).tolist())
        for a, b in zip(starts, starts[1:])
    ]


def test_the_data_bin_holds_transformers_ids_and_assistant_masks(imported):
    root, _ = imported
    run = preprocess(root, "marked", root / "imp")  # the import keeps the template, the tokenizer and dict.txt
    assert stored(root / "marked") == hf_reference(root)
    warnings = [line for line in run.stdout.splitlines() if "record(s) skipped" in line]
    assert len(warnings) == 6, warnings  # three kinds, in train and in valid
    assert any("1 record(s) skipped: an empty assistant turn (first: line 2: message 1" in w for w in warnings)
    assert any("1 record(s) skipped: no assistant turn (first: line 3" in w for w in warnings)
    assert any("1 record(s) skipped: not a list of messages (first: line 4" in w for w in warnings)
    assert json.load(open(root / "marked" / "chat.json"))["masks"] == "generation"


def test_a_template_without_marks_masks_the_same_by_prefixes(imported, tmp_path):
    root, _ = imported
    (tmp_path / "unmarked.jinja").write_text(UNMARKED_CHAT_TEMPLATE)  # no tokenizer beside it: --srcdict's folder
    preprocess(root, "prefixes", tmp_path / "unmarked.jinja", "--srcdict", str(root / "imp" / "dict.txt"))
    assert stored(root / "prefixes") == hf_reference(root)
    assert json.load(open(root / "prefixes" / "chat.json"))["masks"] == "prefixes"


def test_validate_task_sft_is_transformers_mean_loss_on_the_marked_tokens(imported):
    from toolkit.train.validate import main as validate

    root, hf = imported
    if not os.path.isdir(root / "marked"):
        preprocess(root, "marked", root / "imp")
    nll, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in hf_reference(root):
            log_probs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
            for t in range(1, len(ids)):
                if mask[t]:
                    nll -= log_probs[t - 1, ids[t]].item()
                    count += 1
    cfg = ValidateConfig(data=str(root / "marked"), path=str(root / "imp" / "model.pt"), task="sft", cpu=True)
    sums = validate(cfg)["valid"]["_sums"]
    assert sums["ntokens"] == sums["sample_size"] == count
    assert math.isclose(sums["loss"] / sums["sample_size"], nll / count, rel_tol=2e-4)


def test_parquet_records_give_the_same_conversations(imported, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    root, _ = imported
    pq.write_table(pa.table({"conversation": GOOD}), str(tmp_path / "chats.parquet"))
    run = H.run_cli(
        "toolkit_cli.preprocess",
        [
            "--chat-template",
            str(root / "imp"),
            "--trainpref",
            str(tmp_path / "chats.parquet"),
            "--messages-key",
            "conversation",
            "--destdir",
            str(tmp_path / "bin"),
        ],
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert stored(tmp_path / "bin", "train") == hf_reference(root)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--trainpref", "{root}/plain.txt"], "not plain text"),
        (["--trainpref", "{root}/chats.jsonl", "--bpe", "gpt2"], "encodes with the template's own tokenizer"),
        (["--trainpref", "{root}/chats.jsonl", "--srcdict", "{root}/fairseq_dict.txt"], "a fairseq dictionary"),
        (["--trainpref", "{root}/chats.jsonl", "--messages-key", "turns"], "15 missing key 'turns'"),
    ],
)
def test_bad_chat_inputs_are_one_line(imported, tmp_path, extra, message):
    root, _ = imported
    (root / "plain.txt").write_text("w1 w2\n")
    (root / "fairseq_dict.txt").write_text("w1 1\n")
    argv = ["--chat-template", str(root / "imp"), "--destdir", str(tmp_path / "bin")]
    run = H.run_cli("toolkit_cli.preprocess", argv + [a.format(root=root) for a in extra])
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and lines[0].startswith("toolkit-preprocess: error:"), run.stderr
    assert message in lines[0] and not os.path.exists(tmp_path / "bin")
