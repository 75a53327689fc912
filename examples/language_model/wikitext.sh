#!/usr/bin/env bash
# The main job: prepare a real corpus, binarize it, train a small transformer_lm on CPU
# for a few minutes, print its test perplexity beside the unigram baseline, then 3 samples from it.
#
#   bash examples/language_model/wikitext.sh [CORPUS_DIR]
#
# CORPUS_DIR holds wiki.{train,valid,test}.tokens (WikiText layout). Default: the shared
# ../shared/data/wikitext-2-mini; with no such folder and a network, WikiText-103 is downloaded.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup_env.sh

CORPUS=${1:-../shared/data/wikitext-2-mini}
if [ ! -f "$CORPUS/wiki.train.tokens" ]; then
  echo "| no corpus at $CORPUS: downloading WikiText-103"
  mkdir -p corpora && CORPUS=corpora/wikitext-103
  if [ ! -f "$CORPUS/wiki.train.tokens" ]; then
    python3 -c "import urllib.request; urllib.request.urlretrieve('https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip', 'corpora/wikitext-103-v1.zip')"
    (cd corpora && python3 -m zipfile -e wikitext-103-v1.zip .)
  fi
fi
NAME=$(basename "$CORPUS")
DATA=data-bin/$NAME
SAVE=checkpoints/$NAME
rm -rf "$SAVE"  # a fresh run each time; resuming is toolkit-train's default otherwise

toolkit-preprocess --only-source --trainpref "$CORPUS/wiki.train.tokens" \
  --validpref "$CORPUS/wiki.valid.tokens" --testpref "$CORPUS/wiki.test.tokens" \
  --destdir "$DATA" --workers 2 --overwrite

toolkit-train "$DATA" --task language_modeling --arch transformer_lm \
  --decoder-layers 2 --decoder-embed-dim 128 --decoder-ffn-embed-dim 512 --decoder-attention-heads 4 \
  --decoder-input-dim 128 --decoder-output-dim 128 --decoder-normalize-before \
  --share-decoder-input-output-embed --dropout 0.2 \
  --tokens-per-sample 128 --batch-size 16 --optimizer adam --adam-betas "(0.9, 0.98)" \
  --lr 0.002 --lr-scheduler inverse_sqrt --warmup-updates 100 --warmup-init-lr 1e-07 --clip-norm 1.0 \
  --max-update ${MAX_UPDATE:-600} --log-format simple --log-interval 100 \
  --save-dir "$SAVE" --no-epoch-checkpoints --validate-interval-updates 200 --save-interval-updates 200 \
  --tensorboard-logdir "runs/$NAME" --cpu

toolkit-eval-lm "$DATA" --path "$SAVE/checkpoint_best.pt" --gen-subset test \
  --tokens-per-sample 128 --context-window 64 --batch-size 16 --cpu  # 64 scored after 64 of context
python3 examples/language_model/unigram_ppl.py "$DATA" test

echo "| 3 samples from the trained model (toolkit-interactive: prompt, then top-10 sampling):"
printf 'The\nIn the\nHe was\n' | toolkit-interactive "$DATA" --path "$SAVE/checkpoint_best.pt" \
  --sampling --sampling-topk 10 --beam 1 --max-len-b 40 --seed 1 --cpu | grep '^D-' | cut -f1,3
