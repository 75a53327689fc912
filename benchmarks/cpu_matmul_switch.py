"""The fp32 CPU matmul switch (``toolkit.ops``, ``--cpu-matmul``) on the toolkit's own Llama training step (CPU).

    python -m benchmarks.cpu_matmul_switch                       # 4 x 256 Llama, B 8 x T 256, 2 threads
    python -m benchmarks.cpu_matmul_switch --threads 1 --rounds 6 --checkpoint-activations

Three copies of one model (``llama_hf.py``'s shape and step: the ``cross_entropy`` criterion with its fused head,
backward, fused AdamW) train on the same random batches, alternated step by step in one process, so a neighbour on a
shared machine slows all alike:

- ``torch``: the switch off (``--cpu-matmul torch``): no torch-function mode, every product torch's BLAS;
- ``onednn``: the switch on (``--cpu-matmul onednn``): the mode sends every ``F.linear`` to oneDNN;
- ``mode-only``: the mode on, but every product (and the fused head's orientation) torch's as with the switch off:
  what the switch itself costs a step, its handler calls, where oneDNN gains nothing.

The switch is set before each step as a command sets it at its start (``ops.restore``: no measurement). Reports the
median step time of each, onednn / torch and mode-only / torch (above 1: faster than the switch off), how far the
three losses of the last step are apart (the same fp32 math in another summation order), what ``--cpu-matmul auto``
would choose here (its kept measurement), and one JSON line (``"benchmark": "cpu_matmul_switch"``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy

import torch

from benchmarks.llama_hf import add_step_args, alternated, build_ours, make_step, toolkit_loss
from benchmarks.timing import Report, add_results_flag
from toolkit import ops
from toolkit.core import cpu_gemm


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(ap)
    add_results_flag(ap)
    ap.add_argument(
        "--checkpoint-activations",
        action="store_true",
        help="each block checkpointed as toolkit-train's flag does (torch's own; the recomputation in backward "
        "runs under the switch too)",
    )
    return ap.parse_args(argv)


@contextlib.contextmanager
def products_to_torch():
    """The mode stays on the stack and its handler runs, but ``cpu_gemm`` reads its decision as torch's: every
    product, and the fused head's orientation, exactly as with the switch off."""
    cpu_gemm._state["onednn"] = False
    try:
        yield
    finally:
        cpu_gemm._state["onednn"] = True


def switched(step, onednn: bool, to_torch: bool = False):
    def run(tokens):
        ops.restore(onednn)
        with products_to_torch() if to_torch else contextlib.nullcontext():
            return step(tokens)

    return run


def run(args):
    torch.set_num_threads(args.threads)
    if not ops.onednn_available():
        raise SystemExit("this torch build has no oneDNN linear kernel: nothing to switch")
    model, _ = build_ours(args)
    if args.checkpoint_activations:
        from toolkit.distributed.parallelize import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    loss = toolkit_loss(None)
    steps = {
        "torch": switched(make_step(copy.deepcopy(model).train(), loss), onednn=False),
        "onednn": switched(make_step(copy.deepcopy(model).train(), loss), onednn=True),
        "mode-only": switched(make_step(model.train(), loss), onednn=True, to_torch=True),
    }
    stats, timed = alternated(steps, args)
    step_ms = timed["step_ms"]
    ops.restore(None)
    auto = ops.select("auto")  # the kept measurement of this machine (measured now where none is kept)
    return stats, {
        **{k: getattr(args, k) for k in ("layers", "dim", "ffn", "heads", "kv_heads", "vocab", "tokens", "batch")},
        "threads": args.threads,
        "rounds": args.rounds,
        "checkpoint_activations": args.checkpoint_activations,
        **timed,
        "onednn_speedup": round(step_ms["torch"] / step_ms["onednn"], 3),
        "mode_only_speedup": round(step_ms["torch"] / step_ms["mode-only"], 3),
        "auto_chooses": "onednn" if auto else "torch",
    }


def main(argv=None) -> None:
    report = Report("cpu_matmul_switch", argv=argv)
    args = parse(argv)
    stats, result = run(args)
    for name, ms in result["step_ms"].items():
        print(f"{name:>10}: {ms:8.1f} ms/step  {result['tokens_per_s'][name]:9.1f} tokens/s")
    print(
        f"onednn / torch {result['onednn_speedup']:.3f}x, mode-only / torch {result['mode_only_speedup']:.3f}x "
        f"(median of {result['rounds']} alternated steps); last losses within {result['last_loss_diff']:.2e}; "
        f"--cpu-matmul auto here: {result['auto_chooses']}"
    )
    report.emit(stats, baseline="torch", results=args.results, **result)


if __name__ == "__main__":
    main()
