"""toolkit-eval-harness without training: a missing lm_eval is one line naming the install, and the
toolkit's lm-eval model on an imported Hugging Face Llama equals lm-eval's own HF backend on the original.

Trained checkpoints (sharded, exported, generate_until) are in tests/integration/test_eval_harness.py.
"""
from __future__ import annotations

import sys

import pytest

lm_eval = pytest.importorskip("lm_eval")

from toolkit.core.errors import UserError  # noqa: E402
from toolkit.evaluation.harness import ToolkitLM  # noqa: E402
from toolkit.evaluation import harness_main  # noqa: E402
from toolkit.export.api import ExportConfig, run_export  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def test_missing_lm_eval_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(UserError, match="lm-eval is not installed; pip install lm-eval"):
        harness_main.run(harness_main.EvalHarnessConfig(path="x.pt", tasks="t"))


def _instances(kind: str, args_list):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, args, i) for i, args in enumerate(args_list)]


def test_imported_hf_llama_equals_hf_backend_on_the_original(tmp_path):
    """``toolkit-export --from hf`` output (its tokenizer.json, BOS added) against HFLM on the source folder:
    log-likelihoods (an empty context too) and rolling log-likelihoods within 1e-4, same greedy flags."""
    import random

    from lm_eval.models.huggingface import HFLM

    from tests.helpers.hf_llama import make_hf

    make_hf(str(tmp_path / "hf"), "llama")
    run_export(ExportConfig(path=str(tmp_path / "hf"), out=str(tmp_path / "ours"), import_from="hf"))
    ours = ToolkitLM(path=str(tmp_path / "ours" / "model.pt"), data=str(tmp_path / "ours"), device="cpu")
    hf = HFLM(pretrained=str(tmp_path / "hf"), batch_size=8, device="cpu")
    rng = random.Random(0)
    words = [" ".join(f"w{rng.randrange(60)}" for _ in range(rng.randint(1, n))) for n in [30] * 12]
    pairs = [(words[i], " " + words[(i + 1) % 12].split()[0]) for i in range(12)] + [("", "w1 w2")]
    a, b = ours.loglikelihood(_instances("loglikelihood", pairs)), hf.loglikelihood(_instances("loglikelihood", pairs))
    assert all(abs(x[0] - y[0]) < 1e-4 and x[1] == y[1] for x, y in zip(a, b))
    docs = [(w,) for w in words]
    hf_rolling = HFLM(pretrained=str(tmp_path / "hf"), batch_size=8, device="cpu", add_bos_token=False)
    a = ours.loglikelihood_rolling(_instances("loglikelihood_rolling", docs))
    b = hf_rolling.loglikelihood_rolling(_instances("loglikelihood_rolling", docs))
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
