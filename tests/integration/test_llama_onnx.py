"""``--format onnx --kv-cache`` of imported Llama-family folders (tests/helpers/hf_llama.py's kinds: GQA with
Llama 3 RoPE scaling, Qwen2's biases and one key/value head, Qwen3's QK-norm, local windows, OLMo 2's norms,
Gemma 3): the checker passes, the cache graph's logits for a prompt and then one cached step equal PyTorch's
(1e-4), and greedy decoding through it gives PyTorch's tokens. The exporter and onnxruntime make these the
integration tier's, beside the MoE family's (test_moe_hf.py)."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.helpers.hf_llama import make_hf  # noqa: E402
from toolkit.export.api import ExportConfig, run_export  # noqa: E402
from toolkit.inference import load_model  # noqa: E402

pytestmark = pytest.mark.integration


def batch(n: int) -> torch.Tensor:
    return torch.randint(0, 60, (2, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral_window", "qwen3_window", "olmo2", "gemma3"])
def test_onnx_export_with_kv_cache_matches_pytorch(tmp_path, kind):
    """--format onnx --kv-cache of an imported Llama (GQA, Llama 3 RoPE scaling) or Qwen2 (one key/value head,
    q/k/v biases, tied): the checker passes, the cache
    graph's logits for a prompt and then one cached step equal PyTorch's (1e-4), and greedy decoding through it
    gives PyTorch's tokens."""
    pytest.importorskip("onnxruntime")
    import onnx

    from toolkit.export import onnx_format

    from toolkit.models.llama.config import head_dim, kv_heads

    make_hf(str(tmp_path / "hf"), kind)
    run_export(ExportConfig(path=str(tmp_path / "hf"), out=str(tmp_path / "ours"), import_from="hf"))
    ckpt = str(tmp_path / "ours" / "model.pt")
    out = run_export(ExportConfig(path=ckpt, out=str(tmp_path / "onnx"), format="onnx", kv_cache=True))
    for name in ("decoder.onnx", "decoder_with_past.onnx"):
        onnx.checker.check_model(onnx.load(os.path.join(out, name)))
    model, _, _ = load_model(ckpt, str(tmp_path / "ours"))
    names = onnx_format.cache_names(len(model.layers), "past")
    sess = onnx_format.session(os.path.join(out, "decoder_with_past.onnx"))
    tokens = batch(9)
    first = sess.run(
        None,
        {"tokens": tokens[:, :8].numpy(), **{k: v.numpy() for k, v in zip(names, onnx_format.empty_cache(model, 2))}},
    )
    step = sess.run(None, {"tokens": tokens[:, 8:].numpy(), **dict(zip(names, first[1:]))})
    with torch.no_grad():
        expected = model(tokens)
    assert (torch.from_numpy(first[0]) - expected[:, :8]).abs().max().item() < 1e-4
    assert (torch.from_numpy(step[0]) - expected[:, 8:]).abs().max().item() < 1e-4
    assert step[1].shape == (2, kv_heads(model.cfg), 9, head_dim(model.cfg))  # [B, G, P + T, D]
    prompt, steps = tokens[:, :3], 6
    want = prompt
    with torch.no_grad():
        for _ in range(steps):
            want = torch.cat([want, model(want)[:, -1].argmax(-1, keepdim=True)], dim=1)
    got = onnx_format.greedy_decode(
        sess, len(model.layers), onnx_format.cached_decoder(model).cache_shape, prompt, steps
    )
    assert torch.equal(got, want)
