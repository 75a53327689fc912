"""``--overlap-offload-step``: the overlapped offloaded update equals the serial one bit for bit.

Offload is a placement no-op on CPU, but the threaded order is not: the worker thread
steps CPU Adam block by block while the next forward runs (through the GIL-releasing build
of DeepSpeed's op, while the serial run uses DeepSpeed's own: the same bits too). Each run below trains the
same tiny model twice in one process (serial, then overlapped, with the worker slowed
down so that a missing wait would let the forward read stale weights) and compares
losses, gradient norms, a checkpoint taken while an update is in flight, a validation
step taken while one is in flight, and the final parameters and optimizer states with
``torch.equal``. Two gloo ranks (``--clip-norm``, ``--update-freq 2``, ``--checkpoint-activations``)
and one process (fp32; fp16 with overflowing loss scales); two ranks with ``--bf16-host-grads`` and
8-bit moments.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Dict, List

import pytest
import torch

from tests.helpers import ranks
from tests.helpers.dist_helpers import make_lm_data_bin, model_args

OFFLOAD = [
    "--ddp-backend",
    "fully_sharded",
    "--cpu-offload",
    "--optimizer",
    "cpu_adam",
    "--lr",
    "0.01",
    "--weight-decay",
    "0.01",
]
UPDATES = 3
SLOW_WORKER_S = 0.03  # per block: the forward overtakes the worker unless it waits


def _config(argv: List[str]):
    from toolkit.train.resolve import parse_train_config

    return parse_train_config(argv)


def _slow_down(overlap) -> None:
    step_part = overlap._step_part

    def slow(part, grad_scale):
        time.sleep(SLOW_WORKER_S)
        step_part(part, grad_scale)

    overlap._step_part = slow


def _train(argv: List[str], env, overlap: bool) -> Dict[str, Any]:
    """UPDATES updates; a checkpoint state right after update 2 and a validation step right after update 3."""
    from toolkit.checkpoint import consolidated
    from toolkit.core.dtensor import local_tensor
    from toolkit.train.train_loop import build_trainer, train_iterator, valid_iterator

    cfg = _config(argv + (["--overlap-offload-step"] if overlap else []))
    torch.manual_seed(cfg.common.seed)
    trainer = build_trainer(cfg, env, [cfg.dataset.train_subset, "valid"])
    assert (trainer.overlap is not None) == overlap
    if overlap:
        _slow_down(trainer.overlap)
    norms: List[float] = []
    log_update = trainer._log_update
    trainer._log_update = lambda totals, size, norm: (norms.append(norm), log_update(totals, size, norm))
    batches = train_iterator(cfg, trainer, epoch=1).next_epoch_itr(shuffle=False)
    valid_sample = next(valid_iterator(cfg, trainer, "valid").next_epoch_itr(shuffle=False))
    out: Dict[str, Any] = {"losses": []}
    for update in range(1, UPDATES + 1):
        totals = trainer.train_step([next(batches) for _ in range(cfg.optimization.update_freq)])
        out["losses"].append(None if totals is None else totals["loss"])  # None: an fp16 overflow skipped it
        if update in (2, 3):
            out[f"pending_{update}"] = overlap and trainer.overlap.pending
        if update == 2:  # what a checkpoint saves, taken while the update may still run
            out["checkpoint"] = {
                "model": consolidated.model_state(trainer.model),
                "optimizer": consolidated.optimizer_state(trainer.model, trainer.optimizer),
                "trainer": trainer.state_dict(),
            }
        if update == 3:
            out["valid"] = trainer.valid_step(valid_sample)
    trainer.finish_pending_steps()
    out["norms"] = norms
    out["params"] = [local_tensor(p.detach()).clone() for p in trainer.model.parameters()]
    out["states"] = [
        {k: local_tensor(v).clone() for k, v in trainer.optimizer.state[p].items()} for p in trainer.model.parameters()
    ]
    if overlap:
        out["gil_free"] = trainer.optimizer._ds.ds_opt_adam.__name__ == "toolkit_cpu_adam_nogil"
        out["hooks_first"] = all(
            isinstance(first := next(iter(g.module._forward_pre_hooks.values())), functools.partial)
            and first.func == trainer.overlap._before_forward
            for g in trainer.overlap.groups
        )
    return out


def differences(a: Any, b: Any, path: str = "") -> List[str]:
    """Where two nested results differ (tensors by torch.equal, numbers exactly)."""
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: lengths {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, torch.Tensor):
        b = b.full_tensor() if hasattr(b, "full_tensor") else b
        a = a.full_tensor() if hasattr(a, "full_tensor") else a
        return [] if a.dtype == b.dtype and torch.equal(a, b) else [path]
    return [] if a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)) else [f"{path}: {a} != {b}"]


def compare(argv: List[str], env) -> Dict[str, Any]:
    """Serial and overlapped runs of ``argv``: their differences and the checks that the overlap really overlapped."""
    from toolkit.logging import metrics

    with metrics.aggregate(new_root=True):
        serial = _train(argv, env, overlap=False)
        overlapped = _train(argv, env, overlap=True)
    checks = {k: overlapped.pop(k) for k in ("hooks_first", "gil_free", "pending_2", "pending_3")}
    serial.pop("pending_2"), serial.pop("pending_3")
    return {"diff": differences(serial, overlapped), "losses": serial["losses"], "norms": serial["norms"], **checks}


def check(result: Dict[str, Any], clip_norm: float) -> None:
    assert result["diff"] == [], result["diff"]
    assert result["hooks_first"]  # our wait runs before FSDP2's all-gather of each block
    assert result["gil_free"]  # the overlapped update ran DeepSpeed's op under the GIL-releasing binding
    # the slowed worker was still updating when the checkpoint state and the validation step were taken
    assert result["pending_2"] and result["pending_3"]
    assert all(x is None or math.isfinite(x) for x in result["losses"]), result["losses"]
    assert max(result["norms"]) > clip_norm  # --clip-norm clipped at least one update


def _worker(rank: int, world_size: int, store: str, argv: List[str], out: str) -> None:
    import torch.distributed as dist

    from toolkit.distributed.utils import DistributedEnv

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"file://{store}")
    try:
        result = compare(argv, DistributedEnv(rank=rank, world_size=world_size, local_world_size=world_size))
        torch.save(result, f"{out}.{rank}")
        dist.barrier()  # neither rank tears gloo down while the other is still in a collective
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return make_lm_data_bin(str(tmp_path_factory.mktemp("overlap") / "data"))


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """FSDP2 needs a process group even for one rank: a gloo group of one, in this process."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        store = tmp_path_factory.mktemp("rdzv") / "store"
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{store}")
    yield
    if created:
        dist.destroy_process_group()


