"""Compare the training losses two toolkit-train logs report (fairseq's ``train_inner`` JSON lines).

    python -m benchmarks.compare_losses REFERENCE.log OTHER.log                    # every common logged update
    python -m benchmarks.compare_losses bf16.log fp8.log --last 50 --tolerance 0.01  # mean of the last 50 updates

Without ``--last``: the largest relative difference over the updates both logs report (eager
against ``--compile``: the same computation, so the difference is rounding). With ``--last N``:
the relative difference of the mean loss over the logged intervals that end in the last N
updates (bf16 against ``--fp8``: different arithmetic, so only where training ends up counts).
Prints one line; exits 1 when the difference is above ``--tolerance`` or a log has no losses.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Dict

TRAIN_INNER = re.compile(r"\| train_inner \| (\{.*\})")


def logged_losses(path: str) -> Dict[int, float]:
    """{num_updates: loss} of every ``train_inner`` line in the log."""
    with open(path, encoding="utf-8", errors="replace") as f:
        rows = [json.loads(m.group(1)) for m in map(TRAIN_INNER.search, f) if m]
    return {int(r["num_updates"]): float(r["loss"]) for r in rows}


def final_mean(losses: Dict[int, float], last: int) -> float:
    end = max(losses)
    tail = [loss for update, loss in losses.items() if update > end - last]
    return sum(tail) / len(tail)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference")
    ap.add_argument("other")
    ap.add_argument("--last", type=int, default=None, help="compare the mean loss of the last N updates")
    ap.add_argument("--tolerance", type=float, default=1e-2, help="largest relative difference that passes")
    args = ap.parse_args(argv)
    ref, other = logged_losses(args.reference), logged_losses(args.other)
    if not ref or not other:
        print(f"compare_losses: no train_inner losses in {args.reference if not ref else args.other}")
        return 1
    if args.last:
        a, b = final_mean(ref, args.last), final_mean(other, args.last)
        diff = (b - a) / a
        what = f"mean loss of the last {args.last} updates {a:.4f} vs {b:.4f} (updates {max(ref)} / {max(other)})"
    else:
        common = sorted(set(ref) & set(other))
        if not common:
            print("compare_losses: the two logs share no logged update")
            return 1
        diff = max(((other[u] - ref[u]) / ref[u] for u in common), key=abs)
        what = f"{len(common)} logged updates"
    ok = abs(diff) <= args.tolerance
    print(
        f"compare_losses: {what}: relative difference {diff:+.2e} "
        f"({'within' if ok else 'NOT within'} {args.tolerance:g})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
