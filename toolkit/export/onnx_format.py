"""``--format onnx``: the decoder as ONNX graphs, checked with ``onnx.checker`` and onnxruntime.

Graphs (exported with ``torch.onnx.export(..., dynamo=True)``, the torch.export-based exporter;
it handles scaled_dot_product_attention and symbolic slicing, so no TorchScript fallback is needed):

- ``decoder.onnx``: ``tokens`` int64 [B, T] -> ``logits`` float [B, T, V]; B and T dynamic.
- ``decoder_with_past.onnx`` (``--kv-cache``): ``tokens`` [B, T] plus ``past_key_{i}`` /
  ``past_value_{i}`` [B, H, P, D] per layer -> ``logits`` [B, T, V] plus ``present_key_{i}`` /
  ``present_value_{i}`` [B, H, P + T, D]. The new tokens sit at positions P, P+1, ...; P = 0
  (empty past) is the prompt pass. The cached forward is the family's
  (:class:`toolkit.core.protocols.OnnxCacheExportable`: ``toolkit/models/transformer_lm/onnx_decoder.py``,
  ``toolkit/models/llama/cached.py``, whose cache holds its G key/value heads: [B, G, P, D]), written from
  the model's own modules, so the graph does not depend on an incremental path inside the model; a family
  without one exports ``decoder.onnx`` only. The export checks it too: a prompt pass, then one cached step, against
  PyTorch's logits for the whole sequence.

Inputs are right-padded as in training: no padding mask (causal attention keeps a row's
padding from reaching its earlier positions).
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import List, Optional, Sequence, Tuple

import torch

from toolkit.core.errors import UserError
from toolkit.core.protocols import OnnxCacheExportable
from toolkit.export.common import StepProgress, copy_data_bin_files, require
from toolkit.export.target import export_directory
from toolkit.models.transformer_lm.onnx_decoder import CachedDecoder  # noqa: F401  (importable from the exporter, where export code looks for it)

logger = logging.getLogger(__name__)

DECODER = "decoder.onnx"
DECODER_WITH_PAST = "decoder_with_past.onnx"
DEFAULT_OPSET = 18  # the dynamo exporter's lowest; 17 is converted down by onnx's version converter
MIN_OPSET = 17


class LogitsDecoder(torch.nn.Module):
    """tokens -> logits, the model's own forward under fixed input/output names."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)


