"""Parts the model families are assembled from; ``attention``: one attention, its variants over one core call."""
