"""The layout search: every parallel layout and memory setting ``toolkit-train`` takes for a run, priced by the
planner, and the ones that fit ranked by predicted step time.

What it varies, each through a ``toolkit-train`` flag:

* the parallel axes (:data:`AXES`): ``--model-parallel-size`` (within a node, dividing what the model's
  tensor-parallel plan splits), ``--context-parallel-size`` (families with context-parallel attention, whose
  samples cut into 2C chunks: toolkit-train's ``check_sequence_split``), ``--expert-parallel-size`` (MoE families, dividing a layer's experts),
  ``--pipeline-parallel-size`` (at most the model's layers) with every ``--pipeline-schedule``, each update's
  sequences in one batch of one sequence per micro-batch (``--pipeline-microbatches``: the fewest fills and drains,
  the smallest bubble, the least in flight);
* the data-parallel mode (:func:`data_parallel_modes`): DDP (``c10d``), FSDP2's ``full_shard`` /
  ``shard_grad_op`` / ``no_shard``, HSDP's ``hybrid_shard`` / ``hybrid_shard_zero2`` with every
  ``--shard-group-size`` that divides the data-parallel ranks;
* memory (:func:`memory_settings`): ``--checkpoint-activations``, ``--offload-activations``, ``--cpu-offload``
  (with ``--optimizer cpu_adam`` in place of ``adam``), and, changing the numbers trained with,
  ``--adam-state-precision 8bit`` with ``--bf16-host-grads``;
* ``--batch-size`` and ``--update-freq``, keeping the sequences of one update (batch x update-freq x the
  data-parallel ranks, as given), so that every layout's step time is that of the same update.

What it keeps: everything else given (the model, ``--tokens-per-sample``, the world size, the precision, the
optimizer), and every memory setting the user turned on.

Pruning, cheapest first: sizes by divisibility (the world, the model's :class:`~toolkit.plan.model_stats.
SplitLimits`); then ``parallel_shape`` (toolkit-train's layout check) and ``composition.refusal`` (the feature
pairs it refuses); a layout that does not fit with every memory setting on, neither at one sequence a micro-batch
nor in one micro-batch, is dropped after those two pricings; for the others the largest micro-batch that fits is
found by bisection (memory grows with the micro-batch; one micro-batch has no accumulated gradients).

Ranking: layouts that train the same numbers first (8-bit moments, bf16 gradients, or bf16 compute under
``--cpu-offload`` for an fp32 run, when not asked for, come after every layout without them), then by step time,
then by fewer flags. A layout that does not fit is a priced row, never an error: the only errors are about
the flags given. What is printed is checked by toolkit-train's own resolver (:func:`accepted`), which parses the
command with the proposed flags added and must read back the very layout that was priced.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from toolkit.config import OFFLOAD_OPTIMIZER, composition  # OFFLOAD_OPTIMIZER: --cpu-offload's optimizer
from toolkit.core.errors import UserError
from toolkit.distributed.context_parallel import check_sequence_split
from toolkit.plan.hardware import Hardware
from toolkit.plan.model_stats import ModelStats
from toolkit.distributed.pipeline import default_microbatches
from toolkit.plan.pipeline import PIPELINE_SCHEDULES, check_pipeline
from toolkit.plan.planner import Plan
from toolkit.plan.setup import Setup, data_parallel_fields, sample_tokens, setup_from_config

SHOWN = 5  # layouts printed, fastest first
FSDP_STRATEGIES = ("full_shard", "shard_grad_op", "no_shard")
HSDP_STRATEGIES = ("hybrid_shard", "hybrid_shard_zero2")


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Space:
    """What the sizes of an axis depend on: the run as given, the model, the machine."""

    base: Setup
    stats: ModelStats
    hw: Hardware

    @property
    def world(self) -> int:
        return self.base.world


@dataclass(frozen=True)
class Axis:
    """One parallel axis: its flag, the Setup field its size sets, and the sizes the model and the sequence allow
    it. ``multiplies``: its size multiplies the ranks one replica spans (tp, cp, a pipeline's stages), so the
    product of those divides the world; otherwise it is carved out of the data-parallel ranks (ep), which
    ``parallel_shape`` checks."""

    flag: str
    field: str
    sizes: Callable[[Space], List[int]]
    multiplies: bool = True


def _tensor_parallel_sizes(space: Space) -> List[int]:
    splits = space.stats.splits
    node = space.hw.gpus_per_node if space.hw.has_gpu else space.world

    def allowed(m: int) -> bool:
        return m == 1 or (splits.tp_refused is None and m <= node and all(v % m == 0 for _, v in splits.tp_divisible))

    return [m for m in divisors(space.world) if allowed(m)]


def _context_parallel_sizes(space: Space) -> List[int]:
    """The sizes of a family with context-parallel attention; whether its samples cut into 2C chunks is
    toolkit-train's own check, in :meth:`Search._layout`."""
    able = space.stats.splits.context_parallel
    return [c for c in divisors(space.world) if c == 1 or able]


def _expert_parallel_sizes(space: Space) -> List[int]:
    experts, able = space.stats.splits.experts, space.stats.splits.expert_parallel
    return [e for e in divisors(space.world) if e == 1 or (able and experts and experts % e == 0)]


def _pipeline_sizes(space: Space) -> List[int]:
    """Stages of at least one layer each, for a family whose forward cuts into stages."""
    able = space.stats.splits.pipeline_parallel
    return [p for p in divisors(space.world) if p == 1 or (able and p <= space.stats.num_layers)]


AXES: Tuple[Axis, ...] = (
    Axis("--model-parallel-size", "mp", _tensor_parallel_sizes),
    Axis("--context-parallel-size", "cp", _context_parallel_sizes),
    Axis("--expert-parallel-size", "ep", _expert_parallel_sizes, multiplies=False),
    Axis("--pipeline-parallel-size", "pp", _pipeline_sizes),
)


def axis_sizes(space: Space) -> Iterator[Dict[str, int]]:
    """Every combination of axis sizes whose multiplying axes divide the world ({Setup field: size})."""
    combos: List[Dict[str, int]] = [{}]
    for axis in AXES:
        combos = [dict(c, **{axis.field: size}) for c in combos for size in axis.sizes(space)]
    for combo in combos:
        spanned = 1
        for axis in AXES:
            spanned *= combo[axis.field] if axis.multiplies else 1
        if space.world % spanned == 0:
            yield combo


@dataclass(frozen=True)
class DataParallel:
    backend: str
    strategy: str
    shard_group_size: int = 0


def data_parallel_modes(dist: Any, world: int, replica_ranks: int, tp: int) -> List[DataParallel]:
    """DDP, FSDP2's strategies and HSDP's with each shard group for a layout whose replicas span ``replica_ranks``
    ranks (tp x cp) of ``world``, ``dist`` the distributed flags given: one FSDP2 strategy when there is a
    single data-parallel rank (they are the same then); under TP ``c10d`` replicates through FSDP2 as ``no_shard``
    does, so only the latter is tried. DDP keeps the ``--sharding-strategy`` given (no flag changes it), and is not
    tried under ``--no-reshard-after-forward`` (an FSDP2 setting)."""
    dp = world // replica_ranks
    ddp = tp == 1 and not dist.no_reshard_after_forward
    modes = [DataParallel("c10d", dist.sharding_strategy)] if ddp else []
    modes += [DataParallel("fully_sharded", s) for s in (FSDP_STRATEGIES if dp > 1 else FSDP_STRATEGIES[:1])]
    modes += [DataParallel("fully_sharded", s, g) for s in HSDP_STRATEGIES for g in divisors(dp) if 1 < g < dp]
    return modes


@dataclass(frozen=True)
class Memory:
    """The memory settings of one candidate."""

    checkpoint: bool
    offload_activations: bool
    cpu_offload: bool
    reduced_states: bool  # 8-bit moments (cpu_adam) and bf16 host gradients


def memory_settings(base: Setup, fsdp: bool) -> List[Memory]:
    """Every combination that keeps what the user turned on; offloading needs FSDP2 (``--ddp-backend
    fully_sharded``) and an optimizer that updates host-memory shards (adam runs as cpu_adam); activation
    offloading adds nothing to a checkpointed block (its inputs stay where they are)."""
    offloadable = fsdp and (base.optimizer in composition.HOST_MEMORY_OPTIMIZERS or base.optimizer == "adam")
    offload = [(False, False)] if not base.cpu_offload else []
    offload += [(True, False), (True, True)] if offloadable else []  # none under DDP for an offloaded run
    out = []
    for checkpoint in sorted({base.checkpoint, True}):
        for activations in sorted({base.offload_activations, base.offload_activations or not checkpoint}):
            for cpu_offload, reduced in offload:
                out.append(Memory(checkpoint, activations, cpu_offload, reduced))
    return out


@dataclass(frozen=True)
class Candidate:
    """A priced layout: its plan, the flags that give it (added to the command as given) and whether it changes
    the numbers trained with."""

    plan: Plan
    flags: Tuple[str, ...]
    lossy: bool

    @property
    def step_s(self) -> float:
        return self.plan.time.total_s

    def rank(self) -> Tuple[bool, float, int]:
        return (self.lossy, self.step_s, len(self.flags))


@dataclass(frozen=True)
class SearchResult:
    """The fitting layouts, best first (each accepted by toolkit-train's resolver), and how many were priced."""

    shown: Tuple[Candidate, ...]
    fitting: int
    priced: int
    refused: int  # fitting layouts toolkit-train's resolver refuses (dropped)
    pipelined: Optional[Candidate] = None  # the fastest with pipeline stages, when none of those shown has them


class Search:
    """One run's search: the run as given (resolved ``cfg`` and its Setup), the model read for each compute dtype
    (``stats_of``), the hardware."""

    def __init__(self, cfg: Any, base: Setup, stats_of: Callable[[torch.dtype], ModelStats], hw: Hardware):
        self.cfg, self.base, self.stats_of, self.hw = cfg, base, stats_of, hw
        self.priced = 0
        self._refusals: Dict[Tuple[Any, ...], Optional[str]] = {}

    # --- the candidates --------------------------------------------------------------------------------------

    def candidates(self) -> List[Candidate]:
        """Every layout that fits, each with its fastest micro-batch."""
        space = Space(self.base, self.stats_of(self.base.compute_dtype), self.hw)
        out: List[Candidate] = []
        for sizes in axis_sizes(space):
            replica = sizes["mp"] * sizes["cp"] * sizes["pp"]
            for mode in data_parallel_modes(self.cfg.distributed, self.base.world, replica, sizes["mp"]):
                for schedule in self._schedules(sizes["pp"]):
                    layout = self._layout(dict(sizes, pp_schedule=schedule), mode)
                    if layout is None:
                        continue
                    for memory in memory_settings(self.base, layout.backend == "fully_sharded"):
                        best = self._fastest_batch(self._with_memory(layout, memory))
                        if best is not None:
                            out.append(self._candidate(best))
        return out

    def _schedules(self, pp: int) -> Sequence[str]:
        return PIPELINE_SCHEDULES if pp > 1 else (self.base.pp_schedule,)

    def _layout(self, sizes: Dict[str, int], mode: DataParallel) -> Optional[Setup]:
        """The Setup of these sizes and mode with the batch as given, or None where toolkit-train refuses it."""
        setup = dataclasses.replace(
            self.base,
            **sizes,
            **data_parallel_fields(
                mode.backend, mode.strategy, sizes["mp"], self.cfg.distributed.no_reshard_after_forward
            ),
            shard_group_size=mode.shard_group_size or self.base.shard_group_size,
        )
        try:
            setup.layout(self.hw.gpus_per_node)
            check_sequence_split(setup.cp, self.cfg.task, self.cfg.model)
        except UserError:
            return None
        return setup

    def _with_memory(self, layout: Setup, memory: Memory) -> Setup:
        base, options, optimizer = self.base, self.base.optimizer_options, self.base.optimizer
        if memory.cpu_offload and optimizer == "adam":
            optimizer, options = OFFLOAD_OPTIMIZER, self._offload_options()
        if memory.reduced_states and optimizer == OFFLOAD_OPTIMIZER and not options.fp16_adam_stats:
            options = dataclasses.replace(options, adam_state_precision="8bit", fp16_adam_stats=False)
        half = base.compute_bytes == 2 or (memory.cpu_offload and self.hw.has_gpu)
        return dataclasses.replace(
            layout,
            checkpoint=memory.checkpoint,
            offload_activations=memory.offload_activations,
            cpu_offload=memory.cpu_offload,
            optimizer=optimizer,
            optimizer_options=options,
            bf16_host_grads=base.bf16_host_grads or memory.reduced_states,
            compute_bytes=2 if half else 4,
        )

    def _offload_options(self) -> Any:
        """cpu_adam's options with adam's values (the same update: DeepSpeed's CPU AdamW)."""
        from toolkit.core.registry import OPTIMIZER_REGISTRY

        options_type = OPTIMIZER_REGISTRY.get(OFFLOAD_OPTIMIZER).config
        given = vars(self.base.optimizer_options) if self.base.optimizer_options is not None else {}
        names = {f.name for f in dataclasses.fields(options_type)}
        return options_type(**{k: v for k, v in given.items() if k in names})

    # --- pricing ---------------------------------------------------------------------------------------------

    def _plan(self, setup: Setup) -> Plan:
        self.priced += 1
        return Plan(self.stats_of(setup.compute_dtype), setup, self.hw)

    def _sequences(self, setup: Setup) -> int:
        """Sequences per data-parallel rank and update that keep the update's size as given (0: no whole number)."""
        base = self.base
        given = base.batch_sequences * base.update_freq * setup.mp * setup.cp * setup.pp
        per_rank, rest = divmod(given, base.mp * base.cp * base.pp)
        return per_rank if not rest else 0

    def _batched(self, setup: Setup, batch: int) -> Setup:
        return dataclasses.replace(setup, batch_sequences=batch, update_freq=self._sequences(setup) // batch)

    def _fastest_batch(self, setup: Setup) -> Optional[Plan]:
        """The plan of the largest micro-batch that fits (the fewest micro-batches: the fewest gathers and copies),
        None when none does or toolkit-train refuses the settings. One micro-batch per update first (it holds no
        accumulated gradients), then one sequence per micro-batch (if that does not fit, no split does), then
        bisection between them: below one micro-batch per update, memory grows with the micro-batch."""
        n = self._sequences(setup)
        if not n or self._refusal(setup) is not None:
            return None
        if setup.pp > 1:
            return self._pipelined_batch(setup, n)
        whole = self._plan(self._batched(setup, n))
        if whole.fits or n == 1:
            return whole if whole.fits else None
        smallest = self._plan(self._batched(setup, 1))
        if not smallest.fits:
            return None
        sizes = [b for b in divisors(n) if b < n]
        low, high, best = 1, len(sizes) - 1, smallest
        while low <= high:
            mid = (low + high) // 2
            plan = self._plan(self._batched(setup, sizes[mid]))
            if plan.fits:
                best, low = plan, mid + 1
            else:
                high = mid - 1
        return best

    def _pipelined_batch(self, setup: Setup, n: int) -> Optional[Plan]:
        """A pipeline's plan of the largest batch that fits, cut into one sequence per micro-batch (the fewest fills
        and drains: the smallest bubble, the least in flight), at least the schedule's default micro-batches; None
        where none fits or the schedule refuses it. Memory grows with the batch (torch's receive buffers are one per
        micro-batch, GPipe keeps them all in flight)."""
        fewest = default_microbatches(setup.pp, setup.pp_schedule)
        sizes = [b for b in divisors(n) if b >= fewest]
        low, high, best = 0, len(sizes) - 1, None
        while low <= high:
            mid = (low + high) // 2
            pipelined = dataclasses.replace(self._batched(setup, sizes[mid]), pp_microbatches=sizes[mid])
            try:
                check_pipeline(self.stats_of(setup.compute_dtype), pipelined)
            except UserError:
                return best
            plan = self._plan(pipelined)
            if plan.fits:
                best, low = plan, mid + 1
            else:
                high = mid - 1
        return best

    def _refusal(self, setup: Setup) -> Optional[str]:
        """composition.refusal of the config these settings give (cached per distinct settings)."""
        key = tuple(getattr(setup, name) for name in _REFUSAL_FIELDS)
        if key not in self._refusals:
            self._refusals[key] = composition.refusal(self._config(setup))
        return self._refusals[key]

    def _config(self, setup: Setup) -> Any:
        """The resolved config with this layout's distributed settings and optimizer (what composition reads)."""
        cfg = self.cfg
        distributed = dataclasses.replace(
            cfg.distributed,
            model_parallel_size=setup.mp,
            context_parallel_size=setup.cp,
            expert_parallel_size=setup.ep,
            pipeline_parallel_size=setup.pp,
            pipeline_schedule=setup.pp_schedule,
            ddp_backend=setup.backend,
            sharding_strategy=setup.strategy if setup.backend == "fully_sharded" else cfg.distributed.sharding_strategy,
            shard_group_size=setup.shard_group_size,
            checkpoint_activations=setup.checkpoint,
            offload_activations=setup.offload_activations,
            cpu_offload=setup.cpu_offload,
            bf16_host_grads=setup.bf16_host_grads,
        )
        components = dataclasses.replace(cfg.components, optimizer=setup.optimizer)
        return dataclasses.replace(cfg, distributed=distributed, components=components)

    # --- flags -----------------------------------------------------------------------------------------------

    def _candidate(self, plan: Plan) -> Candidate:
        s, base = plan.setup, self.base
        lossy = (
            (s.bf16_host_grads and not base.bf16_host_grads)
            or s.compute_bytes < base.compute_bytes
            or (_state_precision(s) or "fp32") != (_state_precision(base) or "fp32")
        )
        return Candidate(plan, tuple(self.flags(s)), bool(lossy))

    def flags(self, s: Setup) -> List[str]:
        """The toolkit-train flags that turn the run as given into ``s`` (added after the given ones)."""
        dist, base = self.cfg.distributed, self.base
        out: List[str] = []
        for axis in AXES:
            if getattr(s, axis.field) != getattr(base, axis.field):
                out += [axis.flag, str(getattr(s, axis.field))]
        if s.pp > 1 and s.pp_schedule != base.pp_schedule:
            out += ["--pipeline-schedule", s.pp_schedule]
        if s.pp > 1 and s.pp_microbatches != base.pp_microbatches:
            out += ["--pipeline-microbatches", str(s.pp_microbatches)]
        if s.backend != base.backend:
            out += ["--ddp-backend", s.backend]
        if s.backend == "fully_sharded" and s.strategy != dist.sharding_strategy:
            out += ["--sharding-strategy", s.strategy]
        if s.strategy in HSDP_STRATEGIES and s.shard_group_size != dist.shard_group_size:
            out += ["--shard-group-size", str(s.shard_group_size)]
        for flag, on, given in (
            ("--checkpoint-activations", s.checkpoint, base.checkpoint),
            ("--offload-activations", s.offload_activations, base.offload_activations),
            ("--cpu-offload", s.cpu_offload, base.cpu_offload),
            ("--bf16-host-grads", s.bf16_host_grads, base.bf16_host_grads),
        ):
            out += [flag] if on and not given else []
        if s.optimizer != base.optimizer:
            out += ["--optimizer", s.optimizer]
        if _state_precision(s) not in ("", _state_precision(base) or "fp32"):
            out += ["--adam-state-precision", _state_precision(s)]
        return out + self._batch_flags(s)

    def _batch_flags(self, s: Setup) -> List[str]:
        out = []
        if s.batch_sequences != self.base.batch_sequences:
            if self.cfg.dataset.batch_size is None:  # the batch is --max-tokens' (sequences of --tokens-per-sample)
                out += ["--max-tokens", str(s.batch_sequences * sample_tokens(self.cfg))]
            else:
                out += ["--batch-size", str(s.batch_sequences)]
        if s.update_freq != self.base.update_freq:
            out += ["--update-freq", str(s.update_freq)]
        return out


_REFUSAL_FIELDS = (
    "mp",
    "cp",
    "ep",
    "pp",
    "pp_schedule",
    "backend",
    "strategy",
    "shard_group_size",
    "checkpoint",
    "offload_activations",
    "cpu_offload",
    "bf16_host_grads",
    "optimizer",
)  # the Setup fields _config sets: composition.refusal's verdict depends on nothing else the search changes


def _state_precision(s: Setup) -> str:
    return str(getattr(s.optimizer_options, "adam_state_precision", "") or "")


# --- checked by toolkit-train's own resolver ----------------------------------------------------------------


def accepted(argv: Sequence[str], flags: Sequence[str], priced: Setup, gpu: bool, prog: str) -> bool:
    """Whether toolkit-train resolves the command ``argv`` with ``flags`` added, and reads back the layout that was
    priced (the same Setup): what the search prints is what training runs."""
    from toolkit.train.arguments import parse_train_args
    from toolkit.train.resolve import resolve

    try:
        args, explicit = parse_train_args(list(argv) + list(flags), prog)
        cfg, _ = resolve(args, explicit)
    except (UserError, SystemExit):
        return False
    return setup_from_config(cfg, gpu) == priced


def search(
    cfg: Any,
    base: Setup,
    stats_of: Callable[[torch.dtype], ModelStats],
    hw: Hardware,
    accepts: Callable[[Candidate], bool],
) -> SearchResult:
    """Price every layout, rank those that fit, and keep the first :data:`SHOWN` that ``accepts`` (toolkit-train's
    resolver, :func:`accepted`) takes; a refused layout's settings are not asked again with another batch."""
    finder = Search(cfg, base, stats_of, hw)
    fitting = sorted(finder.candidates(), key=Candidate.rank)
    shown: List[Candidate] = []
    verdicts: Dict[Tuple[str, ...], bool] = {}
    refused = 0
    same_as_shown = set()
    for candidate in fitting:
        if len(shown) == SHOWN:
            break
        settings = _without(candidate.flags, BATCH_FLAGS)
        if settings not in verdicts:
            verdicts[settings] = accepts(candidate)
        if not verdicts[settings]:
            refused += 1
            continue
        alike = (round(candidate.step_s, 6), _without(candidate.flags, DATA_PARALLEL_FLAGS))
        if alike not in same_as_shown:  # another data-parallel mode at the same speed: not worth a line
            same_as_shown.add(alike)
            shown.append(candidate)
    pipelined = None
    if not any(c.plan.setup.pp > 1 for c in shown):
        pipelined = next((c for c in fitting if c.plan.setup.pp > 1 and accepts(c)), None)
    return SearchResult(tuple(shown), len(fitting), finder.priced, refused, pipelined)


BATCH_FLAGS = ("--batch-size", "--max-tokens", "--update-freq")
DATA_PARALLEL_FLAGS = ("--ddp-backend", "--sharding-strategy", "--shard-group-size")


def _without(flags: Sequence[str], names: Sequence[str]) -> Tuple[str, ...]:
    """``flags`` less the valued flags ``names`` (each with its value)."""
    return tuple(f for i, f in enumerate(flags) if f not in names and (i == 0 or flags[i - 1] not in names))


def plan_command(argv: Sequence[str], hw: Hardware, vocab_size: Optional[int] = None, prog: str = "toolkit-plan"):
    """``toolkit-plan``'s work for ``argv`` (toolkit-train's flags): the plan of the run as given, and the layout
    search around it, each proposal checked by toolkit-train's resolver (:func:`accepted`). Bad flags raise
    UserError (or exit, as toolkit-train's parser does) naming what was given."""
    from toolkit.plan.model_stats import model_stats
    from toolkit.plan.planner import make_plan
    from toolkit.train.arguments import parse_train_args
    from toolkit.train.resolve import resolve_and_log

    args, explicit = parse_train_args(list(argv), prog)
    cfg = resolve_and_log(args, explicit)
    plan = make_plan(cfg, hw, vocab_size=vocab_size)
    read: Dict[torch.dtype, ModelStats] = {plan.setup.compute_dtype: plan.stats}

    def stats_of(dtype: torch.dtype) -> ModelStats:  # the model read once per compute dtype (offload: bf16)
        if dtype not in read:
            read[dtype] = model_stats(cfg, dtype, vocab_size)
        return read[dtype]

    def accepts(candidate: Candidate) -> bool:
        return accepted(argv, candidate.flags, candidate.plan.setup, hw.has_gpu, prog)

    return plan, search(cfg, plan.setup, stats_of, hw, accepts)
