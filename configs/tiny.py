"""Embedded default: a tiny Qwen2.5-architecture model on built-in arithmetic word problems.

Real Qwen2.5 vocabulary (151,936 embedding rows, offline tokenizer), random initialization,
no files needed; sized so stage 1 + stage 2 + evaluation run in minutes on 2 CPU cores.
"""

import ml_collections


def get_config(stage: str = "ar") -> ml_collections.ConfigDict:
    """Run config for ``stage`` "ar" (stage 1) or "mars" (stage 2: ``--config=configs/tiny.py:mars``).

    Every key can be overridden with --config.<key>=<value>.
    """
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.init_from = ""  # "" (random init), a HF checkpoint dir, or another run's workdir
    c.tokenizer_path = ""  # "" = offline Qwen2.5 tokenizer; else a checkpoint dir

    c.model = ml_collections.ConfigDict(
        dict(
            vocab_size=151936,
            hidden_size=64,
            intermediate_size=192,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            dtype="float32",
            param_dtype="float32",
        )
    )

    c.data = ml_collections.ConfigDict(
        dict(
            source="synthetic",  # synthetic | gsm8k | messages
            train_path="",
            eval_path="",  # jsonl/parquet files for gsm8k | messages
            num_synthetic_train=4000,
            num_synthetic_eval=64,
            max_length=128,
            all_assistant_turns=False,
        )
    )

    c.objective = ml_collections.ConfigDict(
        dict(
            name=stage,  # ar (stage 1) | mars (stage 2)
            block_size=4,
            ar_weight=1.0,
            normalization="sequence",
            max_label_tokens=64,
        )
    )

    c.train = ml_collections.ConfigDict(
        dict(
            batch_size=16,
            grad_accum_steps=1,
            num_epochs=1.0,
            num_steps=0,  # num_steps > 0 wins
            learning_rate=3e-3,
            warmup_ratio=0.03,
            weight_decay=0.0,
            grad_clip=1.0,
            log_every=10,
            save_every=100,
            max_to_keep=2,
        )
    )

    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))

    c.eval = ml_collections.ConfigDict(
        dict(
            num_examples=64,
            batch_size=32,
            thresholds=(1.0, 0.95, 0.9, 0.8, 0.7),
            block_size=4,
            max_new_tokens=64,
            temperature=0.0,
            nll_examples=64,
        )
    )
    return c