def cache_names(num_layers: int, prefix: str) -> List[str]:
    return [f"{prefix}_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]


def cached_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``decoder_with_past.onnx`` is exported from: the family's (``OnnxCacheExportable``); one line
    naming the families that have one otherwise."""
    if isinstance(model, OnnxCacheExportable):
        return model.onnx_cached_decoder()
    raise UserError(
        f"--kv-cache: decoder_with_past.onnx is written for {' and '.join(_cache_families())} models, "
        f"not {type(model).__name__}; export without --kv-cache (decoder.onnx)"
    )


def _cache_families() -> List[str]:
    """The registered model families that provide a cached decoder (``--kv-cache``)."""
    from toolkit.core import registry

    registry.import_all_components()
    return [
        name
        for name, entry in sorted(registry.MODEL_REGISTRY.entries.items())
        if isinstance(entry.cls, OnnxCacheExportable)
    ]


def empty_cache(model: torch.nn.Module, batch: int, past_len: int = 0) -> List[torch.Tensor]:
    """Per layer k and v of shape [B, heads, P, D] (zeros), the layout the cache graph takes."""
    heads, size = cached_decoder(model).cache_shape
    return [torch.zeros(batch, heads, past_len, size) for _ in range(2 * len(model.layers))]


def _export(
    module: torch.nn.Module,
    args: tuple,
    path: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    dynamic_shapes,
    opset: int,
) -> None:
    """The exporter's own warnings (deprecations, axis renames, torchvision ops) are not the user's."""
    onnx_logger = logging.getLogger("torch.onnx")
    level = onnx_logger.level
    onnx_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module,
                args,
                path,
                dynamo=True,
                opset_version=opset,
                input_names=list(input_names),
                output_names=list(output_names),
                dynamic_shapes=dynamic_shapes,
                verbose=False,
                external_data=False,
            )
    finally:
        onnx_logger.setLevel(level)


def export_decoder(model: torch.nn.Module, path: str, opset: int) -> None:
    max_len = model.max_positions()
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence", max=max_len)
    sample = torch.full((2, min(3, max_len)), model.padding_idx + 1, dtype=torch.long)
    _export(LogitsDecoder(model).eval(), (sample,), path, ["tokens"], ["logits"], {"tokens": {0: batch, 1: seq}}, opset)


def export_decoder_with_past(model: torch.nn.Module, path: str, opset: int) -> None:
    n = len(model.layers)
    max_len = model.max_positions()
    batch = torch.export.Dim("batch")
    seq, past = torch.export.Dim("sequence", max=max_len), torch.export.Dim("past", max=max_len)
    sample = torch.full((2, 2), model.padding_idx + 1, dtype=torch.long)
    past_sample = empty_cache(model, 2, past_len=min(3, max_len - 2))
    shapes = ({0: batch, 1: seq}, tuple({0: batch, 2: past} for _ in past_sample))
    _export(
        cached_decoder(model).eval(),
        (sample, *past_sample),
        path,
        ["tokens"] + cache_names(n, "past"),
        ["logits"] + cache_names(n, "present"),
        shapes,
        opset,
    )


def check_graph(path: str) -> None:
    onnx = require("onnx")
    onnx.checker.check_model(path)


def session(path: str, threads: Optional[int] = None):
    """An onnxruntime CPU session for one of the exported graphs.

    Its threads do not spin between runs: spinning workers take the cores from whatever runs
    beside the session (PyTorch, the data loader) on a shared CPU.
    """
    ort = require("onnxruntime")
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        opts.intra_op_num_threads = threads
    return ort.InferenceSession(path, sess_options=opts, providers=["CPUExecutionProvider"])


def run_logits(sess, tokens: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(sess.run(["logits"], {"tokens": tokens.long().numpy()})[0])


def greedy_decode(
    sess, num_layers: int, cache_shape: Tuple[int, int], prompt: torch.Tensor, steps: int
) -> torch.Tensor:
    """Greedy continuation of ``prompt`` [B, T] through the cache graph: one prompt pass, then a
    token at a time. ``cache_shape`` is (heads, head size). Returns [B, T + steps]."""
    B = prompt.size(0)
    H, D = cache_shape
    cache = {name: torch.zeros(B, H, 0, D).numpy() for name in cache_names(num_layers, "past")}
    tokens, new = prompt.long(), prompt.long()
    for _ in range(steps):
        out = sess.run(None, {"tokens": new.numpy(), **cache})
        new = torch.from_numpy(out[0][:, -1]).argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, new], dim=1)
        cache = dict(zip(cache_names(num_layers, "past"), out[1:]))
    return tokens


def check_parity(model: torch.nn.Module, path: str, tolerance: float = 1e-4) -> float:
    """Max |logits(onnxruntime) - logits(PyTorch)| on one random batch; an error above ``tolerance``."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.embed_tokens.num_embeddings, (2, min(8, model.max_positions())), generator=g)
    with torch.no_grad():
        diff = (run_logits(session(path), tokens) - model(tokens)).abs().max().item()
    if not diff <= tolerance:
        raise RuntimeError(f"{path}: onnxruntime logits differ from PyTorch's by {diff:.3g} (> {tolerance})")
    return diff


def check_cached_parity(model: torch.nn.Module, path: str, tolerance: float = 1e-4) -> float:
    """Max |logits| difference of the cache graph (a prompt pass, then one cached step) from PyTorch's forward
    over the whole sequence; an error above ``tolerance``."""
    g = torch.Generator().manual_seed(0)
    n = min(6, model.max_positions())
    tokens = torch.randint(0, model.embed_tokens.num_embeddings, (2, n), generator=g)
    names = cache_names(len(model.layers), "past")
    sess = session(path)
    first = sess.run(
        None, {"tokens": tokens[:, :-1].numpy(), **{k: v.numpy() for k, v in zip(names, empty_cache(model, 2))}}
    )
    step = sess.run(None, {"tokens": tokens[:, -1:].numpy(), **dict(zip(names, first[1:]))})
    got = torch.cat([torch.from_numpy(first[0]), torch.from_numpy(step[0])], dim=1)
    with torch.no_grad():
        diff = (got - model(tokens)).abs().max().item()
    if not diff <= tolerance:
        raise RuntimeError(f"{path}: onnxruntime's cached logits differ from PyTorch's by {diff:.3g} (> {tolerance})")
    return diff


def export_onnx(loaded, out_dir: str, kv_cache: bool = False, opset: int = DEFAULT_OPSET) -> str:
    """Export (and check) the graphs into ``out_dir``, with the dictionary and BPE model beside them."""
    if opset < MIN_OPSET:
        raise UserError(f"--opset {opset}: needs {MIN_OPSET} or later (scaled dot-product attention, LayerNorm)")
    for module in ("onnx", "onnxscript", "onnxruntime"):
        require(module)
    model = loaded.model
    if kv_cache:
        cached_decoder(model)  # refuses a family without one before anything is written
    steps = 4 if kv_cache else 3
    with StepProgress(steps, "onnx") as progress, export_directory(out_dir) as tmp, torch.no_grad():
        export_decoder(model, os.path.join(tmp, DECODER), opset)
        progress.advance(f"exported {DECODER} (opset {opset})")
        if kv_cache:
            export_decoder_with_past(model, os.path.join(tmp, DECODER_WITH_PAST), opset)
            progress.advance(f"exported {DECODER_WITH_PAST}")
        for name in (DECODER, DECODER_WITH_PAST) if kv_cache else (DECODER,):
            check_graph(os.path.join(tmp, name))
        diff = check_parity(model, os.path.join(tmp, DECODER))
        if kv_cache:
            diff = max(diff, check_cached_parity(model, os.path.join(tmp, DECODER_WITH_PAST)))
        progress.advance(f"onnx.checker passed; onnxruntime vs PyTorch max |logits diff| {diff:.2g}")
        copied = copy_data_bin_files(loaded.data_dir, tmp)
        progress.advance(f"copied {', '.join(copied)}")
    return out_dir
