"""torch.hub entry points.

lm = torch.hub.load("path/to/toolkit", "transformer_lm", source="local",
                    model_dir="checkpoints",  # model.pt, else checkpoint_best.pt
                    data_name_or_path="../data-bin/wikitext-103")
lm.score("The quick brown fox")["perplexity"]
"""

dependencies = ["torch", "numpy"]


def transformer_lm(model_dir: str, checkpoint_file: str = None, data_name_or_path: str = ".", device=None, **kwargs):
    """A trained transformer_lm with encode/decode/score/sample; ``checkpoint_file`` defaults to the folder's
    model.pt (else checkpoint_best.pt); fairseq's ``tokenizer=``/``bpe=`` keywords are taken."""
    from toolkit.inference.hub_utils import from_pretrained

    return from_pretrained(model_dir, checkpoint_file, data_name_or_path, device=device, **kwargs)
