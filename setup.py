from setuptools import find_packages, setup

setup(
    name="toolkit",
    version="0.1.0",
    description="A fairseq-style language-model training toolkit on PyTorch FSDP2",
    packages=find_packages(include=["toolkit", "toolkit.*", "toolkit_cli", "toolkit_cli.*"]),
    package_data={"toolkit.optim": ["csrc/*.cpp"]},  # the fused 8-bit Adam kernel, built on first use
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "numpy",
        "sentencepiece",
        "tokenizers",
        "tensorboard",
        "tqdm",
    ],
    extras_require={
        # DeepSpeed's sdist imports torch in setup.py: install it with --no-build-isolation
        # after torch, as scripts/setup_env.sh does.
        "deepspeed": ["deepspeed"],
        "test": ["pytest"],
        # toolkit-export: ONNX graphs checked with onnxruntime, transformers folders both ways
        "export": ["safetensors", "onnx", "onnxruntime", "onnxscript", "transformers"],
        "wandb": ["wandb"],
        # --fp8: float8 training of the blocks' Linear layers (torchao's Float8Linear)
        "fp8": ["torchao"],
        # toolkit-eval-harness / --eval-harness-tasks: EleutherAI's lm-evaluation-harness
        "eval": ["lm-eval>=0.4,<0.5"],
        # toolkit-preprocess: *.parquet (pyarrow), --hf-dataset (datasets), *.jsonl.zst (zstandard)
        "data": ["datasets", "pyarrow", "zstandard"],
        # toolkit-hydra-train (fairseq-hydra-train's configs); toolkit-train --config reads YAML with omegaconf
        "hydra": ["hydra-core>=1.0.7", "omegaconf"],
    },
    entry_points={
        "console_scripts": [
            "toolkit-preprocess = toolkit_cli.preprocess:cli_main",
            "toolkit-train = toolkit_cli.train:cli_main",
            "toolkit-hydra-train = toolkit_cli.hydra_train:cli_main",
            "toolkit-eval-lm = toolkit_cli.eval_lm:cli_main",
            "toolkit-eval-harness = toolkit_cli.eval_harness:cli_main",
            "toolkit-validate = toolkit_cli.validate:cli_main",
            "toolkit-consolidate = toolkit_cli.consolidate:cli_main",
            "toolkit-export = toolkit_cli.export:cli_main",
            "toolkit-generate = toolkit_cli.generate:cli_main",
            "toolkit-interactive = toolkit_cli.interactive:cli_main",
            "toolkit-plan = toolkit_cli.plan:cli_main",
        ],
    },
)
