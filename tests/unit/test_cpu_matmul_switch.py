"""The fp32 CPU matmul switch (toolkit.ops) as the commands use it: each command sets it once, at its start, from its
``--cpu-matmul``; it stays in force for the rest of the process; and the same checkpoint scores the same with the
switch on (oneDNN) and off (torch's BLAS), to fp32 summation order (rtol 1e-5 on log-probabilities and losses).

Every product goes to oneDNN here (the size threshold is 0: the test models are far below it), and the products
oneDNN runs are counted, so "on" is seen to run oneDNN and "off" to run none of it."""

from __future__ import annotations

import io
import os
import re
import shutil

import pytest
import torch

from tests.helpers.eval_lm_setup import make_eval_lm_files
from toolkit import ops
from toolkit.core import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="torch built without oneDNN")

RTOL = 1e-5  # fp32 sums of at most a few hundred products, added in another order


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A fairseq-layout checkpoint and its data-bin; also as a hub folder (``model.pt`` beside ``dict.txt``)."""
    root = tmp_path_factory.mktemp("switch")
    data, path, _, _ = make_eval_lm_files(root)
    shutil.copy(path, os.path.join(data, "model.pt"))
    return data, path


@pytest.fixture
def switch(monkeypatch):
    """The library each command asks for (``cpu_gemm.select``'s calls) and the number of oneDNN products run."""
    seen = {"selects": [], "onednn_products": 0}
    real_select, real_product = cpu_gemm.select, cpu_gemm._lp

    def select(choice="auto"):
        seen["selects"].append(choice)
        return real_select(choice)

    def product(*args):
        seen["onednn_products"] += 1
        return real_product(*args)

    monkeypatch.setattr(cpu_gemm, "select", select)
    monkeypatch.setattr(cpu_gemm, "_lp", product)
    monkeypatch.setattr(cpu_gemm, "MIN_MULTIPLY_ADDS", 0)
    return seen


def eval_lm(checkpoint, choice):
    from toolkit.inference.eval_lm_main import EvalLMConfig, main

    data, path = checkpoint
    result = main(EvalLMConfig(data=data, path=path, tokens_per_sample=10, context_window=4, cpu_matmul=choice))
    return torch.tensor([result["loss"]])


def validate(checkpoint, choice):
    from toolkit.train.validate import ValidateConfig, main

    data, path = checkpoint
    result = main(ValidateConfig(data=data, path=path, valid_subset="test", cpu=True, cpu_matmul=choice))
    return torch.tensor([float(result["test"]["loss"])])


def generate(checkpoint, choice):
    """The scores of greedy continuations (the H- lines: the hypothesis' mean log-probability)."""
    from toolkit.generation import GenerationConfig
    from toolkit.inference.generate import GenerateConfig, generate_main

    data, path = checkpoint
    out = io.StringIO()
    cfg = GenerateConfig(data=data, path=path, gen_subset="test", cpu=True, cpu_matmul=choice, batch_size=8)
    generate_main(cfg, GenerationConfig(beam=1, max_len_b=6, prefix_size=2), out=out)
    return torch.tensor([float(m) for m in re.findall(r"^H-\d+\t(\S+)\t", out.getvalue(), re.MULTILINE)])


def hub(checkpoint, choice):
    from toolkit.inference.hub_utils import from_pretrained

    data, _ = checkpoint
    model = from_pretrained(data, "model.pt", ".", device="cpu", cpu_matmul=choice)
    return model.score("the cat sat on a mat")["positional_scores"]


def harness(checkpoint, choice):
    from toolkit.evaluation.harness import ToolkitLM

    data, path = checkpoint
    lm = ToolkitLM(path=path, data=data, device="cpu", cpu_matmul=choice)
    requests = [(None, [2, 5, 6, 7], [8, 9]), (None, [2, 9], [5, 6, 7, 8])]  # (request, context, continuation)
    return torch.tensor([score for score, _ in lm._loglikelihood_tokens(requests)])


COMMANDS = {"eval-lm": eval_lm, "validate": validate, "generate": generate, "hub": hub, "eval-harness": harness}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_sets_the_switch_once_and_on_off_score_alike(checkpoint, switch, command):
    run = COMMANDS[command]
    off = run(checkpoint, "torch")
    assert switch == {"selects": ["torch"], "onednn_products": 0}
    assert ops.chosen() is False and not ops.selected()
    on = run(checkpoint, "onednn")
    assert switch["selects"] == ["torch", "onednn"]  # once per command, at its start
    assert switch["onednn_products"] > 0
    assert ops.chosen() is True  # in force after the command, for the rest of the process
    assert off.numel() > 0 and torch.isfinite(off).all()
    torch.testing.assert_close(on, off, rtol=RTOL, atol=0)


def test_an_evaluation_inside_a_run_keeps_the_runs_choice(checkpoint, switch):
    """The harness given models in memory (an evaluation inside training) and no library keeps the process's."""
    from toolkit.evaluation.harness import ToolkitLM
    from toolkit.evaluation.loading import load_for_eval

    data, path = checkpoint
    ops.select("onednn")
    model, task, _ = load_for_eval(path, data, torch.device("cpu"))
    ToolkitLM(models=[model], task=task, device="cpu")
    assert switch["selects"] == ["onednn"] and ops.chosen() is True


def test_train_sets_the_switch_once(tmp_path, switch):
    """toolkit-train's run (in this process): one selection, before the model is built, in force for its steps."""
    from tests.helpers import dist_helpers as H
    from toolkit.train.resolve import parse_train_config
    from toolkit.train.train_loop import train

    data = H.make_lm_data_bin(str(tmp_path / "bin"))
    argv = [data, *H.model_args(str(tmp_path / "save")), "--max-update", "1", "--no-save", "--cpu-matmul", "onednn"]
    train(parse_train_config(argv))
    assert switch["selects"] == ["onednn"]
    assert switch["onednn_products"] > 0 and ops.chosen() is True
