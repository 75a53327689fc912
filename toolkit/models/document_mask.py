"""Document-masked packing, the data side: which batch keys reach a model's forward.

With ``--sample-break-mode none`` a block holds the end of one document, whole documents and the
start of another, back to back (each line ends with ``</s>``). ``--document-attention-mask``
stops attention at the document boundaries: position t attends to s only when s <= t and both
are in the same document (block-diagonal causal), so each document is scored as if it were
alone; ``--reset-position-ids`` restarts the positions at 0 in each document, so it also sees
the positions it would have alone.

A document starts where the *input* token is ``</s>``: the input is the target shifted right,
so the position that reads the previous line's ``</s>`` predicts the first token of the next
line (as a line on its own starts from ``</s>``). The data side (the collater) sends
``document_ids`` [B, T] and, for reset positions, ``positions`` [B, T]; both model families
take them as keyword arguments of ``forward``, and the model builds the mask once per forward
(``toolkit.models.common.attention.attention_mask``: flex_attention's block mask on CUDA, a
boolean mask [B, 1, T, T] otherwise).
"""

from __future__ import annotations


def packing_inputs(net_input: dict) -> dict:
    """The keyword arguments a model's forward takes from a batch (none for unmasked batches; ``context_parallel``:
    the sequence shard of ``--context-parallel-size``, see ``toolkit.distributed.context_parallel``)."""
    return {key: net_input[key] for key in ("document_ids", "positions", "context_parallel") if key in net_input}
