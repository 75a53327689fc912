"""What the rest of the toolkit asks of a model family, a task and a criterion.

Training, evaluation, generation, export, checkpointing and parallelism never look at a model's
class or probe it with ``hasattr``: they rely on the Protocols here, so a new family (a folder
under ``toolkit/models/``, or a ``--user-dir`` plugin) knows exactly which methods to write and
nothing else. Each Protocol is one caller's view; a full language model implements
:class:`LanguageModel` (what eval-lm, the hub and generation call), :class:`Initializable` (meta-
device build, then ``init_weights``), and optionally :class:`FlopsCounted` (MFU in the logs) and
:class:`TensorParallelizable` (``--model-parallel-size``). ``runtime_checkable`` ones are tested
with ``isinstance`` where the caller has a fallback (a plugin without FLOPs logs no MFU).

The parallelism plan is data, not code: the family names which of its modules gets which kind of
tensor-parallel split (a name; the vocabulary is open: ``toolkit.distributed.tensor_parallel.
register_tp_style`` maps each name to a DTensor ``ParallelStyle``, and a new kind registers there
without editing a list), which modules FSDP2 wraps as units, and where experts go. So the model
package depends on nothing above it, and the parallel code (and the planner, which counts the
split from the same plan) holds no module name of any family.

This module imports only ``typing`` and ``dataclasses`` (``torch`` for type checkers only: ``toolkit.config``
imports it, and ``--help`` runs without torch): it sits at the bottom of the package order, below everything
that implements or calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Dict,
    Iterator,
    List,
    Optional,
    Protocol,
    Tuple,
    Union,
    runtime_checkable,
)

if TYPE_CHECKING:
    import torch

NetOutput = Union["torch.Tensor", Tuple["torch.Tensor", Any]]
"""What ``forward`` returns: a tensor [B, T, V] (or features, for an adaptive softmax), or
``(tensor, extra)``; training's criterions take either, eval and generation pass it to
``get_normalized_probs`` unchanged, so they need not know which."""


@runtime_checkable
class ConfigSection(Protocol):
    """One section of a run's options (a dataclass instance): task, model, criterion, optimizer..."""

    __dataclass_fields__: ClassVar[Dict[str, Any]]


@runtime_checkable
class LanguageModel(Protocol):
    """A decoder-only model as eval-lm, the hub, generation and export call it.

    ``forward(tokens [B, T], incremental_state)``: with a dict for ``incremental_state`` (empty at the
    first call, then owned by the model) ``tokens`` are only the new positions.
    ``get_normalized_probs`` turns forward's output (of the positions the caller kept) into fp32
    log-probabilities [B, T, V]: the one place a family's output layer is normalized (plain softmax,
    adaptive softmax), so every scorer agrees with training's loss.
    """

    def __call__(self, tokens: torch.Tensor, incremental_state: Optional[Dict] = None) -> NetOutput: ...

    def get_normalized_probs(self, net_output: NetOutput, log_probs: bool = True) -> torch.Tensor: ...

    def reorder_incremental_state(self, incremental_state: Dict, new_order: torch.Tensor) -> None: ...

    def max_positions(self) -> int: ...


@runtime_checkable
class Bounded(Protocol):
    """A task or model that limits the positions it takes (``None``: no limit of its own); fairseq's
    ``resolve_max_positions`` takes the smallest of those declared."""

    def max_positions(self) -> Optional[int]: ...


