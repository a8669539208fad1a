"""Real GSM8K (../shared/data): one epoch of stage 1 and one of stage 2 in about an hour on CPU.

Trimmed vocabulary (`data.trim_vocab`: the 15,104 ids of GSM8K train + test and the control
tokens, instead of 151,936 rows), 4 layers of width 128, batch 16 at max length 384 (98% of
the rows fit; the rest are cut and keep the start of their answer): 467 steps per epoch.

Measured with ``bash launch/two_stage.sh configs/gsm8k.py runs/gsm8k`` on 2 CPU cores
(2026-12-01): stage 1 17.8 min (about 2 s per AR step), stage 2 43.7 min (about 4.5 s per MARS
step; about 10 of its minutes at half speed beside another job), the two evaluations (128
questions, six thresholds, up to 256 new tokens) 8.3 min: 69.8 min in all. docs/results.md's
GSM8K tables come from that run.
"""

from configs import synthetic


def get_config(stage: str = "ar"):
    """Stage 1 ("ar") or stage 2 ("mars"): one epoch of the GSM8K train rows (question ->
    worked answer), evaluated on the first 128 GSM8K test questions; the model, trimming and
    evaluation thresholds of `configs/synthetic.py`."""
    c = synthetic.get_config(stage)
    c.data.source = "gsm8k"
    c.data.train_path = "../shared/data/gsm8k/train.jsonl"
    c.data.eval_path = "../shared/data/gsm8k/test.jsonl"
    c.data.max_length = 384
    c.train.batch_size = 16
    c.train.num_steps = 0  # one epoch
    c.train.num_epochs = 1.0
    c.train.learning_rate = 2e-3  # both stages
    c.train.save_every = 50
    c.eval.max_new_tokens = 256
    return c
