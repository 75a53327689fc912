"""fairseq's ``(logits, extra)`` from ``model(src_tokens)`` on the toolkit's own families.

A fairseq script does ``logits, extra = model(src_tokens)`` and reads ``extra["inner_states"]`` (the
hidden states, time first) or ``extra["attn"]``, because fairseq's ``TransformerDecoder`` returns
``(x, {"attn": [attn], "inner_states": inner_states})``. The toolkit's families return the logits alone
(training, TP plans, compile and export rely on it), so the models handed to fairseq's Python API
(``checkpoint_utils.load_model_ensemble_and_task``, the hub's ``.models``) get forward hooks instead:

- ``inner_states``: the first layer's input (the embedded tokens after dropout and any
  ``layernorm_embedding``), then each layer's output, each ``[T, B, C]``, before the final layer norm,
  as fairseq's list;
- ``attn``: ``[None]``, fairseq's value for a decoder-only model (its ``attn`` is the cross-attention of
  ``--alignment-layer``, which a language model has not).

The library's own scorers and generator read ``out[0]`` of a tuple, so they work on such models unchanged.
A plugin model (``FairseqLanguageModel``) already returns the tuple and is left alone.
"""

from __future__ import annotations

from typing import Any, List

import torch

_HOOKED = "_fairseq_outputs_hooks"


def return_fairseq_outputs(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model(src_tokens)`` return ``(logits, {"attn": [None], "inner_states": [...]})``; ``model``."""
    layers = getattr(model, "layers", None)
    if (
        hasattr(model, _HOOKED)
        or hasattr(model, "decoder")
        or not isinstance(layers, torch.nn.ModuleList)
        or len(layers) == 0
    ):
        return model  # hooked already, a fairseq-style plugin (returns the tuple itself), or no layer stack
    inner_states: List[torch.Tensor] = []

    def first_layer_input(module: torch.nn.Module, args: tuple) -> None:
        inner_states.clear()
        inner_states.append(args[0].transpose(0, 1))

    def layer_output(module: torch.nn.Module, args: tuple, output: Any) -> None:
        inner_states.append(output.transpose(0, 1))

    def as_tuple(module: torch.nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, tuple):
            return output
        states = list(inner_states)
        inner_states.clear()  # the next call starts afresh; nothing held between calls
        return output, {"attn": [None], "inner_states": states}

    handles = [layers[0].register_forward_pre_hook(first_layer_input)]
    handles += [layer.register_forward_hook(layer_output) for layer in layers]
    handles.append(model.register_forward_hook(as_tuple))
    setattr(model, _HOOKED, handles)
    return model
