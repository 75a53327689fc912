"""A record is one document, binarized as the model's Hugging Face tokenizer encodes it (issue 45, items 1-2).

With a tokenizer imported by ``toolkit-export --from hf`` (a byte-level BPE that encodes every byte: Llama's
convention with BOS first, Qwen2's with no special token, and a Llama whose template also appends EOS):

- a JSON lines / Parquet / ``datasets`` record is one item: exactly ``AutoTokenizer(text)["input_ids"]``, then one
  EOS (none added where the template already ends with it), code indentation, blank lines, CRLF and leading
  spaces included;
- a text file keeps fairseq's items, one per line, each line's ids as the tokenizer encodes the line, leading
  spaces included (BOS stays the model's context, not stored); ``--document-separator blank_line`` makes each
  paragraph one document;
- under ``--document-attention-mask`` the documents are the records (not their lines), each starting at its BOS
  at position 0; a block starting at a document reads its BOS as context, never as a target, with or without
  ``--add-bos-token``.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tests.helpers import preprocess  # noqa: E402
from tests.helpers.hf_documents import CODE, DOCUMENTS, PROSE, make_byte_level  # noqa: E402

LINES = [" no it was n't black monday ", " but while the new york stock exchange", "\tindented\twith tabs", "", "x"]


KINDS = ["llama", "qwen2", "llama_eos"]
ADDS_BOS = [kind for kind in KINDS if kind != "qwen2"]  # qwen2's tokenizer adds no BOS: a document starts from </s>


@pytest.fixture(scope="module", params=KINDS)
def imported(request, tmp_path_factory):
    from toolkit.core import registry
    from toolkit.export.api import ExportConfig, run_export

    registry.import_all_components()
    root = tmp_path_factory.mktemp(request.param)
    hf = make_byte_level(str(root / "hf"), bos=request.param != "qwen2", eos_after=request.param == "llama_eos")
    run_export(ExportConfig(path=str(root / "hf"), out=str(root / "ours"), import_from="hf"))
    tok = transformers.AutoTokenizer.from_pretrained(str(root / "hf"))
    return dict(kind=request.param, root=root, ours=root / "ours", tok=tok, hf=hf)


def binarize(imported, dest, *flags, workers=2):
    preprocess.run(*flags, "--destdir", dest, *preprocess.model_tokenizer_flags(imported["ours"]), "--workers", workers)
    return dest


def items(dest, split="train"):
    from toolkit.data.indexed_dataset import MMapIndexedDataset

    data = MMapIndexedDataset(str(dest / split))
    return [data[i].tolist() for i in range(len(data))]


def document_ids(imported, text):
    """What a document must become: AutoTokenizer's ids, then one EOS."""
    tok = imported["tok"]
    ids = tok(text)["input_ids"]
    return ids if imported["kind"] == "llama_eos" else ids + [tok.eos_token_id]


def write_records(path, fmt, texts):
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
        return ["--trainpref", path]
    if fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.table({"text": texts}), path, row_group_size=3)
        return ["--trainpref", path]
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(str(path))
    return ["--hf-dataset", path]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "datasets"])
def test_a_record_is_autotokenizers_ids_then_one_eos(imported, tmp_path, fmt):
    texts = DOCUMENTS * 4  # 28 records: the 2 workers each take a range of whole documents
    flags = write_records(tmp_path / f"train.{fmt}", fmt, texts)
    got = items(binarize(imported, tmp_path / "bin", *flags))
    assert got == [document_ids(imported, t) for t in texts]
    assert imported["tok"].decode(got[0], skip_special_tokens=True) == CODE  # indentation and newlines kept


