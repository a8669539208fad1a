"""SmolLM2-135M-Instruct on GSM8K train, trained in segments and evaluated along the way: the
learning curve of MARS (``:mars``) and of its AR control (``:ar``), both from the instruct
model's weights on the same rows in the same order (experiments/smollm2_curve.py; results in
docs/results.md).

As configs/smollm2_gsm8k.py (``<|mask|>`` added as row 49,152, the vocabulary not trimmed),
with: rows packed four sequences of 256 tokens a step (``data.packing``: 4.18 rows a step on
average; 256 rather than 512 because a MARS step over 2 x 512 positions costs more per
labelled token on this CPU, docs/configs.md#packing), a learning rate held after a short
warmup (``train.schedule="constant"``: the points are not artefacts of a decay to 0), every
step logged (the curve counts the rows seen from ``metrics.jsonl``), and an evaluation of 32
GSM8K test questions (the same 32 at every point) at 1.0 / 0.95 / 0.9 / 0.8 for MARS, 1.0 for
the control, untimed (``eval.timing_repeats=0``: each threshold decoded once; the wall clock is
measured apart, with benchmarks/decode_speed.py).

``:self`` is ``:mars`` trained on the untuned model's own answers to the GSM8K train questions
(self-distillation: ``python -m mars_jax.distill``, docs/results.md), written to
``runs/distill/smollm2_gsm8k_train.jsonl`` as chat rows; evaluated as ``:mars`` is, on the
GSM8K test questions and their reference answers.
"""

from configs import smollm2_gsm8k

SELF_DISTILLED = "runs/distill/smollm2_gsm8k_train.jsonl"


def get_config(stage: str = "mars"):
    """``mars`` (block size 4), ``ar`` (the control) or ``self`` (MARS on the model's own
    answers), from models/smollm2."""
    if stage not in ("mars", "ar", "self"):
        raise ValueError(f"stage {stage!r}: expected mars, ar or self")
    c = smollm2_gsm8k.get_config("mars" if stage == "self" else stage)
    if stage == "self":
        c.data.source, c.data.train_path = "messages", SELF_DISTILLED
        c.data.eval_format = "gsm8k"
    c.data.max_length = 256
    c.data.packing = True
    c.train.batch_size = 4  # packed sequences
    c.train.num_steps = 1000
    c.train.learning_rate = 3e-4
    c.train.schedule = "constant"
    c.train.warmup_ratio = 0.02
    c.train.log_every = 1
    c.train.save_every = 50
    c.eval.num_examples = 32
    c.eval.batch_size = 32
    c.eval.nll_examples = 32
    c.eval.timing_repeats = 0  # untimed: each threshold decoded once (the wall clock: item 4)
    return c
