"""The hub scores a text with the model's whole context, not the training ``--tokens-per-sample`` (issue 45, item 4).

An imported tiny Llama of 64 positions whose checkpoint records ``--tokens-per-sample 16``: a text of 50 ids is
scored in one pass, as transformers scores it (fp32, 1e-4); a text longer than the model is scored in windows
of its 64 positions, one INFO line saying so; ``tokens_per_sample`` / ``context_window`` choose the window and
the result names it; a window beyond the model's positions is one line; the hub's scores are eval-lm's at
the model's context.
"""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tests.helpers.hf_llama import make_hf  # noqa: E402
from toolkit.core.errors import UserError  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from toolkit.core import registry
    from toolkit.export.api import ExportConfig, run_export
    from toolkit.models.llama.model import LlamaLanguageModel

    registry.import_all_components()
    root = tmp_path_factory.mktemp("window")
    hf = make_hf(str(root / "hf"), "llama")
    run_export(ExportConfig(path=str(root / "hf"), out=str(root / "ours"), import_from="hf", tokens_per_sample=16))
    lm = LlamaLanguageModel.from_pretrained(str(root / "ours"), "model.pt", device="cpu").eval()
    assert lm.args.tokens_per_sample == 16 and lm.max_positions == 64
    return lm, hf


def text_of(n: int) -> str:
    return " ".join(f"w{(7 * i) % 60}" for i in range(n))


def transformers_scores(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        lp = torch.log_softmax(hf(ids[None]).logits[0].float(), dim=-1)
    return lp[:-1].gather(-1, ids[1:, None]).squeeze(-1)


def test_a_text_within_the_context_is_one_pass(hub):
    lm, hf = hub
    text = text_of(49)  # BOS + 49 ids: the first is the context, 49 scored, past 16
    got = lm.score(text)
    assert got["window"] == {"tokens_per_sample": 64, "context_window": 0}
    assert (got["positional_scores"] - transformers_scores(hf, lm.encode(text))).abs().max().item() < TOL


def test_a_longer_text_is_scored_in_windows_of_the_models_positions(hub, caplog):
    lm, hf = hub
    text = text_of(99)
    ids = lm.encode(text)
    with caplog.at_level(logging.INFO, logger="toolkit.hub_utils"):
        got = lm.score(text)["positional_scores"]
    assert any("99 ids scored in windows of 64" in r.getMessage() for r in caplog.records)
    assert (got[:64] - transformers_scores(hf, ids[:65])).abs().max().item() < TOL  # the first window: one pass


def test_the_window_is_a_choice(hub):
    lm, hf = hub
    text = text_of(80)
    ids = lm.encode(text)
    got = lm.score(text, tokens_per_sample=32, context_window=32)
    assert got["window"] == {"tokens_per_sample": 32, "context_window": 32}
    scores = got["positional_scores"]
    assert (scores[:32] - transformers_scores(hf, ids[:33])[:32]).abs().max().item() < TOL
    # the third window (ids 65..80) is scored after the 32 ids before it, ids 33..64, as transformers from id 32
    assert len(scores) == 80 and (scores[64:] - transformers_scores(hf, ids[32:])[32:]).abs().max().item() < TOL
    with pytest.raises(UserError, match="tokens_per_sample 60 \\+ context_window 10 must be within the model's 64"):
        lm.score(text, tokens_per_sample=60, context_window=10)


def test_the_hub_scores_as_eval_lm_with_the_models_context(hub, tmp_path):
    """Lines encoded as the hub encodes them (BOS once, each line's ids and EOS) and the same lines binarized with
    the import's tokenizer: the hub's default window and eval-lm's --tokens-per-sample 64 (the model's context,
    not the checkpoint's 16) give one log-likelihood over the same count of tokens (fp32, 1e-4 relative), in
    several windows; eval-lm at the checkpoint's 16 gives another."""
    import math

    from tests.helpers import preprocess
    from toolkit.inference import eval_lm_main as M

    lm, _ = hub
    lines = [text_of(30), " " + text_of(45), text_of(12), text_of(38)]
    got = lm.score_tokens(lm.encode_lines(lines))
    assert got["window"]["tokens_per_sample"] == 64 and len(got["positional_scores"]) > 2 * 64
    (tmp_path / "lines.txt").write_text("".join(line + "\n" for line in lines))
    ours = lm.args.data  # the import's folder (its dict.txt, tokenizer.json, model.pt)
    dest = str(tmp_path / "bin")
    preprocess.run("--trainpref", tmp_path / "lines.txt", "--destdir", dest, *preprocess.model_tokenizer_flags(ours))

    def eval_lm(**window):
        run = M.EvalLMConfig(data=dest, path=f"{ours}/model.pt", cpu=True, gen_subset="train", **window)
        result = M.main(run)
        return -result["loss"] * math.log(2) * result["count"], result["count"]

    total, count = eval_lm(tokens_per_sample=64)
    assert count == len(got["positional_scores"])
    assert abs(total - got["positional_scores"].sum().item()) < 1e-4 * abs(total)
    assert abs(eval_lm()[0] - total) > 1e-3 * abs(total)  # the checkpoint's 16: shorter contexts
