"""Parameter accounting of any registered architecture, by its top-level parts.

    python -m toolkit.models.accounting transformer_lm_wiki103 --vocab-size 267744
    python -m toolkit.models.accounting llama3_1b qwen2_0_5b     # at their published vocabularies

prints the parameter count of a named architecture by part (its top-level modules, built on the meta
device, no memory; a tied parameter counted once, under the part that holds it first). Without
``--vocab-size`` a size counts at the vocabulary its architecture was published with, when its
family registered one (``toolkit.core.registry.PUBLISHED_VOCAB_SIZE``), else at GPT-2's 50257.
A family's FLOPs (the N of 6N) are its own ``flops_per_token`` (``transformer_lm/accounting.py``).
"""

from __future__ import annotations

from typing import Optional, Sequence

from toolkit.models import count_parameters, parameter_breakdown  # noqa: F401  (this module's API)


def main(argv: Optional[Sequence[str]] = None) -> None:
    from toolkit.config.options import OneLineErrorParser

    parser = OneLineErrorParser(
        prog="python -m toolkit.models.accounting", description="Parameter counts of named architectures."
    )
    parser.add_argument("arch", nargs="+")
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="dictionary size (default: the arch's published one, else 50257)"
    )
    parser.add_argument("--tokens-per-sample", type=int, default=2048)
    args = parser.parse_args(argv)
    for arch in args.arch:
        count_parameters(arch, args.vocab_size or default_vocab_size(arch), args.tokens_per_sample, verbose=True)


def default_vocab_size(arch: str) -> int:
    """The vocabulary a named size was published with (its family registers it), else GPT-2's."""
    from toolkit.core import registry

    registry.import_submodules("toolkit.models")
    return registry.PUBLISHED_VOCAB_SIZE.get(arch, 50257)


if __name__ == "__main__":
    main()
