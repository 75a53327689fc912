"""``--adam-state-precision``: cpu_adam's Adam moments in bf16 or blockwise 8-bit, to cut host memory.

Why: under ``--cpu-offload`` the host holds, per parameter, the fp32 weight (4 bytes), its
fp32 gradient (4) and two fp32 moments (4 + 4). The moments are half of that; keeping
them in bf16 (2 + 2) or 8 bits (1 + 1, plus one fp32 scale per block) brings the total
to 12 or about 10 bytes.

Layouts (``state`` keeps torch AdamW's keys; the values are tensors shaped and placed like
the parameter, so checkpoints carry them like any optimizer state):

* ``bf16``: ``exp_avg`` and ``exp_avg_sq`` are bf16 tensors.
* ``8bit``: the parameter's local tensor is seen as rows (``shape[0]`` rows of
  ``numel / shape[0]`` values) and every row is cut into ``ceil(row / 2048)`` equal blocks.
  Each block has its own fp32 scale, in ``exp_avg_absmax`` / ``exp_avg_sq_absmax``, shaped
  ``(shape[0], blocks per row)``:

  - ``exp_avg_sq`` (uint8): logarithmic in ``sqrt(v)``, because ``v`` spans many orders of
    magnitude within a block and a linear code would round small ``v`` to 0 (and the update
    ``m / (sqrt(0) + eps)`` would explode): code ``k >= 1`` stands for
    ``sqrt(v / max v) = 2 ** (-(255 - k) * 20 / 254)``, i.e. ``sqrt(v)`` to within 2.8% over
    20 octaves below the block's max; smaller values are stored as code 1 (an over-estimate:
    a smaller, safe step); code 0 is exactly 0. ``exp_avg_sq_absmax`` is the block's max ``v``.
  - ``exp_avg`` (int8): linear in ``r = m / sqrt(v)`` (``v`` as stored), ``r = code / 127 *
    absmax`` with ``exp_avg_absmax`` the block's max ``|r|``. Adam's step is ``r`` (up to bias
    correction and eps), so the code bounds the error of the *step* -- at most 1/254 of the
    block's largest step -- whatever the gradient's scale. A linear code of ``m`` itself
    would zero the steps of every value whose gradient is under 1/254 of its block's largest
    (Adam moves those as far as any other). ``|r|`` is bounded (by ``sqrt((1 - b1)^2 /
    ((1 - b2) (1 - b1^2 / b2)))``, 1.7 for betas (0.9, 0.98)), so a linear code fits it.

  Tensors with fewer than 4096 values or one dimension (biases, norms: a negligible share
  of a transformer) keep fp32 moments, as bitsandbytes does.

  Blocks never cross a row, and FSDP2 shards rows (``Shard(0)``), so the scales are
  DTensors sharded exactly like the codes: a checkpoint saved on W ranks loads on any other
  world size (DCP reshards rows of codes and scales together). Parameters sharded along
  another dimension (tensor parallelism) are refused with one line.

The update (:meth:`ReducedMoments.update`): a bounded slice of the tensor at a time (about
4M values) is expanded to fp32, updated by DeepSpeed's op exactly as fp32 moments would be,
and stored back; the temporary fp32 memory is a few slices, never a copy of all states.
Gradients of any float dtype are cast slice by slice. With 8-bit moments the update normally
runs in :mod:`toolkit.optim.fused_8bit` (decode, update and encode per block in one C++
pass, the same bits); this eager path is its fallback and its reference.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable, Dict, Iterator, Optional, Set, Tuple

import torch

from toolkit.config.components import ADAM_STATE_PRECISIONS
from toolkit.core.dtensor import dtensor_like, is_dtensor, local_tensor
from toolkit.core.errors import UserError

logger = logging.getLogger(__name__)

PRECISIONS = ADAM_STATE_PRECISIONS
BLOCK = 2048
CHUNK_ELEMENTS = 1 << 22
MIN_8BIT_NUMEL = 4096
SQ_OCTAVES = 20.0  # exp_avg_sq's code spans sqrt(v) from the block max down to 2**-20 of it
ABSMAX_KEYS = ("exp_avg_absmax", "exp_avg_sq_absmax")
_TINY = torch.finfo(torch.float32).tiny


# ---------------------------------------------------------------------------
# Codes on plain (rows, row_numel) fp32 tensors
# ---------------------------------------------------------------------------


def row_blocks(row_numel: int, block: int = BLOCK) -> Tuple[int, int]:
    """(blocks per row, values per block): equal blocks of at most ``block`` values (the last padded)."""
    n = max(1, math.ceil(row_numel / block))
    return n, max(1, math.ceil(row_numel / n))


def _blocked(x: torch.Tensor, n: int, b: int) -> torch.Tensor:
    """``x`` (rows, C) as (rows, n, b), zero-padded at the end of each row when n * b > C."""
    rows, cols = x.shape
    if n * b != cols:
        x = torch.nn.functional.pad(x, (0, n * b - cols))
    return x.reshape(rows, n, b)


def _unblocked(x: torch.Tensor, cols: int) -> torch.Tensor:
    rows = x.shape[0]
    return x.reshape(rows, -1)[:, :cols].contiguous()


def quantize_signed(x: torch.Tensor, block: int = BLOCK) -> Tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes shaped like ``x``, fp32 absmax per row block): ``x ~ code / 127 * absmax``."""
    n, b = row_blocks(x.shape[1], block)
    xb = _blocked(x.float(), n, b)
    absmax = xb.abs().amax(dim=2)
    scale = (absmax / 127.0).clamp_min(_TINY).unsqueeze(2)
    codes = (xb / scale).round_().clamp_(-127, 127).to(torch.int8)
    return _unblocked(codes, x.shape[1]), absmax


