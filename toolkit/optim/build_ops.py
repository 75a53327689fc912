"""Build the C++ optimizer ops now rather than at their first use: ``python -m toolkit.optim.build_ops``.

DeepSpeed's CPU Adam op, the GIL-free binding of its update (``--overlap-offload-step``) and the fused
8-bit Adam kernel (``--adam-state-precision 8bit``) are compiled by torch's extension loader the first
time a run asks for them: a minute or more each, once per machine, cached under
``~/.cache/torch_extensions``. ``scripts/setup_env.sh`` calls this so that neither the first training
run nor a test waits for a compiler. The three are independent builds, so each runs in its own process
at the same time (``--serial`` for one after the other): on a GPU machine's minutes the wall time is the
slowest build's, not the sum. Each op that cannot be built is reported in one line; it will be tried
again (and fall back where the toolkit has a fallback) at first use.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

OPS = ("DeepSpeed's CPU Adam", "the GIL-free CPU Adam binding", "the fused 8-bit Adam kernel")


def _loader(index: int):
    from toolkit.optim import deepspeed_op, fused_8bit, gil_free_adam

    return (deepspeed_op.load_deepspeed_cpu_adam, gil_free_adam.load_gil_free_op, fused_8bit.fused_op)[index]


def build_one(index: int) -> int:
    """Build op ``index`` of ``OPS`` in this process; one line says how it went."""
    what, start = OPS[index], time.time()
    try:
        if _loader(index)() is None:  # fused_op: it logged why; 8-bit moments use the eager codec
            raise RuntimeError("see the warning above")
    except Exception as e:  # a missing compiler or DeepSpeed: the runs that need the op will say so
        print(f"build_ops: {what} not built ({str(e).strip().splitlines()[-1] if str(e).strip() else e!r})", flush=True)
        return 1
    print(f"build_ops: {what} ready ({time.time() - start:.1f} s)", flush=True)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", stream=sys.stdout
    )
    if argv[:1] == ["--one"]:
        return build_one(int(argv[1]))
    if "--serial" in argv:
        return 1 if sum(build_one(i) for i in range(len(OPS))) else 0
    print(
        f"build_ops: building {len(OPS)} ops at once (a minute or more on a first run; cached afterwards)", flush=True
    )
    children = [
        subprocess.Popen([sys.executable, "-m", "toolkit.optim.build_ops", "--one", str(i)]) for i in range(len(OPS))
    ]
    try:
        return 1 if any([child.wait() for child in children]) else 0
    finally:
        for child in children:  # interrupted: no compiler left running behind us
            if child.poll() is None:
                child.kill()


if __name__ == "__main__":
    sys.exit(main())