def test_a_text_line_keeps_its_whitespace(imported, tmp_path):
    (tmp_path / "ptb.txt").write_text("".join(line + "\n" for line in LINES))
    got = items(binarize(imported, tmp_path / "bin", "--trainpref", tmp_path / "ptb.txt"))
    tok = imported["tok"]
    assert got == [tok(line, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for line in LINES]
    if imported["kind"] == "llama":  # BOS is the context the model reads first, not stored: AutoTokenizer's ids
        assert [[tok.bos_token_id] + ids[:-1] for ids in got] == [tok(line)["input_ids"] for line in LINES]


def test_blank_lines_separate_documents(imported, tmp_path):
    paragraphs = PROSE.split("\n\n\n")[0].split("\n\n") + ["  An indented paragraph", CODE.rstrip("\n")]
    (tmp_path / "docs.txt").write_text("\n\n".join(paragraphs) + "\n\n \n\t\n")
    flags = ["--trainpref", tmp_path / "docs.txt", "--document-separator", "blank_line"]
    got = items(binarize(imported, tmp_path / "bin", *flags, workers=1))
    assert got == [document_ids(imported, p) for p in paragraphs]


def test_whitespace_tokens_read_a_record_as_one_item(tmp_path):
    """No --bpe: a record's newlines separate words as its spaces do; one </s> per record."""
    from toolkit.data.dictionary import Dictionary

    texts = ["a b\nc  d\n\ne", "f", "", "g\r\nh"]
    write_records(tmp_path / "r.jsonl", "jsonl", texts)
    preprocess.run("--trainpref", tmp_path / "r.jsonl", "--destdir", tmp_path / "bin")
    d = Dictionary.load(str(tmp_path / "bin" / "dict.txt"))
    assert [[d[i] for i in ids] for ids in items(tmp_path / "bin")] == [t.split() + ["</s>"] for t in texts]


def sample_layout(dest, tokens_per_sample, mode="none", add_bos_token=False):
    from toolkit.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

    task = LanguageModelingTask.setup_task(
        LanguageModelingConfig(
            data=str(dest),
            tokens_per_sample=tokens_per_sample,
            sample_break_mode=mode,
            add_bos_token=add_bos_token,
            document_attention_mask=True,
            reset_position_ids=True,
        )
    )
    task.load_dataset("train")
    dataset = task.dataset("train")
    return dataset, dataset.collater([dataset[i] for i in range(len(dataset))])


def test_the_document_mask_masks_records_not_lines(imported, tmp_path):
    """One block holds the whole split: as many documents as records (their lines are not documents); a
    document that carries BOS starts at it, at position 0."""
    write_records(tmp_path / "r.jsonl", "jsonl", DOCUMENTS)
    records = binarize(imported, tmp_path / "records", "--trainpref", tmp_path / "r.jsonl")
    lines = [line for text in DOCUMENTS for line in text.replace("\r\n", "\n").split("\n")]
    (tmp_path / "lines.txt").write_text("".join(line + "\n" for line in lines))
    as_lines = binarize(imported, tmp_path / "lines", "--trainpref", tmp_path / "lines.txt")
    for dest, documents in ((records, len(DOCUMENTS)), (as_lines, len(lines))):
        total = sum(map(len, items(dest)))
        _, batch = sample_layout(dest, total)
        ids, positions = batch["net_input"]["document_ids"], batch["net_input"]["positions"]
        assert ids.size(0) == 1 and len(ids[0].unique()) == documents
    batch = sample_layout(records, sum(map(len, items(records))))[1]
    src, ids, positions = (batch["net_input"][k][0] for k in ("src_tokens", "document_ids", "positions"))
    starts = [0] + [t for t in range(1, len(ids)) if ids[t] != ids[t - 1]]
    assert all(positions[t] == 0 for t in starts)
    if imported["kind"] != "qwen2":
        assert all(src[t] == imported["tok"].bos_token_id for t in starts)


@pytest.mark.parametrize("imported", ADDS_BOS, indirect=True)
@pytest.mark.parametrize("add_bos_token", [False, True])
def test_a_block_reads_its_documents_bos_as_context(imported, tmp_path, add_bos_token):
    """One document per block (--sample-break-mode eos): the input is AutoTokenizer's ids, the targets the ids
    after the first, then EOS, as transformers reads them; --add-bos-token changes nothing (BOS is in the data).
    Only the tokenizers that add BOS: without one a document starts from </s>, as a line does."""
    write_records(tmp_path / "r.jsonl", "jsonl", DOCUMENTS)
    dest = binarize(imported, tmp_path / "bin", "--trainpref", tmp_path / "r.jsonl")
    dataset, _ = sample_layout(dest, 64, mode="eos", add_bos_token=add_bos_token)
    for i, text in enumerate(DOCUMENTS):
        item = document_ids(imported, text)
        sample = dataset[i]
        assert sample["source"].tolist() == item[:-1] and item[0] == imported["tok"].bos_token_id
        assert sample["target"].tolist() == item[1:]


@pytest.mark.parametrize("imported", ADDS_BOS, indirect=True)
def test_eval_lm_scores_each_record_as_transformers(imported, tmp_path):
    """One record per block: eval-lm's loss and count are transformers' on AutoTokenizer's ids and EOS, BOS the
    context and never counted; packed blocks count every token but the records' BOS. Only the tokenizers that add
    BOS: a record starting from </s> has no counterpart in transformers."""
    import math

    import torch

    from toolkit.inference import eval_lm_main as M

    write_records(tmp_path / "r.jsonl", "jsonl", DOCUMENTS)
    dest = binarize(imported, tmp_path / "bin", "--trainpref", tmp_path / "r.jsonl")
    want_sum, want_count = 0.0, 0
    for text in DOCUMENTS:
        ids = torch.tensor(document_ids(imported, text))
        with torch.no_grad():
            lp = torch.log_softmax(imported["hf"](ids[None]).logits[0].float(), dim=-1)
        want_sum += lp[:-1].gather(-1, ids[1:, None]).sum().item()
        want_count += len(ids) - 1
    model = str(imported["ours"] / "model.pt")
    got = M.main(M.EvalLMConfig(data=str(dest), path=model, cpu=True, gen_subset="train", sample_break_mode="eos"))
    assert got["count"] == want_count and abs(got["loss"] - (-want_sum / want_count / math.log(2))) < 1e-4
    packed = M.main(M.EvalLMConfig(data=str(dest), path=model, cpu=True, gen_subset="train", tokens_per_sample=32))
    assert packed["count"] == sum(map(len, items(dest))) - len(DOCUMENTS)


WIKITEXT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "wikitext-2-mini")


