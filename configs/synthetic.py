"""The built-in arithmetic word problems with a model that learns them in CPU minutes.

Trimmed vocabulary (`data.trim_vocab`: 128 embedding rows instead of 151,936), 4 layers of
width 128. The README's synthetic claims table comes from this config through
`experiments/claims_config.py`; the times measured there are in that file.
"""

from configs import tiny


def get_config(stage: str = "ar"):
    """Stage 1 ("ar") or stage 2 ("mars") on 8,000 synthetic problems, evaluated on 128
    held-out ones."""
    c = tiny.get_config(stage)
    c.data.trim_vocab = True
    c.data.num_synthetic_train = 8000
    c.data.max_length = 160  # the longest rendered problem is 160 tokens with B = 16 padding
    c.model.update(
        hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=32,
    )
    c.train.batch_size = 32
    c.train.num_steps = 400
    c.train.learning_rate = 2e-3
    c.train.save_every = 100
    c.eval.num_examples = 128
    c.eval.batch_size = 64
    c.eval.max_new_tokens = 96
    c.eval.thresholds = (1.0, 0.95, 0.9, 0.8, 0.7, 0.5)
    return c
