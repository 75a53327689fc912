"""The 2026 dense refreshes, OLMo 3 and SmolLM3, in and out of Hugging Face and through a training run.

For a random tiny Olmo3ForCausalLM (OLMo 2's norms and QK-norm over the projections, a local layer of window 6
then a global one, YaRN on the global layer only) and a SmolLM3ForCausalLM (a rotating layer then a NoPE one,
GQA, tied embeddings), each saved by transformers with a tokenizer that adds BOS: ``--from hf`` imports it as its
own family with the tokenizer's ids (``AutoTokenizer``'s); its log-probs equal transformers' within 1e-4 in fp32 on
a text longer than the window; greedy decoding through the KV cache equals ``generate(do_sample=False)``;
``--format hf`` writes the same class back with the same log-probs. The family's tiny size trains a few updates in
one process and toolkit-eval-lm on its checkpoint equals the log-probabilities of the model's own forward.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tests.helpers import dist_helpers as H  # noqa: E402
from tests.helpers.eval_reference import assert_eval_lm_equals_forward  # noqa: E402
from tests.helpers.hf_llama import SHAPES, WINDOW, greedy_pair, save_tokenizer  # noqa: E402
from toolkit.export.api import ExportConfig, run_export  # noqa: E402
from toolkit.inference import load_model  # noqa: E402

pytestmark = pytest.mark.integration

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 500000.0}
CONFIGS = {
    "olmo3": lambda: transformers.Olmo3Config(
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": YARN,
            "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
        },
        tie_word_embeddings=False,
        **SHAPES,
        **IDS,
    ),
    "smollm3": lambda: transformers.SmolLM3Config(
        num_key_value_heads=2,
        no_rope_layer_interval=2,  # saved as no_rope_layers [1, 0] beside it, as SmolLM3-3B's [1, 1, 1, 0, ...]
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0},
        tie_word_embeddings=True,
        pad_token_id=None,  # its default (128004) is no id of the tiny vocabulary
        **SHAPES,
        **IDS,
    ),
}
IDS: dict = {}  # the word-level tokenizer's ids, the same for every folder (save_tokenizer's)
#: what the import reads of each class's own settings
READ = {
    "olmo3": dict(sliding_window=WINDOW, layer_types="sliding_attention,full_attention", rope_scaling="yarn"),
    "smollm3": dict(nope_layer_interval=2, nope_layers=None, share_decoder_input_output_embed=True),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def imported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    IDS.update(save_tokenizer(str(root / "hf"), "llama"))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]()).eval()
    hf.save_pretrained(str(root / "hf"))
    run_export(ExportConfig(path=str(root / "hf"), out=str(root / "ours"), import_from="hf"))
    model, task, args = load_model(str(root / "ours" / "model.pt"), str(root / "ours"))
    return dict(kind=request.param, root=root, hf=hf, model=model, task=task, args=args)


def batch(n: int = 20) -> torch.Tensor:
    return torch.randint(3, 60, (2, n), generator=torch.Generator().manual_seed(1))  # longer than the window (6)


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def test_imports_as_its_family_with_the_tokenizers_ids(imported):
    model, d = imported["model"], imported["task"].dictionary
    assert imported["args"].arch == imported["kind"]
    assert {k: getattr(model.cfg, k) for k in READ[imported["kind"]]} == READ[imported["kind"]]
    tok = transformers.AutoTokenizer.from_pretrained(str(imported["root"] / "ours"))
    text = "w3 w17 w59 w0"
    ids = tok(text)["input_ids"]
    assert ids == transformers.AutoTokenizer.from_pretrained(str(imported["root"] / "hf"))(text)["input_ids"]
    assert [d[i] for i in ids] == tok.convert_ids_to_tokens(ids) and ids[0] == d.bos()
    assert len(d) == imported["hf"].config.vocab_size and d.eos() == imported["hf"].config.eos_token_id


def test_log_probs_equal_transformers(imported):
    x = batch()
    with torch.no_grad():
        ours = imported["model"].get_normalized_probs(imported["model"](x))
        theirs = log_probs(imported["hf"](x).logits)
    assert (ours - theirs).abs().max().item() < 1e-4


def test_greedy_generation_with_the_cache_equals_transformers(imported):
    want, got = greedy_pair(imported["model"], imported["hf"], torch.tensor([[1, 5, 9, 13]]), 12)
    assert got == want


def test_export_back_gives_the_same_class_and_log_probs(imported):
    back = imported["root"] / "back"
    run_export(ExportConfig(path=str(imported["root"] / "ours" / "model.pt"), out=str(back), format="hf"))
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(str(back), dtype=torch.float32).eval()
    assert type(hf2).__name__ == type(imported["hf"]).__name__
    assert hf2.config.layer_types == imported["hf"].config.layer_types
    x = batch()
    with torch.no_grad():
        assert (log_probs(hf2(x).logits) - log_probs(imported["hf"](x).logits)).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["olmo3_tiny", "smollm3_tiny"])
def test_tiny_size_trains_and_its_checkpoint_evaluates(arch, tmp_path):
    data_bin = H.make_lm_data_bin(str(tmp_path / "bin"))
    args = H.llama_args(tmp_path / "ck")
    args[args.index("--arch") + 1] = arch
    proc = H.run_train([data_bin, *args, "--max-update", "3", "--disable-validation"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = H.losses(proc.stdout)
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) for v in losses.values())
    assert_eval_lm_equals_forward(str(tmp_path / "ck" / "checkpoint_last.pt"), data_bin)