@pytest.fixture(scope="module")
def wikitext(tmp_path_factory):
    """A real corpus (WikiText-2's train split: 48 articles, 3,117 lines, every line starting with a space) and a
    Llama imported with a byte-level BPE of 2,000 tokens trained on it (BOS first)."""
    from toolkit.core import registry
    from toolkit.export.api import ExportConfig, run_export

    path = os.path.join(WIKITEXT, "wiki.train.tokens")
    if not os.path.isfile(path):
        pytest.skip(f"{path}: the shared corpora are not beside the project")
    registry.import_all_components()
    root = tmp_path_factory.mktemp("wikitext")
    text = open(path, encoding="utf-8").read()
    make_byte_level(str(root / "hf"), texts=[text], vocab_size=2000)
    run_export(ExportConfig(path=str(root / "hf"), out=str(root / "ours"), import_from="hf"))
    tok = transformers.AutoTokenizer.from_pretrained(str(root / "hf"))
    heading = re.compile(r"^ = [^=].* = $")
    lines = text.splitlines(keepends=True)
    headings = [i for i, line in enumerate(lines) if heading.match(line.rstrip("\n"))]
    starts = [0] + headings[1:] + [len(lines)]  # the file's first line (blank) opens the first article
    articles = ["".join(lines[a:b]) for a, b in zip(starts, starts[1:])]
    assert len(articles) == 48 and "".join(articles) == text
    return dict(kind="llama", root=root, ours=root / "ours", tok=tok, path=path, text=text, articles=articles)


def test_a_real_corpus_is_autotokenizers_ids_line_by_line(wikitext, tmp_path):
    """fairseq's items (a line each, then EOS), each line's ids AutoTokenizer's, its leading space included: the
    whole split holds AutoTokenizer's token count, more than its stripped lines give."""
    got = items(binarize(wikitext, tmp_path / "bin", "--trainpref", wikitext["path"]))
    tok, lines = wikitext["tok"], wikitext["text"].splitlines()
    want = [ids + [tok.eos_token_id] for ids in tok(lines, add_special_tokens=False)["input_ids"]]
    assert len(got) == len(lines) == 3117 and got == want
    stripped = sum(map(len, tok([line.strip() for line in lines], add_special_tokens=False)["input_ids"]))
    assert sum(map(len, got)) - len(lines) > stripped


def test_a_real_corpus_of_articles_is_one_document_each(wikitext, tmp_path):
    """Its 48 articles as JSON-lines records, 2 workers: each record AutoTokenizer's ids (BOS first, its blank
    lines and newlines included) then one EOS; the document mask of one block holding the split counts 48
    documents, each starting at its BOS at position 0."""
    articles = wikitext["articles"]
    write_records(tmp_path / "articles.jsonl", "jsonl", articles)
    dest = binarize(wikitext, tmp_path / "bin", "--trainpref", tmp_path / "articles.jsonl")
    got = items(dest)
    assert got == [document_ids(wikitext, article) for article in articles]
    _, batch = sample_layout(dest, sum(map(len, got)))
    src, ids, positions = (batch["net_input"][k][0] for k in ("src_tokens", "document_ids", "positions"))
    starts = torch.nonzero(torch.diff(ids)).squeeze(1) + 1
    assert len(ids.unique()) == len(articles) == 48 and len(starts) == 47
    assert (positions[starts] == 0).all() and (src[starts] == wikitext["tok"].bos_token_id).all()
