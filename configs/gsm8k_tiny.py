"""The tiny model of `configs/tiny.py` trained and evaluated on real GSM8K (../shared/data)."""

from configs import tiny


def get_config(stage: str = "ar"):
    """GSM8K train rows (question -> worked answer), evaluated on GSM8K test questions."""
    c = tiny.get_config(stage)
    c.data.source = "gsm8k"
    c.data.train_path = "../shared/data/gsm8k/train.jsonl"
    c.data.eval_path = "../shared/data/gsm8k/test.jsonl"
    c.data.max_length = 320  # ~92% of rows fit; longer answers keep their first tokens
    c.train.batch_size = 8
    # 2,000 / 1,200 rows: a fraction of an epoch (a MARS step costs twice an AR step on CPU).
    c.train.num_steps = 250 if stage == "ar" else 150
    c.train.save_every = 50
    c.eval.max_new_tokens = 192
    return c
