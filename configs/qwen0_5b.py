"""Qwen2.5-0.5B-Instruct with the paper's recipe (arXiv 2604.07023, Sec. 4).

Set ``init_from`` to a Hugging Face Qwen2.5-0.5B-Instruct directory for stage 1 and to the
stage-1 workdir for stage 2, and ``data.train_path`` to a chat set in the ``messages`` format.
"""

from configs import tiny


def get_config(stage: str = "ar"):
    """lr 5e-6, effective batch 384, max length 512, warmup 3%, 5 epochs, block size 8."""
    c = tiny.get_config(stage)
    # Placeholders to override (a missing directory or file is an error, never a random init):
    c.init_from = "/path/to/Qwen2.5-0.5B-Instruct"  # stage 2: the stage-1 workdir
    c.data.train_path = "/path/to/sft.jsonl"
    # The architecture of Qwen2.5-0.5B (used as is without a checkpoint, e.g. by
    # launch/memory_plan.py; init_from's config.json wins where it is set).
    c.model.update(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    # TPU settings, from libtpu's estimate of the step (docs/training-at-scale.md): the splash
    # kernel (MARS 1.4x dense attention's speed on v5e), each layer recomputed in the backward
    # pass (as fast as keeping its activations there, and only that fits 16 rows a v5e chip).
    # On GPUs: --config.model.attention=cudnn (or xla).
    c.model.attention = "splash"
    c.model.remat = "full"
    c.data.source = "messages"
    c.data.max_length = 512
    # Rows packed into sequences of 512 (mars_jax/packing.py): chat rows of a few hundred tokens
    # would leave most of each row padding (GSM8K train in Qwen2.5's tokens: 58% padding
    # unpacked, 7% packed; docs/configs.md). train.batch_size then counts packed sequences:
    # 192 of them hold about the paper's 384 rows where rows average ~2 a sequence (GSM8K train:
    # 2.2; training logs the figure of its data: "packing: N rows in M sequences").
    c.data.packing = True
    c.data.eval_path = "../shared/data/gsm8k/test.jsonl"
    c.data.eval_format = "gsm8k"
    c.objective.block_size = 8
    c.objective.max_label_tokens = 512
    c.objective.ce_chunk_size = 64
    c.train.update(
        batch_size=192,  # packed sequences: ~384 rows (see data.packing above)
        grad_accum_steps=1,
        num_epochs=5.0,
        num_steps=0,
        learning_rate=5e-6,
        warmup_ratio=0.03,
        weight_decay=0.0,
        grad_clip=1.0,
        log_every=10,
        save_every=200,
        max_to_keep=3,
    )
    # save_every bounds the work lost to a crash (SIGTERM / Ctrl-C save the step reached): a
    # step is at most 384 x 512 tokens, 6 x 0.49e9 x 196,608 = 5.8e14 FLOPs for AR and about 2x
    # for MARS (docs/training-at-scale.md: step time ratio 1.8-2.0), i.e. ~1-2 s at 40% of a v5e-8's peak (an
    # estimate, not a measurement): 200 steps are ~3-7 minutes. A save is ~6 GB (fp32
    # parameters + two Adam moments), written asynchronously.
    c.mesh.update(data=-1, fsdp=1, tensor=1)
    c.eval.update(num_examples=1319, batch_size=64, max_new_tokens=512, nll_examples=256)
    return c
