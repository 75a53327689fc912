# fairseq's docs/tutorial_simple_lstm.rst, made the language model fairseq users write: the tutorial's
# incremental SimpleLSTMDecoder without the encoder, under FairseqLanguageModel. The class shapes,
# decorators, legacy add_args and the getattr-style architecture are the tutorial's; only the imports
# changed (fairseq -> toolkit).
import torch.nn as nn

from toolkit import utils
from toolkit.models import (
    FairseqIncrementalDecoder,
    FairseqLanguageModel,
    register_model,
    register_model_architecture,
)


class SimpleLSTMDecoder(FairseqIncrementalDecoder):
    def __init__(self, dictionary, embed_dim=128, hidden_dim=128, dropout=0.1):
        super().__init__(dictionary)
        self.embed_tokens = nn.Embedding(
            num_embeddings=len(dictionary),
            embedding_dim=embed_dim,
            padding_idx=dictionary.pad(),
        )
        self.dropout = nn.Dropout(p=dropout)
        self.lstm = nn.LSTM(
            input_size=embed_dim,
            hidden_size=hidden_dim,
            num_layers=1,
            bidirectional=False,
        )
        self.output_projection = nn.Linear(hidden_dim, len(dictionary))

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None):
        if incremental_state is not None:
            # The whole decoded prefix is given; the rest of the state is cached.
            prev_output_tokens = prev_output_tokens[:, -1:]

        x = self.embed_tokens(prev_output_tokens)
        x = self.dropout(x)

        # None at the first step: nn.LSTM starts from zeros, as the tutorial's first-time initialization.
        initial_state = utils.get_incremental_state(self, incremental_state, "prev_state")
        output, latest_state = self.lstm(x.transpose(0, 1), initial_state)
        utils.set_incremental_state(self, incremental_state, "prev_state", latest_state)

        x = output.transpose(0, 1)
        x = self.output_projection(x)
        return x, None

    def reorder_incremental_state(self, incremental_state, new_order):
        prev_state = utils.get_incremental_state(self, incremental_state, "prev_state")
        if prev_state is None:
            return
        reordered_state = (
            prev_state[0].index_select(1, new_order),  # hidden
            prev_state[1].index_select(1, new_order),  # cell
        )
        utils.set_incremental_state(self, incremental_state, "prev_state", reordered_state)


@register_model("simple_lstm_lm")
class SimpleLSTMLanguageModel(FairseqLanguageModel):
    @staticmethod
    def add_args(parser):
        parser.add_argument(
            "--decoder-embed-dim",
            type=int,
            metavar="N",
            help="dimensionality of the decoder embeddings",
        )
        parser.add_argument(
            "--decoder-hidden-dim",
            type=int,
            metavar="N",
            help="dimensionality of the decoder hidden state",
        )
        parser.add_argument(
            "--decoder-dropout",
            type=float,
            default=0.1,
            help="decoder dropout probability",
        )

    @classmethod
    def build_model(cls, args, task):
        decoder = SimpleLSTMDecoder(
            dictionary=task.target_dictionary,
            embed_dim=args.decoder_embed_dim,
            hidden_dim=args.decoder_hidden_dim,
            dropout=args.decoder_dropout,
        )
        return SimpleLSTMLanguageModel(decoder)


@register_model_architecture("simple_lstm_lm", "tutorial_simple_lstm_lm")
def tutorial_simple_lstm_lm(args):
    # getattr() keeps the values given on the command line; these are the defaults.
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 256)
    args.decoder_hidden_dim = getattr(args, "decoder_hidden_dim", 256)
