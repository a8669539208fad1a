"""Experiments of `experiments/claims.py`: ``--config=experiments/claims_config.py:<name>``.

synthetic      configs/synthetic.py (trimmed vocabulary, 4 x 128 model) on the built-in
               arithmetic problems: CPU minutes per run
synthetic_gpu  the same data with a 12 x 512 model (bf16 compute), 3x the steps and no extra
               seed (an accelerator)
synthetic_stage2_lr
               synthetic's stage 1 (run it first) continued at a quarter of its learning
               rate for 300 steps: only the AR control and MARS B = 4
smoke          two steps per run, for checking the script end to end
"""

import ml_collections

from configs import synthetic


def get_config(name: str = "synthetic") -> ml_collections.ConfigDict:
    """The experiment ``name`` (see the module docstring); raises ValueError for another."""
    run = synthetic.get_config("ar")
    exp = ml_collections.ConfigDict(
        {
            "name": name,
            "description": "",
            "run": run,
            "stage1_steps": run.train.num_steps,  # configs/synthetic.py: 1,000
            "stage2_steps": 100,
            "stage2_learning_rate": 0.0,  # peak learning rate of the runs after stage 1; 0: stage 1's
            "stage1_workdir": "",  # "": <workdir>/stage1; else an existing stage-1 run to start from
            "block_sizes": (4, 8, 16),
            "ar_weights": (1.0, 0.0),
            "extra_seeds": (1,),  # the first MARS run again with these seeds
            "thresholds": (1.0, 0.95, 0.9, 0.8, 0.7, 0.5),
            "headline_threshold": 0.9,
        }
    )
    if name == "synthetic":
        exp.description = "built-in arithmetic problems, 4 x 128 model, trimmed vocabulary"
    elif name == "synthetic_gpu":
        exp.description = "built-in arithmetic problems, 12 x 512 model, trimmed vocabulary"
        run.model.update(
            hidden_size=512,
            intermediate_size=1536,
            num_layers=12,
            num_heads=8,
            num_kv_heads=2,
            head_dim=64,
        )
        run.model.dtype = "bfloat16"  # parameters and optimizer state stay float32
        run.data.num_synthetic_train = 16000
        run.train.batch_size = 64
        run.train.learning_rate = 1e-3
        run.eval.num_examples = 256
        exp.stage1_steps, exp.stage2_steps = 1200, 600
        exp.extra_seeds = ()
    elif name == "synthetic_stage2_lr":
        exp.description = (
            "configs/synthetic.py's stage 1 continued at a quarter of its learning rate for 300 "
            "steps: the AR control and MARS B = 4"
        )
        exp.stage1_workdir = "runs/claims_synthetic/stage1"
        stage2 = synthetic.get_config("mars").train  # configs/synthetic.py's own stage 2
        exp.stage2_steps, exp.stage2_learning_rate = stage2.num_steps, stage2.learning_rate
        exp.block_sizes, exp.ar_weights, exp.extra_seeds = (4,), (1.0,), ()
    elif name == "smoke":
        exp.description = "two steps per run (checks the script, learns nothing)"
        run.model.update(hidden_size=32, intermediate_size=64, num_layers=1, head_dim=8)
        run.data.num_synthetic_train = 64
        run.train.batch_size = 8
        run.eval.num_examples = 4
        run.eval.nll_examples = 4
        run.eval.max_new_tokens = 8
        exp.stage1_steps, exp.stage2_steps = 2, 2
        exp.block_sizes = (4, 8)
    else:
        raise ValueError(
            f"unknown experiment {name!r}: synthetic | synthetic_stage2_lr | synthetic_gpu | smoke"
        )
    return exp