def dequantize_signed(codes: torch.Tensor, absmax: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    n, b = row_blocks(codes.shape[1], block)
    x = _blocked(codes.float(), n, b).mul_((absmax / 127.0).unsqueeze(2))
    return _unblocked(x, codes.shape[1])


def _sq_tables() -> Tuple[torch.Tensor, torch.Tensor]:
    """(ratio, threshold), fp32 [256]: the ``v / vmax`` each exp_avg_sq code stands for, and the smallest
    fp32 ``v / vmax`` that gets code k (k >= 2), from the exact boundaries (float64 math, correctly rounded up).

    ``sqrt(v / vmax) = 2 ** ((k - 255) * SQ_OCTAVES / 254)``, so code k covers ``v / vmax`` in
    ``[2 ** ((k - 255.5) * SQ_OCTAVES / 127), 2 ** ((k - 254.5) * SQ_OCTAVES / 127))``. Tables, not
    ``log2``/``exp2`` of tensors: torch computes those with SIMD code on most values and scalar libm code
    on the tails of its loops, which differ in the last bit for some inputs, so the codes depended on
    where a value sat in the tensor (and on the thread count); a table lookup and comparisons do not,
    and the fused kernel (toolkit/optim/fused_8bit.py) uses the same tables, so both give the same bits.
    """
    ratio = torch.tensor([2.0 ** ((k - 255) * SQ_OCTAVES / 127) for k in range(256)], dtype=torch.float64)
    boundary = torch.tensor([2.0 ** ((k - 255.5) * SQ_OCTAVES / 127) for k in range(256)], dtype=torch.float64)
    threshold = boundary.float()
    threshold = torch.where(threshold.double() < boundary, torch.nextafter(threshold, torch.tensor(1.0)), threshold)
    ratio[0], threshold[:2] = 0.0, 0.0  # code 0 is v == 0; codes 0 and 1 have no lower threshold
    return ratio.float(), threshold


SQ_RATIO, SQ_THRESHOLD = _sq_tables()


def quantize_sq(v: torch.Tensor, block: int = BLOCK) -> Tuple[torch.Tensor, torch.Tensor]:
    """(uint8 log codes of ``sqrt(v)``, fp32 max ``v`` per row block); see the module docstring."""
    n, b = row_blocks(v.shape[1], block)
    vb = _blocked(v.float(), n, b)
    vmax = vb.amax(dim=2)
    ratio = vb / vmax.clamp_min(_TINY).unsqueeze(2)
    k = sq_code(ratio)
    codes = torch.where(vb > 0, k, torch.zeros((), dtype=k.dtype)).to(torch.uint8)
    return _unblocked(codes, v.shape[1]), vmax


def sq_code(ratio: torch.Tensor) -> torch.Tensor:
    """exp_avg_sq's code (int32, 1..255) of ``v / vmax`` = ``ratio`` > 0: one plus the thresholds it reaches."""
    return torch.bucketize(ratio, SQ_THRESHOLD[2:], out_int32=True, right=True).add_(1)


def dequantize_sq(codes: torch.Tensor, vmax: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    n, b = row_blocks(codes.shape[1], block)
    k = _blocked(codes, n, b).long()
    v = SQ_RATIO[k].mul_(vmax.unsqueeze(2))
    v.masked_fill_(k == 0, 0.0)
    return _unblocked(v, codes.shape[1])


def exact_sqrt(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``sqrt(x)`` correctly rounded, as C++'s ``std::sqrt`` (the fused kernel) gives it.

    torch's CPU ``sqrt`` of fp32 goes through MKL's vector math, which is not correctly rounded
    (one value in five is a unit in the last place off, measured with torch 2.13): it is only the
    first guess here. The correctly rounded root is it or a neighbour: the one whose rounding interval
    holds ``x``, decided exactly in float64 (a midpoint of two fp32 values has 25 significant bits,
    its square 50: exact).
    """
    y = x.sqrt()
    down, up = torch.nextafter(y, torch.zeros(())), torch.nextafter(y, torch.full((), math.inf))
    yd, xd = y.double(), x.double()
    low, high = (yd + down.double()).mul_(0.5), (yd + up.double()).mul_(0.5)
    return torch.where(xd < low.mul_(low), down, torch.where(xd > high.mul_(high), up, y))


def quantize_moments(m: torch.Tensor, v: torch.Tensor, block: int = BLOCK) -> Tuple[torch.Tensor, ...]:
    """(exp_avg codes, exp_avg_absmax, exp_avg_sq codes, exp_avg_sq_absmax) of (rows, C) fp32 moments."""
    v_codes, vmax = quantize_sq(v, block)
    root = exact_sqrt(dequantize_sq(v_codes, vmax, block))
    r = torch.where(root > 0, m / root.clamp_min(_TINY), torch.zeros((), dtype=root.dtype))
    r_codes, r_absmax = quantize_signed(r, block)
    return r_codes, r_absmax, v_codes, vmax


def dequantize_moments(r_codes, r_absmax, v_codes, vmax, block: int = BLOCK) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 (m, v), (rows, C) contiguous, from :func:`quantize_moments`' codes."""
    v = dequantize_sq(v_codes, vmax, block)
    return dequantize_signed(r_codes, r_absmax, block).mul_(exact_sqrt(v)), v


# ---------------------------------------------------------------------------
# Per-parameter layout
# ---------------------------------------------------------------------------


def param_layout(precision: str, p: torch.Tensor) -> str:
    """The layout ``precision`` gives ``p``: small or 1-D tensors keep fp32 under 8bit."""
    if precision == "8bit" and (p.dim() < 2 or p.numel() < MIN_8BIT_NUMEL):
        return "fp32"
    return precision


def moments_bytes(precision: str, shape: Tuple[int, ...], local: Tuple[int, ...]) -> int:
    """Bytes of the two moments :class:`ReducedMoments` keeps for the ``local`` piece (rows of ``shape[0]``) of a
    parameter shaped ``shape`` (what ``toolkit-plan`` counts; the layouts above)."""
    numel, local_numel = math.prod(shape), math.prod(local)
    if precision == "8bit" and (len(shape) < 2 or numel < MIN_8BIT_NUMEL):
        precision = "fp32"
    if precision == "fp32":
        return 8 * local_numel
    if precision == "bf16":
        return 4 * local_numel
    blocks, _ = row_blocks(numel // shape[0])
    return 2 * local_numel + 2 * 4 * local[0] * blocks  # int8 + uint8 codes, an fp32 scale per block and moment


def _rows(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` (a local tensor shaped like ``p``'s local shard) as (rows, values per row) of ``p``'s global shape."""
    return t.reshape(t.shape[0] if t.dim() else 1, p.numel() // max(1, p.shape[0]) if p.dim() else 1)


def _absmax_like_rows(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A per-row-block tensor placed like ``p``'s rows (a DTensor sharing ``p``'s mesh and placements)."""
    if not is_dtensor(p):
        return local
    n = local.shape[1]
    return dtensor_like(local, p, shape=(p.shape[0], n), stride=(n, 1))


def check_row_sharded(p: torch.Tensor) -> None:
    if is_dtensor(p) and not all(pl.is_replicate() or pl.is_shard(0) for pl in p.placements):
        raise UserError(
            f"--adam-state-precision 8bit: a parameter of shape {tuple(p.shape)} is sharded as "
            f"{tuple(p.placements)}; 8-bit moments need row sharding (FSDP2's Shard(0)); "
            "use --adam-state-precision bf16"
        )


def zeros_state(layout: str, p: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Zero moments of ``layout`` for ``p`` (DTensors placed like ``p`` when it is one)."""
    if layout in ("fp32", "bf16"):
        dtype = torch.float32 if layout == "fp32" else torch.bfloat16
        return {
            k: torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
            for k in ("exp_avg", "exp_avg_sq")
        }
    check_row_sharded(p)
    local = local_tensor(p.detach())
    n, _ = row_blocks(p.numel() // p.shape[0])
    rows = local.shape[0]
    return {
        "exp_avg": torch.zeros_like(p, dtype=torch.int8, memory_format=torch.contiguous_format),
        "exp_avg_sq": torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format),
        "exp_avg_absmax": _absmax_like_rows(p, torch.zeros(rows, n)),
        "exp_avg_sq_absmax": _absmax_like_rows(p, torch.zeros(rows, n)),
    }


def state_layout(state: Dict[str, Any]) -> str:
    """What a (loaded) state holds: ``8bit``, ``fp16`` (--fp16-adam-stats), ``bf16`` or ``fp32``.

    By the moments' dtype, not by the scales' presence: torch's full-state loader merges the
    loaded entry into this optimizer's own, which may keep stale scales beside fp32 moments.
    """
    ea = state.get("exp_avg")
    dtype = ea.dtype if torch.is_tensor(ea) else torch.float32
    if dtype == torch.int8:
        return "8bit"
    if "exp_avg_scale" in state:
        return "fp16"
    return "bf16" if dtype == torch.bfloat16 else "fp32"


# ---------------------------------------------------------------------------
# Conversions (checkpoint loading)
# ---------------------------------------------------------------------------

REDUCED_KEYS = ("exp_avg", "exp_avg_sq") + ABSMAX_KEYS


@dataclass
class SavedMoments:
    """A loaded state_dict entry's layout and, for bf16/8bit ones, its moment tensors as saved.

    torch's ``Optimizer.load_state_dict`` casts every state tensor of a float parameter to the
    parameter's dtype: that would turn 8-bit codes and bf16 moments into fp32 copies (a peak of
    8 bytes per parameter at resume, the memory these layouts exist to save), so those tensors
    are withheld from it and put back after.
    """

    layout: str
    tensors: Dict[str, torch.Tensor]


def withhold_moments(
    param_groups, state_dict: Dict[str, Any]
) -> Tuple[Dict[torch.Tensor, SavedMoments], Dict[str, Any]]:
    """(per parameter of ``param_groups``: its saved moments; ``state_dict`` without the reduced tensors)."""
    ids = chain.from_iterable(g["params"] for g in state_dict.get("param_groups", []))
    params = chain.from_iterable(g["params"] for g in param_groups)
    states = dict(state_dict.get("state", {}))
    saved = {}
    for pid, p in zip(ids, params):
        st = states.get(pid)
        if not st:
            continue
        layout = state_layout(st)
        kept = {k: st[k].detach() for k in REDUCED_KEYS if k in st} if layout in ("bf16", "8bit") else {}
        saved[p] = SavedMoments(layout, kept)
        states[pid] = {k: v for k, v in st.items() if k not in kept}
    return saved, dict(state_dict, state=states)


def _local_rows_of(p: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a loaded scale tensor (a full one when torch's full-state loader left it unsharded)."""
    if is_dtensor(absmax):
        return absmax.to_local()
    if is_dtensor(p):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(absmax.float(), p.device_mesh, p.placements).to_local()
    return absmax


def fp32_moments(p: torch.Tensor, state: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The moments as fp32 local tensors shaped like ``p``'s local shard, whatever their layout."""
    layout = state_layout(state)
    ea, eas = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
    if layout == "8bit":
        a, a_sq = (_local_rows_of(p, state[k]) for k in ABSMAX_KEYS)
        m, v = dequantize_moments(_rows(p, ea), a, _rows(p, eas), a_sq)
        return m.reshape(ea.shape), v.reshape(eas.shape)
    m, v = ea.float(), eas.float()
    if layout == "fp16":
        m, v = m * state["exp_avg_scale"].float(), v * state["exp_avg_sq_scale"].float()
    return m.contiguous(), v.contiguous()


def _wrap_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if not is_dtensor(p):
        return local
    return dtensor_like(local, p)


def to_fp32_state(p: torch.Tensor, state: Dict[str, Any], saved: Optional[SavedMoments]) -> str:
    """Put withheld moments back as fp32 (for an fp32 or fp16-stats optimizer); the layout found."""
    if saved is None or not saved.tensors:
        return saved.layout if saved is not None else state_layout(state)
    state.update(saved.tensors)
    m, v = fp32_moments(p, state)
    for k in ABSMAX_KEYS:
        state.pop(k, None)
    state["exp_avg"], state["exp_avg_sq"] = _wrap_like(p, m), _wrap_like(p, v)
    return saved.layout


def log_conversions(conversions: Set[Tuple[str, str]]) -> None:
    """One INFO line for a load that changed the moments' precision."""
    if conversions:
        pairs = ", ".join(f"{a} -> {b}" for a, b in sorted(conversions))
        logger.info(f"cpu_adam: converted the loaded Adam moments ({pairs}) to this run's --adam-state-precision")


# ---------------------------------------------------------------------------
# The reduced-precision moments of one optimizer
# ---------------------------------------------------------------------------


def _spans(total: int, unit: int, chunk: int) -> Iterator[Tuple[int, int]]:
    """[a, b) ranges over ``total`` items of ``unit`` values each, about ``chunk`` values per range."""
    step = max(1, chunk // max(1, unit))
    for a in range(0, total, step):
        yield a, min(total, a + step)


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``'s local tensor in its own dtype (cast per slice later), placed like ``p``."""
    g = p.grad
    if is_dtensor(g):
        if tuple(g.placements) != tuple(p.placements):
            g = g.redistribute(p.device_mesh, p.placements)
        g = g.to_local()
    return g.contiguous()


class ReducedMoments:
    """bf16 or 8-bit moments for :class:`toolkit.optim.cpu_adam.CPUAdam`; see the module docstring."""

    def __init__(self, precision: str, chunk_elements: int = CHUNK_ELEMENTS, fused: Optional[Callable] = None):
        if precision not in PRECISIONS or precision == "fp32":
            raise ValueError(f"reduced moments: {precision!r}")
        self.precision = precision
        self.chunk_elements = chunk_elements
        self.fused = fused  # 8-bit layouts: toolkit.optim.fused_8bit.update (None: the eager codec below)

    def zeros(self, p: torch.Tensor) -> Dict[str, torch.Tensor]:
        return zeros_state(param_layout(self.precision, p), p)

    def adopt(self, p: torch.Tensor, state: Dict[str, Any], saved: Optional[SavedMoments]) -> Optional[Tuple[str, str]]:
        """Bring a loaded state into this precision; (from, to) when it converted, else None."""
        if saved is not None:
            state.update(saved.tensors)
        want, have = param_layout(self.precision, p), state_layout(state)
        if have == want:
            if want == "8bit":  # a full-state load leaves scales it had no template for unsharded
                for k in ABSMAX_KEYS:
                    state[k] = _absmax_like_rows(p, _local_rows_of(p, state[k]))
            return None
        m, v = fp32_moments(p, state)
        for k in ABSMAX_KEYS + ("exp_avg_scale", "exp_avg_sq_scale"):
            state.pop(k, None)
        state.update(zeros_state(want, p))
        self._store(p, state, want, 0, m.numel(), m.reshape(-1), v.reshape(-1))
        return have, want

    # -- the update ------------------------------------------------------------
    @torch.no_grad()
    def update(
        self,
        ds,
        p: torch.Tensor,
        local: torch.Tensor,
        state: Dict[str, Any],
        group: Dict[str, Any],
        grad_scale: float = 1.0,
    ) -> None:
        """One Adam step of ``p`` (local shard ``local``) through DeepSpeed's op, a bounded slice at a time,
        with the gradient times ``grad_scale`` (the trainer's normalization and clip factor, folded in)."""
        layout = param_layout(self.precision, p)
        grad = local_grad(p)
        step = int(state["step"].item()) + 1
        beta1, beta2 = group["betas"]
        hyper = (
            ds.opt_id,
            step,
            group["lr"],
            beta1,
            beta2,
            group["eps"],
            group["weight_decay"],
            group["bias_correction"],
        )
        flat_p, flat_g = local.view(-1), grad.view(-1)
        unit = (p.numel() // max(1, p.shape[0])) if layout == "8bit" else 1
        if (
            layout == "8bit"
            and self.fused is not None
            and self.fused(
                _rows(p, local),
                _rows(p, grad),
                [local_tensor(state[k]) for k in REDUCED_KEYS],
                hyper[1:],
                grad_scale,
                max(1, self.chunk_elements // unit),
            )
        ):
            return
        for a, b in _spans(flat_p.numel() // max(1, unit), unit, self.chunk_elements):
            lo, hi = a * unit, b * unit
            m, v = self._load(p, state, layout, lo, hi)
            g = flat_g[lo:hi]
            if g.dtype != flat_p.dtype:
                g = g.to(flat_p.dtype)
            if grad_scale != 1.0:
                g.mul_(grad_scale)
            ds.ds_opt_adam.adam_update(*hyper, flat_p[lo:hi], g, m, v)
            self._store(p, state, layout, lo, hi, m, v)

    @staticmethod
    def _load(p, state, layout: str, lo: int, hi: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """fp32 moments of values [lo, hi) of the local shard: views for fp32 (updated in place), copies otherwise."""
        ea, eas = local_tensor(state["exp_avg"]).view(-1), local_tensor(state["exp_avg_sq"]).view(-1)
        if layout != "8bit":
            return ea[lo:hi].float(), eas[lo:hi].float()  # .float() of an fp32 view is the view itself
        cols = p.numel() // p.shape[0]
        r0, r1 = lo // cols, hi // cols
        a = local_tensor(state["exp_avg_absmax"])[r0:r1]
        a_sq = local_tensor(state["exp_avg_sq_absmax"])[r0:r1]
        m, v = dequantize_moments(ea[lo:hi].view(r1 - r0, cols), a, eas[lo:hi].view(r1 - r0, cols), a_sq)
        return m.view(-1), v.view(-1)

    @staticmethod
    def _store(p, state, layout: str, lo: int, hi: int, m: torch.Tensor, v: torch.Tensor) -> None:
        ea, eas = local_tensor(state["exp_avg"]).view(-1), local_tensor(state["exp_avg_sq"]).view(-1)
        if layout != "8bit":
            if ea.dtype != torch.float32 or ea[lo:hi].data_ptr() != m.data_ptr():
                ea[lo:hi].copy_(m)
                eas[lo:hi].copy_(v)
            return
        cols = p.numel() // p.shape[0]
        r0, r1 = lo // cols, hi // cols
        r_codes, r_absmax, v_codes, vmax = quantize_moments(m.view(r1 - r0, cols), v.view(r1 - r0, cols))
        ea[lo:hi].copy_(r_codes.view(-1))
        eas[lo:hi].copy_(v_codes.view(-1))
        local_tensor(state["exp_avg_absmax"])[r0:r1].copy_(r_absmax)
        local_tensor(state["exp_avg_sq_absmax"])[r0:r1].copy_(vmax)


def state_nbytes(precision: str, shape: torch.Size) -> int:
    """Host bytes of the two moments (and scales) of a parameter of ``shape`` under ``precision``."""
    meta = torch.empty(shape, device="meta")
    layout = param_layout(precision, meta)
    n = meta.numel()
    if layout == "fp32":
        return 8 * n
    if layout == "bf16":
        return 4 * n
    blocks, _ = row_blocks(n // shape[0])
    return 2 * n + 2 * 4 * shape[0] * blocks


def check_sharded_load(folder: str, saved_keys, optimizer: torch.optim.Optimizer) -> None:
    """Refuse a sharded (DCP) load between 8-bit and float moments, which DCP would copy value by value.

    DCP fills this run's state tensors in place; bf16 and fp32 moments convert that way, but
    8-bit codes and their scales do not (the consolidated path converts them).
    """
    saved_8bit = any(k.startswith("optim.state.") and k.endswith(".exp_avg_absmax") for k in saved_keys)
    moments = getattr(optimizer, "moments", None)
    run_8bit = moments is not None and any(
        param_layout(moments.precision, p) == "8bit" for group in optimizer.param_groups for p in group["params"]
    )
    if saved_8bit != run_8bit:
        saved, run = ("8bit", "float") if saved_8bit else ("float", "8bit")
        raise UserError(
            f"{folder}: its Adam moments are saved as {saved} and this run keeps them as {run} "
            f"(--adam-state-precision); convert through a consolidated checkpoint: run "
            f"toolkit-consolidate {folder} and pass the .pt to --restore-file, or add --reset-optimizer"
        )
