"""Embedded default: a tiny Qwen2.5-architecture model on built-in arithmetic word problems.

Real Qwen2.5 vocabulary (151,936 embedding rows, offline tokenizer), random initialization,
no files needed; sized so stage 1 + stage 2 + evaluation run in minutes on 2 CPU cores.
This file holds the full config schema; the other configs start from it.
"""

import ml_collections

from mars_jax.sharding import DEFAULT_RULES


def get_config(stage: str = "ar") -> ml_collections.ConfigDict:
    """Run config for ``stage`` "ar" (stage 1) or "mars" (stage 2: ``--config=configs/tiny.py:mars``).

    Every key can be overridden with --config.<key>=<value>; an unknown key is an error.
    """
    return ml_collections.ConfigDict({
        "seed": 0,
        # "" (random init), a Hugging Face checkpoint directory, or another run's workdir
        # (its latest checkpoint: stage 2 starts from stage 1).
        "init_from": "",
        # "" = the tokenizer of init_from if set, else the offline Qwen2.5 tokenizer.
        "tokenizer_path": "",
        # Used for random init only; init_from brings its own architecture (dtypes, remat and
        # attention always come from here).
        "model": {
            "vocab_size": 151936, "hidden_size": 64, "intermediate_size": 192,
            "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
            "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
            "dtype": "float32", "param_dtype": "float32",
            # Execution, also applied with init_from: rematerialisation policy (none | full |
            # dots), attention implementation (xla | chunked | splash on TPU | cudnn on GPU; see
            # mars_jax/attention.py), layers in a lax.scan (else unrolled).
            "remat": "none", "attention": "xla", "scan_layers": True,
        },
        "data": {
            "source": "synthetic",  # synthetic | gsm8k | messages
            "train_path": "",  # .jsonl / .json / .parquet (gsm8k, messages)
            "eval_path": "",
            "eval_format": "",  # row format of eval_path; "" = that of the training data
            "num_synthetic_train": 4000,
            "max_length": 128,  # a multiple of objective.block_size
            "all_assistant_turns": False,  # label every assistant turn, not only the last
            # JSON Lines training files: the largest fraction of non-blank lines that may hold no
            # row (invalid JSON or UTF-8, not an object); such lines are skipped, counted and
            # logged by file:line; past it the run stops. 0: any such line stops it.
            "max_bad_fraction": 0.01,
            # Rows longer than max_length: cut to it, keeping the labels that fit (True, the
            # reference's behaviour), or skipped and counted as too_long (False).
            "truncate": True,
            # Runs from scratch (or from a trimmed run): embedding rows only for the ids of the
            # training and evaluation data (+ control tokens), model.vocab_size ignored; the id
            # map is RUN/vocab_map.json (mars_jax/vocab.py). Such a run cannot be exported.
            "trim_vocab": False,
        },
        "objective": {
            "name": stage,  # ar (stage 1) | mars (stage 2)
            "block_size": 4,
            "ar_weight": 1.0,
            # none | inverse_t: each sequence's noisy CE times 1 / (t + 1e-6), t ~ U(1e-3, 1)
            # (the reference's trainer for the "w/o SFT loss" ablation, with ar_weight 0).
            "noisy_weighting": "none",
            "normalization": "sequence",  # sequence | token
            "max_label_tokens": 0,  # 0: the most labelled tokens of any example
            # Cross-entropy over this many positions at a time (0: all at once); bounds the
            # [rows, positions, vocabulary] logits that exist at once.
            "ce_chunk_size": 0,
        },
        "train": {
            "batch_size": 16,  # rows per optimizer step (split into grad_accum_steps)
            "grad_accum_steps": 1,
            "num_epochs": 1.0,
            "num_steps": 110,  # > 0 overrides num_epochs
            "learning_rate": 3e-3,
            "warmup_ratio": 0.03,
            "weight_decay": 0.0,
            "grad_clip": 1.0,
            "log_every": 10,
            # A checkpoint every 25 steps (~30 s of CPU steps here) bounds the work a crash
            # loses; SIGTERM / Ctrl-C save the step reached anyway (mars_jax/train.py).
            "save_every": 25,
            # Checkpoints kept: the newest max_to_keep, plus every step divisible by keep_every
            # (0: none), kept for good.
            "max_to_keep": 2,
            "keep_every": 0,
            # On resume, a checkpoint whose files fail their checksums (sha256.json) is an error
            # naming the step and file; True: warn, move it to corrupt_checkpoints/ and resume
            # from the previous checkpoint instead.
            "restore_fallback": False,
            # A step with a non-finite loss or gradient norm is skipped (no update) and logged
            # with its data rows; this many skips in a row stop the run (0: never). A skip
            # leaves the state as it was and the next step reads the next batch, so 10
            # non-finite batches in a row point at the state or the settings (learning rate,
            # overflow) rather than at a few bad rows, and cost only 10 steps.
            "max_consecutive_skips": 10,
        },
        # Device mesh axes (-1: the remaining devices) and the logical-axis sharding rules:
        # logical name -> mesh axes, e.g. --config.mesh.rules.embed="('data','fsdp')".
        "mesh": {"data": -1, "fsdp": 1, "tensor": 1, "rules": dict(DEFAULT_RULES)},
        # Multi-process runs (one process per host): all three set, or none. Unset (the
        # defaults), a Slurm, Open MPI, Cloud TPU pod or Kubernetes launch of several processes
        # is detected from the environment; otherwise the run is one process. coordinator_address
        # is "host:port" of process 0, process_id this process's index in [0, num_processes).
        "distributed": {"coordinator_address": "", "num_processes": 0, "process_id": -1},
        "eval": {
            "num_examples": 64,
            "batch_size": 32,
            "thresholds": (1.0, 0.95, 0.9, 0.8, 0.7),
            "block_size": 0,  # 0: the block size the run was trained with
            "max_new_tokens": 64,
            "temperature": 0.0,
            "cache_mode": "sliding",  # decode.CACHE_MODES: sliding | block | none
            "rule": "prob",  # decode.RULES: prob | entropy | margin | verify
            "nll_examples": 64,
            # Wall clock: each threshold's decode, and that of the AR baseline (block size 1,
            # threshold 1.0), is timed this many times after an untimed warm-up (compilation);
            # the fastest counts (mars_jax/evaluate.py).
            "timing_repeats": 3,
        },
    })
