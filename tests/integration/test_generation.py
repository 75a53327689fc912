"""Generation: the KV cache, greedy / sampling / beam search against direct computations, the two commands."""

import io
import os
import re

import pytest
import torch

from tests.helpers.lm_fixtures import make_data_bin
from tests.helpers.cli import run_cli, train
from toolkit.core.errors import UserError
from toolkit.generation import GenerationConfig, SequenceGenerator
from toolkit.inference.generate import GenerateConfig, InteractiveConfig, generate_main, interactive_main
from toolkit.models.transformer_lm import TransformerLanguageModel

WORDS = "the a cat dog sat ran on under mat log and then".split()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    rng = torch.Generator().manual_seed(0)
    lines = [
        " ".join(WORDS[i] for i in torch.randint(len(WORDS), (int(n),), generator=rng).tolist())
        for n in torch.randint(3, 12, (300,), generator=rng)
    ]
    data = tmp_path_factory.mktemp("gen-bin")
    make_data_bin(data, {"train": lines, "valid": lines[:30], "test": lines[30:40]})
    save = str(tmp_path_factory.mktemp("gen-ck"))
    train(str(data), save, "--max-update", "4")
    return str(data), os.path.join(save, "checkpoint_best.pt")


HYPO = re.compile(r"^H-(\d+)\t(-?[\d.e-]+)\t(.*)$")
POSITIONAL = re.compile(r"^P-(\d+)\t((?:-?\d+\.\d{4} ?)+)$")


def check_hypotheses(stdout: str, nbest: int, prompts=None):
    lines = stdout.splitlines()
    hypos = [HYPO.match(line) for line in lines if line.startswith("H-")]
    positional = [POSITIONAL.match(line) for line in lines if line.startswith("P-")]
    detok = [line.split("\t") for line in lines if line.startswith("D-")]
    assert hypos and all(hypos) and all(positional) and len(hypos) == len(positional) == len(detok)
    for h, p, dl in zip(hypos, positional, detok):
        scores = [float(x) for x in p.group(2).split()]
        assert len(scores) == len(h.group(3).split()) + 1  # one per token and the final </s>
        assert float(h.group(2)) == pytest.approx(sum(scores) / len(scores), abs=1e-3)  # lenpen 1, base 2
        assert dl[0] == f"D-{h.group(1)}" and dl[1] == h.group(2) and dl[2] == h.group(3)
        if prompts is not None:
            assert h.group(3).startswith(prompts[int(h.group(1))])
    ids = [int(h.group(1)) for h in hypos]
    assert ids == sorted(ids) and all(ids.count(i) == nbest for i in set(ids))
    return hypos


def test_interactive_end_to_end(trained, tmp_path):
    data, ckpt = trained
    prompts = ["the cat", "", "a dog sat on"]
    (tmp_path / "in.txt").write_text("\n".join(prompts) + "\n")
    run = run_cli(
        "toolkit_cli.interactive",
        [
            data,
            "--path",
            ckpt,
            "--input",
            str(tmp_path / "in.txt"),
            "--beam",
            "3",
            "--nbest",
            "2",
            "--max-len-b",
            "12",
            "--buffer-size",
            "3",
            "--batch-size",
            "2",
            "--cpu",
        ],
    )
    assert run.returncode == 0, run.stderr
    check_hypotheses(run.stdout, nbest=2, prompts=prompts)
    sources = [line for line in run.stdout.splitlines() if line.startswith(("S-", "W-"))]
    assert sources[0] == "S-0\tthe cat" and re.match(r"^W-0\t\d+\.\d{3}\tseconds$", sources[1])

    # the command's best hypothesis is the library's, and sampling is reproducible with --seed
    from toolkit.inference import load_model

    model, task, _ = load_model(ckpt, data)
    cfg = GenerationConfig(beam=3, nbest=2, max_len_b=12)
    (hypos,) = SequenceGenerator([model], task.dictionary, cfg).generate(
        [task.dictionary.encode_line("a dog sat on", append_eos=False).long()]
    )
    best = hypos[0]
    h2 = [line for line in run.stdout.splitlines() if line.startswith("H-2\t")][0]
    assert h2.split("\t")[2] == task.dictionary.string(best["tokens"])
    # sampling is reproducible with --seed (the library function behind the command, in process)
    cfg = InteractiveConfig(data=data, path=ckpt, seed=7, cpu=True)
    gen_cfg = GenerationConfig(sampling=True, sampling_topk=5, beam=2, nbest=2, max_len_b=12)
    outputs = []
    for _ in range(2):
        out = io.StringIO()
        interactive_main(cfg, gen_cfg, stdin=io.StringIO("\n".join(prompts) + "\n"), out=out)
        outputs.append([h.group(3) for h in check_hypotheses(out.getvalue(), nbest=2, prompts=prompts)])
    assert outputs[0] == outputs[1]


def test_generate_end_to_end(trained):
    data, ckpt = trained
    run = run_cli(
        "toolkit_cli.generate",
        [
            data,
            "--path",
            ckpt,
            "--task",
            "language_modeling",
            "--gen-subset",
            "test",
            "--sample-break-mode",
            "eos",
            "--prefix-size",
            "2",
            "--beam",
            "2",
            "--max-len-b",
            "10",
            "--batch-size",
            "4",
        ],
    )
    assert run.returncode == 0, run.stderr
    targets = {
        int(line.split("\t")[0][2:]): line.split("\t")[1] for line in run.stdout.splitlines() if line.startswith("T-")
    }
    assert sorted(targets) == list(range(10))
    for h in check_hypotheses(run.stdout, nbest=1):
        assert h.group(3).split()[:2] == targets[int(h.group(1))].split()[:2]  # the prefix is kept
    assert "Translated 10 sentences" in run.stdout

    with pytest.raises(UserError, match="--sampling-topk requires --sampling"):
        generate_main(GenerateConfig(data=data, path=ckpt), GenerationConfig(sampling_topk=5))
    with pytest.raises(UserError, match="--sampling requires --nbest"):
        generate_main(GenerateConfig(data=data, path=ckpt), GenerationConfig(sampling=True))


def test_hub_takes_fairseqs_names_and_uses_the_generator(trained):

    data, ckpt = trained
    lm = TransformerLanguageModel.from_pretrained(os.path.dirname(ckpt), "checkpoint_best.pt", data, device="cpu")
    prompt = lm.encode("the cat")
    (direct,) = SequenceGenerator(
        list(lm.models), lm.dictionary, GenerationConfig(beam=3, nbest=3, max_len_b=8)
    ).generate([prompt[:-1]])
    hypos = lm.generate(prompt, beam=3, max_len_b=8)
    assert [h["tokens"].tolist() for h in hypos] == [h["tokens"].tolist() for h in direct]
    assert lm.sample("the cat", max_len_b=8) == lm.decode(lm.generate(prompt, beam=1, max_len_b=8)[0]["tokens"])

    fairseq_style = lm.sample("the cat", beam=1, sampling=True, sampling_topk=5, temperature=0.8, seed=3)
    assert fairseq_style.startswith("the cat")
    assert lm.sample("the cat", topk=5, temperature=0.8, seed=3) == fairseq_style  # short names, implied sampling
    assert lm.sample(["the cat", "a dog"], sampling=True, sampling_topp=0.9, seed=1, max_len=4)[1].startswith("a dog")
    with pytest.raises(UserError, match="unknown argument 'sampling_top_k'"):
        lm.sample("the cat", sampling_top_k=5)