def test_two_ranks_bit_identical_with_clipping_and_update_freq_2(tmp_path, data):
    argv = [
        data,
        *model_args(str(tmp_path)),
        *OFFLOAD,
        "--clip-norm",
        "0.3",
        "--update-freq",
        "2",
        "--checkpoint-activations",
    ]  # the offload recipe's: blocks are checkpoint wrappers
    ranks.spawn(_worker, 2, 2, str(tmp_path / "store"), argv, str(tmp_path / "out"))
    for rank in range(2):
        check(torch.load(f"{tmp_path / 'out'}.{rank}", weights_only=True), clip_norm=0.3)


def test_two_ranks_bf16_host_grads_and_8bit_moments_bit_identical(tmp_path, data):
    """--bf16-host-grads composes with the overlap: the bf16 gradients the hooks store during backward are the
    ones the worker takes the squares of and steps with (8-bit moments: the 13B recipe's pair, fused kernel)."""
    argv = [
        data,
        *model_args(str(tmp_path)),
        *OFFLOAD,
        "--clip-norm",
        "0.3",
        "--update-freq",
        "2",
        "--bf16-host-grads",
        "--adam-state-precision",
        "8bit",
    ]
    ranks.spawn(_worker, 2, 2, str(tmp_path / "store"), argv, str(tmp_path / "out"))
    for rank in range(2):
        check(torch.load(f"{tmp_path / 'out'}.{rank}", weights_only=True), clip_norm=0.3)


def test_one_process_bit_identical(tmp_path, data, one_rank_group):
    from toolkit.distributed.utils import DistributedEnv

    check(compare([data, *model_args(str(tmp_path)), *OFFLOAD, "--clip-norm", "0.5"], DistributedEnv()), 0.5)


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_one_process_reduced_precision_moments_bit_identical(tmp_path, data, one_rank_group, precision):
    """--adam-state-precision: the sliced update of reduced moments, block by block on the worker, is the serial one."""
    from toolkit.distributed.utils import DistributedEnv

    check(
        compare(
            [data, *model_args(str(tmp_path)), *OFFLOAD, "--clip-norm", "0.5", "--adam-state-precision", precision],
            DistributedEnv(),
        ),
        0.5,
    )


def test_one_process_fp16_overflow_skips_bit_identical(tmp_path, data, one_rank_group):
    """A loss scale that overflows first: the skipped updates and the ones after are the serial ones."""
    from toolkit.distributed.utils import DistributedEnv

    result = compare(
        [data, *model_args(str(tmp_path)), *OFFLOAD, "--fp16", "--fp16-init-scale", str(2**13), "--clip-norm", "0.5"],
        DistributedEnv(),
    )
    assert result["losses"][0] is None and result["losses"][-1] is not None, result["losses"]
    check(result, 0.5)


def test_one_process_compiled_blocks_bit_identical(tmp_path, data, one_rank_group, monkeypatch):
    """--compile compiles each block's call, hooks included: ours (a thread wait) must stay eager."""
    from toolkit.distributed.utils import DistributedEnv

    monkeypatch.setenv("TOOLKIT_COMPILE_BACKEND", "aot_eager")  # the graph capture without inductor's codegen
    check(
        compare([data, *model_args(str(tmp_path)), *OFFLOAD, "--clip-norm", "0.5", "--compile"], DistributedEnv()), 0.5
    )


def test_worker_errors_surface_in_the_main_thread_with_their_message(tmp_path, data, one_rank_group):
    from toolkit.distributed.utils import DistributedEnv
    from toolkit.train.train_loop import build_trainer, train_iterator

    cfg = _config([data, *model_args(str(tmp_path)), *OFFLOAD, "--overlap-offload-step"])
    trainer = build_trainer(cfg, DistributedEnv(), [cfg.dataset.train_subset])
    batches = train_iterator(cfg, trainer, epoch=1).next_epoch_itr(shuffle=False)
    failing = set(map(id, trainer.overlap.groups[1].params))  # block 0 (group 0: the root's own parameters)
    run_step = trainer.optimizer.run_step

    def run_step_failing_in_block_0(plan, grad_scale=1.0):
        if any(id(p) in failing for p, _ in plan):
            raise ValueError("injected failure in block 0's update")
        run_step(plan, grad_scale)

    trainer.optimizer.run_step = run_step_failing_in_block_0
    trainer.train_step([next(batches)])  # launches the update; the failure happens on the worker thread
    # the next forward (at block 0), a checkpoint's state_dict and validation all raise the worker's exception
    for action in (
        lambda: trainer.train_step([next(batches)]),
        trainer.model.state_dict,
        lambda: trainer.optimizer.state_dict(),
        lambda: trainer.valid_step(next(batches)),
    ):
        with pytest.raises(ValueError, match="^injected failure in block 0's update$"):
            action()
