"""toolkit-eval-harness without training: a missing lm_eval is one line naming the install, and the
toolkit's lm-eval model on an imported Hugging Face Llama equals lm-eval's own HF backend on the original.

Trained checkpoints (sharded, exported, generate_until) are in tests/integration/test_eval_harness.py.
"""

from __future__ import annotations

import os
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


def _requests_against_hf(ours, hf):
    """Every request type, ToolkitLM against ``HFLM`` with default model_args: log-likelihoods (an empty context
    too) and rolling log-likelihoods (documents longer than the model's 64 positions too) within 1e-4, the same
    greedy flags, the same greedy generations."""
    import random

    rng = random.Random(0)
    words = [" ".join(f"w{rng.randrange(60)}" for _ in range(rng.randint(1, n))) for n in [30] * 12]
    pairs = [(words[i], " " + words[(i + 1) % 12].split()[0]) for i in range(12)] + [("", "w1 w2")]
    a, b = ours.loglikelihood(_instances("loglikelihood", pairs)), hf.loglikelihood(_instances("loglikelihood", pairs))
    assert all(abs(x[0] - y[0]) < 1e-4 and x[1] == y[1] for x, y in zip(a, b))
    docs = [(w,) for w in words] + [(" ".join(f"w{rng.randrange(60)}" for _ in range(n)),) for n in (64, 150, 300)]
    a = ours.loglikelihood_rolling(_instances("loglikelihood_rolling", docs))
    b = hf.loglikelihood_rolling(_instances("loglikelihood_rolling", docs))
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    gen = [(w, {"until": ["w7"], "max_gen_toks": 8, "do_sample": False}) for w in words + [docs[-1][0]]]
    a, b = ours.generate_until(_instances("generate_until", gen)), hf.generate_until(_instances("generate_until", gen))
    # the toolkit's generator never emits the pad id (its buffers' filler, as fairseq); where transformers
    # emits it (this tokenizer has no pad: pad is <unk>, whose text is dropped), the texts may differ after it
    compared = [i for i, (context, _) in enumerate(gen) if ours.dictionary.pad() not in _hf_greedy(hf, context, 8)]
    assert len(compared) >= 6 and all(a[i] == b[i] for i in compared)


def _hf_greedy(hf, context: str, n: int) -> list:
    """transformers' greedy ids after ``context`` (HFLM's encoding and truncation)."""
    import torch

    ids = torch.tensor([hf.tok_encode(context)[-(hf.max_length - n) :]])
    with torch.no_grad():
        out = hf.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=hf.tokenizer.eos_token_id,
        )
    return out[0, ids.size(1) :].tolist()


def test_imported_hf_llama_equals_hf_backend_on_the_original(tmp_path):
    """``toolkit-export --from hf`` output (its tokenizer.json, BOS added) against ``lm_eval --model hf`` on the
    source folder with default model_args (``add_bos_token`` unset: BOS scored in rolling requests too)."""
    from lm_eval.models.huggingface import HFLM

    from tests.helpers.hf_llama import make_hf

    make_hf(str(tmp_path / "hf"), "llama")
    run_export(ExportConfig(path=str(tmp_path / "hf"), out=str(tmp_path / "ours"), import_from="hf"))
    ours = ToolkitLM(path=str(tmp_path / "ours" / "model.pt"), data=str(tmp_path / "ours"), device="cpu")
    _requests_against_hf(ours, HFLM(pretrained=str(tmp_path / "hf"), batch_size=8, device="cpu"))


@pytest.mark.parametrize("context_window", [0, 3])
def test_rolling_windows_score_every_token_once_within_the_model(context_window):
    """Each token is a target once, after the tokens before it (the prefix before the first); no input is longer
    than the model; every window after the first sees ``context_window`` more earlier tokens."""
    from toolkit.evaluation.harness import rolling_windows

    tokens, prefix, max_length = list(range(10, 40)), 2, 8
    windows = rolling_windows(tokens, prefix, max_length, context_window)
    assert [t for _, cont in windows for t in cont] == tokens
    full = [prefix] + tokens
    for context, continuation in windows:
        start = tokens.index(continuation[0]) + 1  # its index in ``full``
        assert context == full[start - len(context) : start] and len(context + continuation) - 1 <= max_length
    assert all(len(cont) == max_length - context_window for _, cont in windows[1:-1])


def test_broken_yaml_in_include_path_names_the_file_and_line(tmp_path):
    """The harness skips a YAML it cannot parse (a warning), so the task asked for came back as "unknown task";
    the folder's files are parsed first and the first broken one is named with its line."""
    import shutil

    tasks = tmp_path / "tasks"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "..", "harness_tasks"), tasks)
    harness_main.check_task_yaml(str(tasks))  # lm-eval's own tags (!function) are fine
    (tasks / "nested").mkdir()
    (tasks / "nested" / "broken.yaml").write_text("task: broken\ndataset_path: json\n  bad: [1, 2\n")
    with pytest.raises(
        UserError,
        match=r"--include-path .*nested/broken\.yaml: line 3, column 6: invalid YAML "
        r"\(mapping values are not allowed here\)",
    ):
        harness_main.task_manager(["broken"], str(tasks))
