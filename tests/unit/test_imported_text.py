"""Text in and out of models imported with ``toolkit-export --from hf`` (tiny random HF Llama, fp32).

- Multi-line text: a data-bin made with the import's ``toolkit-preprocess`` command holds each line's ids
  followed by EOS. eval-lm and training read it as transformers reads ``[BOS] + those ids`` (BOS is the
  context a line starts from, never ``<s> </s>`` and never BOS in the middle of the text), so eval-lm's
  per-token log-probs equal ``log_softmax(model(input_ids).logits)`` within 1e-4, in every break mode and
  with a context window; the hub's ``score(text, replace_newlines_with_eos=True)`` gives the same ids.
- ``toolkit-generate`` / ``toolkit-interactive`` on the imported folder (``--path`` the checkpoint or the
  folder) tokenize with the model's tokenizer: greedy output = transformers' ``generate(do_sample=False)``
  ids for the same prompt, ``D-`` lines the tokenizer's decoding of them; a data-bin whose dictionary is
  not the model's is refused in one line.
"""

from __future__ import annotations

import io
import json
import math
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tests.helpers import preprocess  # noqa: E402
from tests.helpers.hf_llama import make_hf  # noqa: E402
from toolkit.export.api import ExportConfig, run_export  # noqa: E402

LINES = ["w3 w17 w59 w0", "w1 w2 w40 w40 w7 w12", "w5 w9", "w8 w8 w30 w4 w11"]
TOL = 1e-4  # fp32, the same weights: only summation order differs


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("imported")
    hf = make_hf(str(root / "hf"), "llama")
    ours = root / "ours"
    run_export(ExportConfig(path=str(root / "hf"), out=str(ours), import_from="hf"))
    (root / "test.txt").write_text("\n".join(LINES) + "\n")
    preprocess.run(
        "--testpref",
        root / "test.txt",
        "--destdir",
        root / "bin",
        "--srcdict",
        ours / "dict.txt",
        "--bpe",
        "hf_byte_bpe",
        "--bpe-model",
        ours / "tokenizer.json",
        "--workers",
        "1",
    )
    tok = transformers.AutoTokenizer.from_pretrained(str(root / "hf"))
    return dict(root=root, hf=hf, ours=ours, bin=root / "bin", tok=tok)


def hf_ids(tok, lines) -> torch.Tensor:
    """transformers' ids for the lines joined by its EOS token (one EOS after each line, BOS first)."""
    return torch.tensor(tok("".join(f"{line} {tok.eos_token} " for line in lines))["input_ids"])


