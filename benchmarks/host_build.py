"""Time to build a model on the host: the meta-device build, then materialize + initialize.

    python -m benchmarks.host_build --arch transformer_lm_gpt3_2_7           # 2.55B on CPU (about 10 GB)
    python -m benchmarks.host_build --arch transformer_lm_gpt3_13 --threads 16  # a 16-core GPU host
    python -m benchmarks.host_build --arch transformer_lm --decoder-layers 2 --decoder-embed-dim 64

What runs is toolkit-train's path before its first update, with no wrapper on one process (the
same ``to_empty`` + ``init_weights`` that ``--ddp-backend fully_sharded --cpu-offload`` runs on a
GPU machine, where the shards live in host memory): ``toolkit.models.build_model`` under
``torch.device("meta")``, then ``toolkit.distributed.parallelize.parallelize`` (materialize every
parameter on the CPU and draw its initial value). The rest of the time to the first update (data
loading, the optimizer's first step, a GPU's forward) is not in it: on this CPU-only machine a 2.7B
update is out of reach, and the host build was the part that grew with the model (194 s of 13B's
start on a 16-core GPU host, 2026-11-25).

Prints one JSON line (``"benchmark": "host_build"``): seconds of the meta build and of
materialize + initialize, parameters, threads, and a checksum of the initial values (the sum of
every parameter's float64 sum), which must not change with ``--threads``.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.timing import Report, add_results_flag, time_call


def parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--vocab", type=int, default=50264, help="dictionary size (default: GPT-2's as fairseq pads it)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--no-checksum", action="store_true", help="skip the checksum pass (one read of every value)")
    add_results_flag(ap)
    ours, rest = ap.parse_known_args(argv)
    return ours, rest


def main(argv=None):
    ours, rest = parse(argv)
    if ours.threads:
        torch.set_num_threads(ours.threads)
    report = Report("host_build", argv=argv)
    from toolkit import models
    from toolkit.data.dictionary import Dictionary
    from toolkit.distributed.parallelize import parallelize
    from toolkit.distributed.utils import DistributedEnv
    from toolkit.tasks.language_modeling import LanguageModelingTask
    from toolkit.train.resolve import parse_train_config

    cfg = parse_train_config(
        [
            "synthetic",
            "--task",
            "language_modeling",
            "--optimizer",
            "adam",
            "--lr",
            "1e-4",
            "--num-workers",
            "0",
            "--seed",
            "1",
            "--cpu",
            "--tokens-per-sample",
            "2048",
            *rest,
        ]
    )
    dictionary = Dictionary()
    while len(dictionary) < ours.vocab:
        dictionary.add_symbol(f"w{len(dictionary)}")
    task = LanguageModelingTask(cfg.task, dictionary)

    def meta_build():
        with torch.device("meta"):
            return models.build_model(cfg.components.arch, cfg.model, task)

    meta_s, model = time_call(meta_build)
    init_s, (model, _) = time_call(
        lambda: parallelize(model, cfg.distributed, cfg.common, DistributedEnv(device=torch.device("cpu")))
    )
    params = models.count_params(model)[0]
    checksum = None
    if not ours.no_checksum:
        with torch.no_grad():
            checksum = float(sum(p.double().sum() for p in {id(p): p for p in model.parameters()}.values()))
    print(
        f"{cfg.components.arch}: {params / 1e9:.3f}B parameters, meta build {meta_s:.2f} s, "
        f"materialize + initialize {init_s:.2f} s ({torch.get_num_threads()} threads)"
    )
    report.emit(
        results=ours.results,
        arch=cfg.components.arch,
        params=params,
        meta_build_s=round(meta_s, 3),
        materialize_init_s=round(init_s, 3),
        total_s=round(meta_s + init_s, 3),
        checksum=checksum,
    )


if __name__ == "__main__":
    main()
