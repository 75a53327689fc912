"""--document-attention-mask / --reset-position-ids: a document inside a packed block scores as it does alone."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers.lm_fixtures import make_data_bin
from toolkit.data.lm_dataset import MonolingualDataset, document_layout
from toolkit.data.token_block_dataset import TokenBlockDataset
from toolkit.models import model_config
from toolkit.models.common.attention import attend, attention_mask
from toolkit.models.common.attention.masks import block_mask
from toolkit.models.llama.model import LlamaLanguageModel
from toolkit.models.transformer_lm import TransformerLanguageModel, TransformerLMConfig

VOCAB, PAD, EOS = 40, 1, 2


def transformer(kind, dim=32):
    positions = {"learned": dict(decoder_learned_pos=True), "sinusoidal": {}}[kind]
    cfg = TransformerLMConfig(
        decoder_layers=2,
        decoder_embed_dim=dim,
        decoder_ffn_embed_dim=64,
        decoder_attention_heads=4,
        max_target_positions=64,
        dropout=0.0,
        decoder_normalize_before=True,
        **positions,
    )
    return TransformerLanguageModel(cfg, VOCAB, PAD, seed=3).eval()


def llama(arch, **overrides):
    return LlamaLanguageModel(
        model_config(arch, max_target_positions=64, **overrides), VOCAB, padding_idx=PAD, seed=3
    ).eval()


MODELS = {
    "transformer_lm-learned": lambda: transformer("learned"),
    "transformer_lm-sinusoidal": lambda: transformer("sinusoidal"),
    # heads of 16: on CUDA the compiled flex_attention kernel (narrower heads use the dense mask)
    "transformer_lm-heads-of-16": lambda: transformer("learned", dim=64),
    "llama": lambda: llama("llama_tiny"),
    "llama-gqa": lambda: llama("llama_tiny_gqa"),
    # a local layer (window 6) then a global one; OLMo 2's norms after the sublayers
    "llama-local-global": lambda: llama("llama_tiny", sliding_window=6, layer_types="sliding_attention,full_attention"),
    "olmo2": lambda: llama("olmo2_tiny"),
    "gemma3": lambda: llama("gemma3_tiny"),
}


def documents(seed=0):
    """Token lines (each ending in </s>) of different lengths."""
    rng = np.random.RandomState(seed)
    return [np.concatenate([rng.randint(4, VOCAB, size=n), [EOS]]) for n in (5, 11, 1, 8, 14, 3)]


def token_losses(model, src, tgt, **kw):
    with torch.no_grad():
        logits = model(src, **kw)
    return F.cross_entropy(logits.reshape(-1, VOCAB).double(), tgt.reshape(-1), reduction="none").view(tgt.shape)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_document_in_a_packed_block_equals_it_alone(name, device="cpu", tol=1e-5):
    model = MODELS[name]().to(device)
    docs = documents()
    stream = np.concatenate(docs)
    # the packed block: targets are the stream, sources it shifted right after a leading </s>
    tgt = torch.as_tensor(stream, device=device)[None]
    src = torch.as_tensor(np.concatenate([[EOS], stream[:-1]]), device=device)[None]
    document_ids, positions = document_layout(src, EOS)
    packed = token_losses(model, src, tgt, document_ids=document_ids, positions=positions)[0]
    plain = token_losses(model, src, tgt)[0]
    start = 0
    for doc in docs:
        alone = token_losses(
            model,
            torch.as_tensor(np.concatenate([[EOS], doc[:-1]]), device=device)[None],
            torch.as_tensor(doc, device=device)[None],
        )[0]
        inside = packed[start : start + len(doc)]
        assert torch.allclose(inside, alone, atol=tol, rtol=0), (name, start, inside - alone)
        start += len(doc)
    assert not torch.allclose(plain, packed, atol=1e-3), "without the mask, later documents see earlier ones"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_flex_attention_on_cuda_keeps_documents_apart(name):
    """On CUDA the mask is flex_attention's block mask (compiled): the same equality, fp32 without TF32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    test_each_document_in_a_packed_block_equals_it_alone(name, device="cuda", tol=1e-4)


def test_layout_and_mask():
    src = torch.tensor([[7, 8, EOS, 9, EOS, EOS, 5, PAD]])
    ids, pos = document_layout(src, EOS)
    assert ids.tolist() == [[0, 0, 1, 1, 2, 3, 3, 3]]
    assert pos.tolist() == [[0, 1, 0, 1, 0, 0, 1, 2]]
    mask = attention_mask(ids, 8)[0, 0]
    assert mask.shape == (8, 8) and mask[3].tolist() == [False, False, True, True] + [False] * 4
    assert mask.tril().equal(mask)


def test_flex_attention_equals_the_sdpa_mask():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    ids, _ = document_layout(torch.tensor([[EOS, 4, 5, EOS, 6, 7, 8, EOS, 9, 4, 4, 5, EOS, 6, 6, 6]]), EOS)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    expected = attend(q, k, v, attention_mask(ids, 16))

    block = block_mask(ids, 16, None, ids.device)
    from torch._inductor.exc import CppCompileError, InvalidCxxCompiler

    try:
        got = flex.flex_attention(q, k, v, block_mask=block)
    except (InvalidCxxCompiler, CppCompileError) as e:  # CPU flex_attention compiles C++: no compiler, no test
        pytest.skip(f"flex_attention needs a working C++ compiler on CPU: {type(e).__name__}")
    assert torch.allclose(got, expected, atol=1e-5)


def test_heads_narrower_than_flex_allows_attend_with_the_dense_mask():
    """inductor's flex_attention refuses heads under 16 wide: ``attend`` turns the BlockMask into the
    same dense mask for them (on CPU too), so tiny models train with --document-attention-mask on a GPU."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from toolkit.models.common.attention import FLEX_MIN_HEAD_DIM
    from toolkit.models.common.attention.masks import dense_mask

    ids, _ = document_layout(torch.tensor([[EOS, 4, 5, EOS, 6, 7, 8, EOS, 9, 4, 4, 5, EOS, 6, 6, 6]]), EOS)
    dense = attention_mask(ids, 16)
    block = block_mask(ids, 16, None, ids.device)
    q, k, v = (
        torch.randn(1, 2, 16, FLEX_MIN_HEAD_DIM // 2, generator=torch.Generator().manual_seed(i)) for i in range(3)
    )
    assert torch.equal(dense_mask(block, q), dense)
    assert torch.allclose(attend(q, k, v, block), attend(q, k, v, dense), atol=1e-6)


def test_collater_sends_the_layout(tmp_path):
    make_data_bin(tmp_path / "bin", {"train": ["a b c", "d e", "f g h i"]}, symbols=list("abcdefghi"))
    from toolkit.data.dictionary import Dictionary
    from toolkit.data.indexed_dataset import MMapIndexedDataset

    d = Dictionary.load(str(tmp_path / "bin" / "dict.txt"))
    blocks = TokenBlockDataset(MMapIndexedDataset(str(tmp_path / "bin" / "train")), 6, d.pad(), d.eos())
    dataset = MonolingualDataset(blocks, d, document_mask=True, reset_positions=True)
    batch = dataset.collater([dataset[0]])
    net = batch["net_input"]
    assert net["document_ids"].tolist() == [[1, 1, 1, 1, 2, 2]]  # "a b c </s> | d e"
    assert net["positions"].tolist() == [[0, 1, 2, 3, 0, 1]]
