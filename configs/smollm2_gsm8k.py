"""SmolLM2-135M-Instruct, a real instruction-tuned model, fine-tuned on GSM8K train: MARS
(``:mars``) and its AR control (``:ar``), both from the untuned model's weights for the same
80 steps, sized to fit a 2-core CPU in about two hours in all (launch/smollm2_gsm8k.sh;
results in docs/results.md).

``init_from`` is ``models/smollm2``, the directory ``python -m tools.smollm2
--link=models/smollm2`` makes. SmolLM2's 49,152 ids fill its embedding, so ``add_mask_token``
adds ``<|mask|>`` as row 49,152 (49,280 rows in all), in both runs: the control has the same
model and decodes at block size 1, where the row is never read. The vocabulary is not trimmed:
the untuned model, the control and MARS then decode over the same 49,152 ids.

Sizing, measured on this 2-core CPU: at batch 8 and max length 320 (92% of GSM8K's train
rows fit whole in SmolLM2's tokens, 76% in 256) a MARS step ([noisy | clean], 640 positions a
row) took about 100 s; at batch 4 and max length 256 (the longer rows cut, keeping the start
of their answer) about 21 s. The run of 2026-12-04 (docs/results.md): MARS 80 steps in 30.1
min, the AR control in 11.8 min, the evaluations (64 test questions, up to 256 new tokens,
batch 64) 8.4, 8.0 and 40.3 min (MARS: four thresholds); 99 min in all. 80 steps of 4 rows is
4% of an epoch: a first measurement on real weights, not the paper's recipe (5 epochs at
batch 384).
"""

from configs import gsm8k


def get_config(stage: str = "mars"):
    """``mars`` (block size 4, ar_weight 1) or ``ar`` (the control), from models/smollm2."""
    c = gsm8k.get_config(stage)
    c.init_from = "models/smollm2"
    c.add_mask_token = True
    c.data.trim_vocab = False
    c.data.max_length = 256
    c.objective.block_size = 4
    c.train.batch_size = 4
    c.train.num_steps = 80
    c.train.num_epochs = 0.0
    c.train.learning_rate = 2e-5
    c.train.warmup_ratio = 0.1
    c.train.save_every = 20
    c.train.log_every = 5
    c.eval.num_examples = 64
    c.eval.batch_size = 64
    c.eval.max_new_tokens = 256
    c.eval.thresholds = (1.0, 0.95, 0.9, 0.8) if stage == "mars" else (1.0,)
    c.eval.nll_examples = 16
    c.eval.timing_repeats = 1
    c.eval.block_size = 0 if stage == "mars" else 1
    return c
