#!/usr/bin/env bash
# Builds a real fairseq 0.12.2 next to the toolkit, for benchmarks/fairseq_parity/parity.py.
#
# fairseq is not pip-installable on Python 3.11 with torch 2.x (its pinned hydra-core 1.0 / omegaconf 2.0
# and its own configs use dataclass instances as field defaults, which Python 3.11 refuses). So: a venv that
# sees the system's torch/numpy, fairseq's pinned config libraries, fairseq's released source (the PyPI
# sdist, checked by sha256) with its two Cython extensions built in place, and a sitecustomize shim that
# restores Python 3.10's dataclass behaviour (shim_sitecustomize.py). fairseq's own code is not modified.
#
#   bash benchmarks/fairseq_parity/setup.sh            # -> $FAIRSEQ_HOME (default ~/.cache/toolkit/fairseq-0.12.2)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
home=${FAIRSEQ_HOME:-$HOME/.cache/toolkit/fairseq-0.12.2}
sha=34f1b18426bf3844714534162f065ab733e049597476daa35fffb4d06a92b524
mkdir -p "$home"
if [ ! -x "$home/venv/bin/python" ]; then
  echo "[fairseq-parity] creating $home/venv (sees the system's torch)"
  python3 -m venv --system-site-packages "$home/venv"
  # omegaconf 2.0.6 declares 'PyYAML>=5.1.*', which newer pip refuses to resolve: install the pins without deps.
  "$home/venv/bin/pip" install -q --no-deps omegaconf==2.0.6 hydra-core==1.0.7
  "$home/venv/bin/pip" install -q antlr4-python3-runtime==4.8 PyYAML bitarray sacrebleu regex cython scikit-learn
fi
if [ ! -d "$home/src/fairseq" ]; then
  echo "[fairseq-parity] downloading fairseq 0.12.2 (sdist)"
  # pip finds the released sdist by name and version (no index address here); the sha256 pins its bytes.
  rm -rf "$home/dl" && python3 -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
    -d "$home/dl" fairseq==0.12.2
  mv "$home/dl/fairseq-0.12.2.tar.gz" "$home/fairseq.tar.gz" && rm -rf "$home/dl"
  echo "$sha  $home/fairseq.tar.gz" | sha256sum -c --quiet
  mkdir -p "$home/src" && tar xzf "$home/fairseq.tar.gz" -C "$home/src" --strip-components 1
fi
cp "$here/shim_sitecustomize.py" "$home/sitecustomize.py"
echo "[fairseq-parity] building fairseq's Cython extensions"
(cd "$home/src" && "$home/venv/bin/python" "$here/build_extensions.py")
PYTHONPATH="$home:$home/src" "$home/venv/bin/python" -c "import fairseq_cli.train, fairseq_cli.eval_lm; print('[fairseq-parity] fairseq', __import__('fairseq').__version__, 'ready in', '$home')"
