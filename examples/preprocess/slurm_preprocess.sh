#!/bin/bash
# Binarize a large corpus on many machines: one dictionary, N parts as a Slurm array job, one merge.
#
#   bash examples/preprocess/slurm_preprocess.sh corpus/train.txt corpus/valid.txt data-bin/corpus 16
#
# 1. the dictionary (one job): toolkit-preprocess --dict-only counts the train file once;
# 2. N array tasks, each binarizing part $SLURM_ARRAY_TASK_ID of every split with that dict.txt
#    (--num-shards N --shard-id I: the I-th of N line-aligned byte ranges, as --workers cuts a file);
# 3. the merge (after all tasks succeed): the parts joined in order into DEST, whose bytes equal a
#    one-machine `toolkit-preprocess --trainpref TRAIN --validpref VALID --destdir DEST`.
# Inputs may be text, *.jsonl[.gz|.zst] or *.parquet; every job reads the same (shared) files.
set -euo pipefail

TRAIN=${1:?usage: slurm_preprocess.sh TRAIN VALID DEST [NUM_SHARDS]}
VALID=${2:?usage: slurm_preprocess.sh TRAIN VALID DEST [NUM_SHARDS]}
DEST=${3:?usage: slurm_preprocess.sh TRAIN VALID DEST [NUM_SHARDS]}
SHARDS=${4:-8}
WORK=${WORK:-$DEST.parts}
WORKERS=${WORKERS:-16}
mkdir -p logs "$WORK"

dict_job=$(sbatch --parsable --job-name=prep-dict --cpus-per-task="$WORKERS" --output=logs/%x-%j.out \
  --wrap "toolkit-preprocess --only-source --trainpref $TRAIN --dict-only --workers $WORKERS --destdir $WORK/dict")

parts_job=$(sbatch --parsable --job-name=prep-part --dependency=afterok:"$dict_job" --array=0-$((SHARDS - 1)) \
  --cpus-per-task="$WORKERS" --output=logs/%x-%A_%a.out \
  --wrap "toolkit-preprocess --only-source --trainpref $TRAIN --validpref $VALID --srcdict $WORK/dict/dict.txt \
          --num-shards $SHARDS --shard-id \$SLURM_ARRAY_TASK_ID --workers $WORKERS --no-progress-bar \
          --destdir $WORK/part-\$SLURM_ARRAY_TASK_ID")

sbatch --job-name=prep-merge --dependency=afterok:"$parts_job" --output=logs/%x-%j.out \
  --wrap "toolkit-preprocess --merge '$WORK/part-*' --destdir $DEST && rm -rf $WORK"
echo "submitted: dictionary $dict_job, parts $parts_job (array of $SHARDS), then the merge into $DEST"