def hf_scores(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        lp = torch.log_softmax(hf(ids[None]).logits[0].float(), dim=-1)
    return lp[:-1].gather(-1, ids[1:, None]).squeeze(-1)


def eval_rows(imported, **options):
    """eval-lm's (sample id, targets, per-token log-probs) rows, built as toolkit-eval-lm builds them."""
    from toolkit import inference
    from toolkit.inference import eval_lm as E
    from toolkit.inference import eval_lm_main as M

    cfg = M.EvalLMConfig(data=str(imported["bin"]), path=str(imported["ours"] / "model.pt"), cpu=True, **options)
    models, train_task, args = inference.load_ensemble(cfg.path, cfg.data, torch.device("cpu"))
    tps = cfg.tokens_per_sample or args.tokens_per_sample
    task = M.eval_task(cfg, train_task.dictionary, cfg.data, tps, M.reads_bos_first(cfg, train_task.dictionary, args))
    dataset = task.dataset("test")
    rows = []
    for sample in E.eval_batches(
        dataset,
        cfg.context_window,
        task.cfg.tokens_per_sample,
        task.dictionary.pad(),
        max_positions=models[0].max_positions(),
    ):
        rows += E.score_sample(models, sample, task.dictionary.pad(), models[0].max_positions(), 0, torch.device("cpu"))
    return sorted(rows, key=lambda r: r[0]), M.main(cfg)


def test_the_import_records_its_tokenizer_under_the_folders_final_name(imported):
    """The import is written to a temporary folder and renamed: bpe.json names the file later commands open."""
    record = json.loads((imported["ours"] / "bpe.json").read_text())
    assert record["source"]["bpe_model"] == os.path.abspath(imported["ours"] / "tokenizer.json")


def test_the_data_bin_holds_each_lines_ids_then_eos(imported):
    from toolkit.data.indexed_dataset import MMapIndexedDataset

    data = MMapIndexedDataset(str(imported["bin"] / "test"))
    want = hf_ids(imported["tok"], LINES)[1:].tolist()  # without the BOS
    assert torch.cat([torch.as_tensor(data[i]) for i in range(len(data))]).tolist() == want


@pytest.mark.parametrize("add_bos_flag", [False, True])
def test_eval_lm_scores_a_multi_line_text_as_transformers(imported, add_bos_flag):
    """One block holds the whole text: its rows are transformers' log-probs of [BOS] + stream, with or
    without --add-bos-token (the imported model always reads BOS first), and BOS itself is not counted."""
    ids = hf_ids(imported["tok"], LINES)
    want = hf_scores(imported["hf"], ids)
    ((_, targets, scores),) = eval_rows(imported, tokens_per_sample=64, add_bos_token=add_bos_flag)[0]
    assert targets.tolist() == ids[1:].tolist()
    assert (scores - want).abs().max().item() < TOL
    result = eval_rows(imported, tokens_per_sample=64, add_bos_token=add_bos_flag)[1]
    assert result["count"] == len(ids) - 1
    assert abs(result["loss"] - (-want.mean().item() / math.log(2))) < TOL


def test_eval_lm_one_line_per_block_is_each_line_alone(imported):
    rows, result = eval_rows(imported, sample_break_mode="eos")
    assert len(rows) == len(LINES)
    for (_, targets, scores), line in zip(rows, LINES):
        ids = hf_ids(imported["tok"], [line])
        assert targets.tolist() == ids[1:].tolist()
        assert (scores - hf_scores(imported["hf"], ids)).abs().max().item() < TOL
    assert result["count"] == sum(len(r[1]) for r in rows)


def test_a_context_window_continues_the_text_without_bos_inside(imported):
    """Blocks of one token, each after up to 40 earlier tokens: the whole text is context, so every score is
    transformers' on the full text; a block that starts a line gets the previous line's EOS back in front of
    it (the carried context), not BOS."""
    ids = hf_ids(imported["tok"], LINES)
    assert len(ids) <= 41
    rows, result = eval_rows(imported, tokens_per_sample=41, context_window=40, batch_size=1)
    got = torch.cat([scores for _, _, scores in rows])
    assert torch.cat([t for _, t, _ in rows]).tolist() == ids[1:].tolist()
    assert (got - hf_scores(imported["hf"], ids)).abs().max().item() < TOL
    assert result["count"] == len(ids) - 1


@pytest.mark.parametrize("mode", ["none", "complete", "eos"])
def test_training_samples_are_transformers_inputs_and_labels(imported, mode):
    """--add-bos-token (the import's fine-tune flag) with this dictionary: every sample that starts a line is
    source [BOS] + ids[:-1], target ids; <s> is never a target and stands nowhere but first."""
    from toolkit.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

    task = LanguageModelingTask.setup_task(
        LanguageModelingConfig(
            data=str(imported["bin"]), tokens_per_sample=64, sample_break_mode=mode, add_bos_token=True
        )
    )
    task.load_dataset("test")
    dataset, bos = task.dataset("test"), task.dictionary.bos()
    texts = [LINES] if mode != "eos" else [[line] for line in LINES]
    for i, lines in enumerate(texts):
        ids = hf_ids(imported["tok"], lines)
        sample = dataset[i]
        assert sample["source"].tolist() == ids[:-1].tolist() and sample["target"].tolist() == ids[1:].tolist()
        assert (sample["source"] == bos).sum() == 1 and (sample["target"] != bos).all()
    assert dataset.seq_lengths().tolist() == dataset.sizes.tolist()


def test_hub_score_with_newlines_as_eos_is_transformers(imported):
    from toolkit.inference.hub_utils import from_pretrained

    lm = from_pretrained(str(imported["ours"]), "model.pt", device="cpu")
    ids = hf_ids(imported["tok"], LINES)
    got = lm.score("\n".join(LINES), replace_newlines_with_eos=True)
    assert got["tokens"].tolist() == ids[1:].tolist()
    assert (got["positional_scores"] - hf_scores(imported["hf"], ids)).abs().max().item() < TOL


def test_hub_with_the_data_bin_reads_text_as_transformers(imported):
    """The README's hub example with the data-bin as ``data_name_or_path``: the model's tokenizer (the data-bin's
    copy of it), so BOS first and transformers' log-probs, as with the import's folder (was ``</s>`` first)."""
    from toolkit.inference.hub_utils import from_pretrained

    lm = from_pretrained(str(imported["ours"]), "model.pt", data_name_or_path=str(imported["bin"]), device="cpu")
    for text in LINES:
        ids = torch.tensor(imported["tok"](text)["input_ids"])
        assert lm.encode(text).tolist() == ids.tolist()
        got = lm.score(text)
        assert (got["positional_scores"] - hf_scores(imported["hf"], ids)).abs().max().item() < TOL


TEXTS = LINES + ["w3 zz w1", ""]


def test_hf_export_with_the_data_bin_carries_the_models_tokenizer(imported, tmp_path):
    """``--format hf`` given the data-bin (as a fine-tuned checkpoint records it): the model's own tokenizer and
    class, never a tokenizer rebuilt from dict.txt; the harness reads the data-bin with the same ids."""
    import json

    from toolkit.evaluation.harness import ToolkitLM

    run_export(
        ExportConfig(
            path=str(imported["ours"] / "model.pt"), data=str(imported["bin"]), format="hf", out=str(tmp_path / "hf")
        )
    )
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (imported["ours"] / "tokenizer.json").read_bytes()
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert [exported(t)["input_ids"] for t in TEXTS] == [imported["tok"](t)["input_ids"] for t in TEXTS]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["rope_scaling"]["rope_type"] == "llama3"
    lm = ToolkitLM(path=str(imported["ours"] / "model.pt"), data=str(imported["bin"]), device="cpu")
    assert [lm.tok_encode(t) for t in TEXTS] == [imported["tok"](t)["input_ids"] for t in TEXTS]


def test_hf_export_of_a_vocabulary_without_its_tokenizer_is_refused(imported, tmp_path):
    """A dict.txt that is a tokenizer's vocabulary, its tokenizer absent: refused, nothing written (a tokenizer
    built from dict.txt splits on whitespace: ids the model never saw)."""
    import shutil

    from toolkit.core.errors import UserError

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copyfile(imported["ours"] / "dict.txt", bare / "dict.txt")
    with pytest.raises(UserError, match="the vocabulary of a tokenizer .* neither tokenizer.json nor hf_byte_bpe.json"):
        run_export(
            ExportConfig(path=str(imported["ours"] / "model.pt"), data=str(bare), format="hf", out=str(tmp_path / "hf"))
        )
    assert not (tmp_path / "hf").exists()


def hf_greedy(imported, prompt_ids: torch.Tensor, new_tokens: int) -> list:
    """transformers' greedy continuation ids (prompt first), pad suppressed as the toolkit never emits it."""
    pad = imported["tok"].convert_tokens_to_ids("<unk>")  # the import's pad: Llama's tokenizer has none
    with torch.no_grad():
        out = (
            imported["hf"]
            .generate(
                prompt_ids[None],
                attention_mask=torch.ones_like(prompt_ids[None]),
                max_new_tokens=new_tokens,
                do_sample=False,
                suppress_tokens=[pad],
                pad_token_id=pad,
            )[0]
            .tolist()
        )
    return out[:-1] if out[-1] == imported["tok"].eos_token_id else out


def result_lines(text: str, kind: str) -> dict:
    """{sample id: the line's fields after the id} for one kind of fairseq line (S, H, D, P)."""
    lines = [line.split("\t") for line in text.splitlines() if line.startswith(f"{kind}-")]
    return {int(fields[0].split("-")[1]): fields[1:] for fields in lines}


def hypothesis_ids(imported, fields) -> list:
    from toolkit.data.dictionary import Dictionary

    d = Dictionary.load(str(imported["ours"] / "dict.txt"))
    return [d.index(sym) for sym in fields[-1].split()]


@pytest.mark.parametrize("path", ["model.pt", "."])
def test_interactive_greedy_equals_transformers_generate(imported, path):
    from toolkit.generation import GenerationConfig
    from toolkit.inference.generate import InteractiveConfig, interactive_main

    prompts = ["w3 w17 w59", "w1", "w40 w2 w7 w7"]
    out = io.StringIO()
    cfg = InteractiveConfig(
        data=str(imported["ours"]), path=str(imported["ours"] / path), cpu=True, batch_size=2, buffer_size=2
    )
    # --max-len-b counts the prompt: the longest prompt gets 10 new tokens, the others more (then cut to 10)
    interactive_main(cfg, GenerationConfig(beam=1, max_len_b=14), stdin=io.StringIO("\n".join(prompts) + "\n"), out=out)
    hyps, texts, shown = (
        result_lines(out.getvalue(), "H"),
        result_lines(out.getvalue(), "D"),
        result_lines(out.getvalue(), "S"),
    )
    for i, prompt in enumerate(prompts):
        ids = torch.tensor(imported["tok"](prompt)["input_ids"])
        want = hf_greedy(imported, ids, 10)[1:]  # without the BOS
        assert hypothesis_ids(imported, hyps[i])[: len(want)] == want, prompt
        assert shown[i] == [prompt]
        assert texts[i][-1] == imported["tok"].decode(hypothesis_ids(imported, hyps[i]), skip_special_tokens=True)


def test_generate_from_the_imported_data_bin_equals_transformers(imported):
    from toolkit.generation import GenerationConfig
    from toolkit.inference.generate import GenerateConfig, generate_main

    out = io.StringIO()
    cfg = GenerateConfig(data=str(imported["bin"]), path=str(imported["ours"] / "model.pt"), cpu=True)
    generate_main(cfg, GenerationConfig(beam=1, max_len_b=12, prefix_size=2), {"sample_break_mode": "eos"}, out=out)
    hyps, texts = result_lines(out.getvalue(), "H"), result_lines(out.getvalue(), "D")
    assert sorted(hyps) == list(range(len(LINES)))
    for i, line in enumerate(LINES):
        ids = torch.tensor(imported["tok"](line)["input_ids"][:3])  # BOS and the first 2 tokens: --prefix-size 2
        want = hf_greedy(imported, ids, 10)[1:]
        assert hypothesis_ids(imported, hyps[i])[: len(want)] == want, line
        assert texts[i][-1] == imported["tok"].decode(hypothesis_ids(imported, hyps[i]), skip_special_tokens=True)


def test_a_data_bin_of_another_dictionary_is_refused_in_one_line(imported, tmp_path, capsys):
    from toolkit_cli.interactive import cli_main

    (tmp_path / "train.txt").write_text("a b c\nb c d\n")
    preprocess.run("--trainpref", tmp_path / "train.txt", "--destdir", tmp_path / "bin", "--workers", "1")
    with pytest.raises(SystemExit) as e:
        cli_main([str(tmp_path / "bin"), "--path", str(imported["ours"]), "--cpu", "--input", "-"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code != 0 and len(err) == 1 and err[0].startswith("toolkit-interactive: error: "), err
    assert "dict.txt" in err[0], err


def test_an_imported_vocabulary_without_its_tokenizer_is_refused_in_one_line(imported, tmp_path):
    """Without tokenizer.json the prompt could only be split on whitespace: ids the model never saw."""
    import shutil

    from toolkit.core.errors import UserError
    from toolkit.generation import GenerationConfig
    from toolkit.inference.generate import InteractiveConfig, interactive_main

    folder = tmp_path / "bare"
    shutil.copytree(imported["ours"], folder)
    for name in ("tokenizer.json", "hf_byte_bpe.json", "bpe.json"):
        (folder / name).unlink()
    cfg = InteractiveConfig(data=str(folder), path=str(folder), cpu=True)
    with pytest.raises(UserError, match="dict.txt is a tokenizer's vocabulary .* no tokenizer.json"):
        interactive_main(cfg, GenerationConfig(beam=1), stdin=io.StringIO("w3\n"), out=io.StringIO())


def test_interactive_with_a_tokenizer_without_bos_starts_from_the_first_token(tmp_path):
    """Qwen2's tokenizer adds no BOS: a prompt's first token is the context (prompts grouped by it), printed in
    S-, H- and D- as part of the text; greedy output is transformers' generate from the prompt's ids."""
    from toolkit.data.dictionary import Dictionary
    from toolkit.generation import GenerationConfig
    from toolkit.inference.generate import InteractiveConfig, interactive_main

    hf = make_hf(str(tmp_path / "hf"), "qwen2")
    run_export(ExportConfig(path=str(tmp_path / "hf"), out=str(tmp_path / "ours"), import_from="hf"))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    prompts = ["w3 w17", "z5 w9 w1", "w3 w40"]  # two contexts: w (twice) and z
    out = io.StringIO()
    cfg = InteractiveConfig(
        data=str(tmp_path / "ours"), path=str(tmp_path / "ours"), cpu=True, batch_size=3, buffer_size=3
    )
    interactive_main(cfg, GenerationConfig(beam=1, max_len_b=9), stdin=io.StringIO("\n".join(prompts)), out=out)
    hyps, texts, shown = (result_lines(out.getvalue(), kind) for kind in "HDS")
    imported = dict(ours=tmp_path / "ours")
    pad = Dictionary.load(str(tmp_path / "ours" / "dict.txt")).pad()  # an unused row, never generated here
    for i, prompt in enumerate(prompts):
        ids = torch.tensor(tok(prompt)["input_ids"])
        with torch.no_grad():
            want = hf.generate(
                ids[None],
                attention_mask=torch.ones_like(ids[None]),
                max_new_tokens=6,
                do_sample=False,
                suppress_tokens=[pad],
                pad_token_id=pad,
            )[0].tolist()
        got = hypothesis_ids(imported, hyps[i])
        assert got[: len(want)] == want[: len(got)] and len(got) >= len(ids) + 1, prompt
        assert shown[i] == [prompt] and texts[i][-1] == tok.decode(got, skip_special_tokens=True)


def test_a_qwen2_import_reads_text_as_autotokenizer_not_as_the_file(tmp_path):
    """transformers 5 builds a Qwen2 folder's tokenizer as ``Qwen2Tokenizer`` (digits split one by one) whatever
    tokenizer.json holds; the import takes that tokenizer, so the hub, the harness and the ``--format hf`` export
    give ``AutoTokenizer``'s ids (the test folder's file merges "17", "12" and "59": other ids)."""
    import tokenizers

    from toolkit.evaluation.harness import ToolkitLM
    from toolkit.inference.hub_utils import from_pretrained

    make_hf(str(tmp_path / "hf"), "qwen2")
    run_export(ExportConfig(path=str(tmp_path / "hf"), out=str(tmp_path / "ours"), import_from="hf"))
    texts = ["w17 w12 w59", "w3 w1"]
    auto = [transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))(t)["input_ids"] for t in texts]
    in_file = tokenizers.Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    assert in_file.encode(texts[0]).ids != auto[0]
    lm = from_pretrained(str(tmp_path / "ours"), "model.pt", device="cpu")
    assert [lm.encode(t).tolist() for t in texts] == auto
    harness = ToolkitLM(path=str(tmp_path / "ours" / "model.pt"), device="cpu")
    assert [harness.tok_encode(t) for t in texts] == auto
    run_export(ExportConfig(path=str(tmp_path / "ours" / "model.pt"), format="hf", out=str(tmp_path / "back")))
    back = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back"))
    assert [back(t)["input_ids"] for t in texts] == auto
