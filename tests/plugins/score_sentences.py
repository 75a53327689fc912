"""A fairseq-style scoring script with the import renamed (fairseq -> toolkit): each line's summed log-probability.

python tests/plugins/score_sentences.py --path CKPT --data DATA-BIN [--user-dir PLUGIN] "the cat sat" ...
"""

import argparse

import torch

from toolkit import checkpoint_utils, utils


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--user-dir", default=None)
    parser.add_argument("sentences", nargs="+")
    args = parser.parse_args()
    utils.import_user_module(args)

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([args.path], arg_overrides={"data": args.data})
    model = models[0].eval()
    eos = task.source_dictionary.eos()
    for line in args.sentences:
        tokens = task.source_dictionary.encode_line(line, add_if_not_exist=False).long()
        src_tokens = torch.cat([tokens.new_tensor([eos]), tokens[:-1]]).unsqueeze(0)
        with torch.no_grad():
            lprobs = model.get_normalized_probs(model(src_tokens), log_probs=True)
        scores = lprobs[0].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        print(f"{line}\t{utils.item(scores.sum()):.6f}\t{cfg.model._name}")


if __name__ == "__main__":
    main()
