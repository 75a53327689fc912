"""Build the C++ optimizer ops now rather than at their first use: ``python -m toolkit.optim.build_ops``.

DeepSpeed's CPU Adam op, the GIL-free binding of its update (``--overlap-offload-step``) and the fused
8-bit Adam kernel (``--adam-state-precision 8bit``) are compiled by torch's extension loader the first
time a run asks for them: a minute or more each, once per machine, cached under
``~/.cache/torch_extensions``. ``scripts/setup_env.sh`` calls this so that neither the first training
run nor a test waits for a compiler. Each op that cannot be built is reported in one line; it will be
tried again (and fall back where the toolkit has a fallback) at first use.
"""
from __future__ import annotations

import logging
import sys
import time


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        stream=sys.stdout)
    from toolkit.optim import deepspeed_op, fused_8bit, gil_free_adam

    ops = [("DeepSpeed's CPU Adam", deepspeed_op.load_deepspeed_cpu_adam),
           ("the GIL-free CPU Adam binding", gil_free_adam.load_gil_free_op),
           ("the fused 8-bit Adam kernel", fused_8bit.fused_op)]
    failed = 0
    for what, load in ops:
        start = time.time()
        try:
            if load() is None:  # fused_op: it logged why; 8-bit moments use the eager codec
                raise RuntimeError("see the warning above")
        except Exception as e:  # a missing compiler or DeepSpeed: the runs that need the op will say so
            failed += 1
            print(f"build_ops: {what} not built ({str(e).strip().splitlines()[-1] if str(e).strip() else e!r})")
            continue
        print(f"build_ops: {what} ready ({time.time() - start:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
