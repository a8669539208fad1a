"""The built-in arithmetic word problems with a model that learns them in CPU minutes.

Trimmed vocabulary (`data.trim_vocab`: 128 embedding rows instead of 151,936), 4 layers of
width 128, batch 32. Stage 1: 1,000 AR steps at lr 2e-3; stage 2: 300 MARS steps (B = 4) at
5e-4. The CPU claims tables of docs/results.md come from this config through
`experiments/claims_config.py` (experiments synthetic and synthetic_stage2_lr).

Times on 2 CPU cores with nothing else running (2026-12-01, synthetic_stage2_lr): 0.81 s per
AR step and 1.87 s per MARS step, so ``bash launch/two_stage.sh configs/synthetic.py RUN`` takes
about 13.5 min for stage 1 and 9.4 min for stage 2 (measured: 560 s for the 300 steps), plus
about half a minute per evaluation (128 problems, six thresholds). One-token accuracy after
stage 1: 0.344; after stage 2 0.328, with 2.56 tokens per forward at threshold 0.9.
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
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
    )
    c.train.batch_size = 32
    # Stage 2 continues stage 1 at a quarter of its learning rate: re-warmed to stage 1's peak,
    # 100 steps lost one-token accuracy, the AR control's too (experiments/results/synthetic.md).
    c.train.num_steps = 1000 if stage == "ar" else 300
    c.train.learning_rate = 2e-3 if stage == "ar" else 5e-4
    c.train.save_every = 100
    c.eval.num_examples = 128
    c.eval.batch_size = 64
    c.eval.max_new_tokens = 96
    c.eval.thresholds = (1.0, 0.95, 0.9, 0.8, 0.7, 0.5)
    return c