@runtime_checkable
class Initializable(Protocol):
    """Built on the meta device, sharded, then filled: ``initial_value`` gives parameter ``name``'s full fp32
    value from a generator seeded by (seed, name), ``reset_buffers`` recomputes the non-saved buffers."""

    def initial_value(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor: ...

    def reset_buffers(self) -> None: ...


@runtime_checkable
class FlopsCounted(Protocol):
    """Training FLOPs per token at context ``seq_len`` (the 6N + attention of MFU)."""

    def flops_per_token(self, seq_len: int) -> int: ...


@runtime_checkable
class PositionTables(Protocol):
    """A model with learned position tables: the names of those parameters, which are looked up by position and
    never enter a matmul (``toolkit-plan`` leaves them out of the weights autocast copies). A model without
    the method has none (rotary or sinusoidal positions)."""

    def position_parameters(self) -> Tuple[str, ...]: ...


@runtime_checkable
class MetaTraceable(Protocol):
    """A model with parts the meta device cannot run (an adaptive band picks its tokens with ``nonzero()``, whose
    size is data): the options that build a traceable stand-in (``toolkit-plan`` traces activations with it, an
    upper bound); ``{}`` when this model has none. A model without the method traces as it is."""

    def meta_traceable_options(self) -> Dict[str, Any]: ...


@dataclass(frozen=True)
class TensorParallelPlan:
    """A family's Megatron split: module paths -> kinds, and what the tensor-parallel size must divide.

    ``top`` holds the model's own modules (relative to the model), ``block`` those of every entry of
    ``model.layers``. ``divisible`` lists ``(flag, value)`` pairs M must divide (heads, FFN width);
    ``positions`` is the context length, which M must divide under sequence parallelism.
    ``block_inputs``: positional inputs of a block (the stream first; Llama's also takes cos/sin).
    ``hidden``: the module whose output is the hidden state the output layer reads.
    ``sharded_dropout``: ``(start, end)`` module paths inside a block whose dropout acts on this
    rank's heads/units (each rank draws its own masks there); empty for a family without dropout.
    ``fsdp_units``: the modules FSDP2 shards as units before the root, in order; a ``ModuleList`` path
    means each of its entries (every family: its blocks, ``("layers",)``).
    ``experts``: expert-parallel placement, block module path -> placement name (``ep_shard``: the MoE family's
    ``mlp``, whole on every tp rank and its experts spread over the ep ranks); an unknown placement is refused
    in one line.

    A kind is a name registered with ``toolkit.distributed.tensor_parallel.register_tp_style`` (the
    built-in ones: ``vocab_embedding``, ``output``, ``column``, ``fused_qkv``, ``row``, ``norm``,
    ``replicated``, ``replicated_weights``, ``sequence_split``, ``sequence_input``; see that module);
    an unregistered one is refused in one line naming the family, the module and the kind.
    """

    top: Dict[str, str]
    block: Dict[str, str]
    divisible: Tuple[Tuple[str, int], ...]
    positions: int
    hidden: str
    block_inputs: int = 1
    sharded_dropout: Tuple[Tuple[str, str], ...] = ()
    padding_idx: int = 1
    fsdp_units: Tuple[str, ...] = ("layers",)
    experts: Dict[str, str] = field(default_factory=dict)

    def kinds(self) -> Iterator[str]:
        yield from self.top.values()
        yield from self.block.values()


@runtime_checkable
class TensorParallelizable(Protocol):
    """A model that ``--model-parallel-size`` can split: it names the split of its modules."""

    def tensor_parallel_plan(self) -> TensorParallelPlan: ...


class ContextParallelizable(Protocol):
    """A model whose attention exchanges keys/values across the ``cp`` ranks (ring or all-gather attention),
    so ``--context-parallel-size`` may cut its sequences into chunks: its class says
    ``supports_context_parallel = True``. Without it each rank would attend within its own chunk only."""

    supports_context_parallel: ClassVar[bool]


class ExpertParallelizable(Protocol):
    """A model with expert (MoE) layers that ``--expert-parallel-size`` can spread over ranks: its class says
    ``supports_expert_parallel = True``."""

    supports_expert_parallel: ClassVar[bool]


def supports(model_cls: Any, capability: str) -> bool:
    """Whether a model class declares ``capability`` (``supports_context_parallel``, ``supports_expert_parallel``)."""
    return bool(getattr(model_cls, capability, False))


@runtime_checkable
class Dictionary(Protocol):
    def __len__(self) -> int: ...

    def pad(self) -> int: ...

    def eos(self) -> int: ...


@runtime_checkable
class Task(Protocol):
    """What the trainer, eval-lm and model builders ask of a task (fairseq's ``FairseqTask`` subset).

    ``max_positions`` is part of it: ``None`` means the task sets no limit of its own."""

    cfg: Any

    @property
    def source_dictionary(self) -> Dictionary: ...

    @property
    def target_dictionary(self) -> Dictionary: ...

    def load_dataset(self, split: str, epoch: int = 1, combine: bool = False, **kwargs: Any) -> Any: ...

    def dataset(self, split: str) -> Any: ...

    def max_positions(self) -> Optional[int]: ...


@runtime_checkable
class Criterion(Protocol):
    """A training loss as the trainer uses it: the trainer runs the model, the criterion computes from its outputs.

    Per micro-batch the trainer calls ``model(sample["net_input"]["src_tokens"], **inputs)``, ``inputs`` the
    batch's packing inputs plus ``model_requests(model, sample, reduce)`` (what the loss asks the model to compute
    beside its outputs: the fused head's ``loss_target``), then ``criterion(net_output, sample, reduce)`` ->
    (loss summed over the sample, sample size, logging output). The loss never sees the model, so a pipeline
    schedule can call it on the last stage's output. ``reduce_metrics`` turns the gathered logging outputs into
    the logged numbers.

    fairseq's criterions (``forward(model, sample, reduce)``, running the model themselves) are not of this kind;
    ``toolkit.compat.fairseq.plugins.criterion.calls_the_model`` tells them apart and the trainer lets them run it."""

    def model_requests(self, model: Any, sample: Dict[str, Any], reduce: bool = True) -> Dict[str, Any]: ...

    def __call__(
        self, net_output: Any, sample: Dict[str, Any], reduce: bool = True
    ) -> Tuple[torch.Tensor, int, Dict[str, Any]]: ...

    def reduce_metrics(self, logging_outputs: List[Dict[str, Any]]) -> Dict[str, float]: ...

    def logging_outputs_can_be_summed(self) -> bool: ...


# ---- export: what toolkit-export asks a family (its adapters live in the family's folder) ----------


@dataclass
class HFWeights:
    """A model as one transformers class (``toolkit-export --format hf``): the family computes these; the
    exporter writes the folder, adds ``architectures`` and ``dtype`` to ``config``, and loads it with
    transformers to compare logits before the folder appears.

    ``tokenizer_files``: {name in the folder: path} copied as they are (a model's own tokenizer); empty: the
    exporter writes a ``tokenizer.json`` from ``dict.txt`` and the BPE where one maps to it, and refuses a
    ``dict.txt`` that is a tokenizer's vocabulary (only that tokenizer gives its ids)."""

    architecture: str
    config: Dict[str, Any]
    state: Dict[str, torch.Tensor]
    tokenizer_files: Dict[str, str] = field(default_factory=dict)


@runtime_checkable
class HFExportable(Protocol):
    """A model that ``--format hf`` writes: its family says which class computes it and in which names.

    ``first_symbol`` is what the LM sees before a text (``</s>``, or ``<s>`` with ``--add-bos-token``);
    ``data_dir`` is the data-bin the model was trained on (an imported model's own files are there).
    ``quantize`` (``--quantize``, passed only when given): a storage of the family's release for the tensors the
    release quantizes, one of the class's ``HF_QUANTIZATIONS`` (the exporter refuses the others first)."""

    def hf_weights(
        self, hf_class: str, dictionary: Any, first_symbol: int, data_dir: str, quantize: Optional[str] = None
    ) -> HFWeights: ...


@dataclass
class HFCheckpoint:
    """A transformers folder read as a toolkit checkpoint (``toolkit-export --from hf``): the family computes
    these; the exporter writes them atomically into one folder.

    ``checkpoint`` is saved as ``model.pt`` (as the trainer writes it) and ``dictionary`` as ``dict.txt``;
    ``files`` maps names in the output to files copied there, ``bpe`` is recorded as the folder's
    tokenizer (``(--bpe name, its model files)``, see ``toolkit.tokenizers``). ``written`` and ``copied``
    are the progress lines of those two steps; ``log`` the lines logged once the folder exists.
    ``dictionary_hash``: record the dictionary's hash in ``extra_state`` as the trainer does (a resume then
    refuses data binarized with another dictionary). ``texts``: files written with this content (the
    tokenizer as transformers builds it); a ``bpe`` model file named as one of them is that file."""

    checkpoint: Dict[str, Any]
    dictionary: Any
    written: str
    copied: str
    files: Dict[str, str]
    bpe: Optional[Tuple[str, Dict[str, str]]] = None
    log: Tuple[str, ...] = ()
    dictionary_hash: bool = False
    texts: Dict[str, str] = field(default_factory=dict)


@runtime_checkable
class HFImportable(Protocol):
    """A family (its model class) that ``--from hf`` builds checkpoints for: ``HF_CLASSES`` maps the
    ``config.json`` ``model_type`` values it reads to their class names (for the refusal of others).
    ``from_hf`` reads the folder, reporting its two steps (read, converted) through ``advance``."""

    HF_CLASSES: ClassVar[Dict[str, str]]

    @classmethod
    def from_hf(
        cls, folder: str, config: Dict[str, Any], out_dir: str, tokens_per_sample: Optional[int], advance: Any
    ) -> HFCheckpoint: ...


@runtime_checkable
class OnnxCacheExportable(Protocol):
    """A model that ``--format onnx --kv-cache`` writes as ``decoder_with_past.onnx``: a module computing
    ``(tokens [B, T], past_key_0, past_value_0, ...) -> (logits, present_key_0, present_value_0, ...)``,
    written from the family's own blocks; its ``cache_shape`` is (cache heads, head size), the cache tensors'
    dimensions 1 and 3. Every model exports ``decoder.onnx`` (its plain forward)."""

    def onnx_cached_decoder(self) -> torch.nn.Module: ...


# ---- training: what a model's modules may ask of the trainer ----------------------------------------


@runtime_checkable
class PostStepHook(Protocol):
    """A module with state to refresh after every optimizer step (a MoE router's load-balancing bias from
    the update's expert counts; float8's weight scales are the trainer's own hook): the trainer finds such
    modules in the model and calls each after every update, once the new weights are in place."""

    def after_optimizer_step(self) -> None: ...


# ---- optimization: which parameters an optimizer treats how ------------------------------------------

PARAMETER_ROLES = ("matrix", "embedding", "output", "norm", "bias")
"""What a parameter is to an optimizer: ``matrix`` (a 2-D weight inside the blocks, multiplied with the hidden
states, or a [experts, out, in] stack of them: what Muon orthogonalizes, matrix by matrix), ``embedding`` (a lookup table: token or position embeddings), ``output``
(the output head), ``norm`` (a normalization's scale), ``bias``. Muon takes ``matrix`` and leaves the rest to
AdamW; ``--weight-decay`` skips ``norm``, ``bias`` and ``embedding`` under ``--no-decay-norms-biases-embeddings``."""


@runtime_checkable
class ParameterRoles(Protocol):
    """A model that says what each of its parameters is (:data:`PARAMETER_ROLES`), so optimizers group them
    by meaning, not by guessing from names or shapes. ``no_decay_norms_biases_embeddings_by_default``: whether
    the family skips weight decay on norms, biases and embeddings unless told otherwise (new families do;
    fairseq's keep fairseq's decay of everything, for parity)."""

    no_decay_norms_biases_embeddings_by_default: ClassVar[bool]

    def parameter_roles(self) -> Dict[str, str]: ...
