#!/usr/bin/env bash
# Install toolkit and everything it needs on a fresh machine (idempotent; fast when already done).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

have() { "$PY" -c "import $1" >/dev/null 2>&1; }

# torch first and pinned: anything that merely asks for "torch" must not pull a CUDA build.
"$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13') else 1)" >/dev/null 2>&1 \
  || "$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q numpy sentencepiece tokenizers tensorboard tqdm pytest pytest-xdist \
  safetensors onnx onnxruntime onnxscript transformers wandb
# The formatter and linter (scripts/run_tests.sh checks the tree with them): pinned, so the shape is one version's.
"$PY" -c "import ruff" >/dev/null 2>&1 && [ "$("$PY" -m ruff --version)" = "ruff 0.17.6" ] \
  || "$PY" -m pip install -q "ruff==0.17.6"
# toolkit-preprocess inputs (Parquet, datasets folders, .zst): after torch, which stays pinned
# (datasets does not ask for torch; --upgrade-strategy only-if-needed keeps what is installed).
have datasets && have pyarrow && have zstandard \
  || "$PY" -m pip install -q --upgrade-strategy only-if-needed datasets pyarrow zstandard
# torchao (--fp8) after torch, without its dependencies: it must not replace the pinned torch.
have torchao || "$PY" -m pip install -q --no-deps torchao
# lm-evaluation-harness (toolkit-eval-harness, --eval-harness-tasks): checked not to replace torch.
have lm_eval || "$PY" -m pip install -q "lm-eval==0.4.13" accelerate
# Hydra (toolkit-hydra-train, toolkit-train --config): pure Python, checked not to replace torch.
have hydra && have omegaconf || "$PY" -m pip install -q --upgrade-strategy only-if-needed hydra-core
# DeepSpeed's setup.py imports torch, so it builds against the torch installed above.
have deepspeed || "$PY" -m pip install -q --no-build-isolation deepspeed
"$PY" -m pip install -q --no-deps --no-build-isolation -e .
# DeepSpeed's CPU Adam and the two ops built like it compile on first use (a minute or more each, once per
# machine, cached under ~/.cache/torch_extensions): build them now, so no run or test waits for a compiler.
echo "setup_env: building the C++ optimizer ops if not cached (python -m toolkit.optim.build_ops)"
"$PY" -m toolkit.optim.build_ops || echo "setup_env: some ops were not built; they are tried again at first use"
