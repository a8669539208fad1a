"""Qwen2.5-7B-Instruct with the paper's recipe (arXiv 2604.07023, Sec. 4); parameters and
optimizer state sharded over the ``fsdp`` mesh axis."""

from configs import qwen0_5b


def get_config(stage: str = "ar"):
    """As `configs/qwen0_5b.py`, with an fsdp mesh and gradient accumulation."""
    c = qwen0_5b.get_config(stage)
    c.init_from = "/path/to/Qwen2.5-7B-Instruct"  # stage 2: the stage-1 workdir
    # The architecture of Qwen2.5-7B (see configs/qwen0_5b.py).
    c.model.update(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    c.train.grad_accum_steps = 2  # micro-batches of 96 packed sequences
    # A step is ~15x qwen0_5b's (7.6e9 parameters): 9e15 FLOPs for AR, ~1.8e16 for MARS, i.e.
    # ~3 s on a v5p-64 and ~14 s on a v5e-16 at 40% of peak (estimates): 50 steps bound the work
    # a crash loses to ~3-12 minutes. A save is ~91 GB (fp32 parameters + Adam moments), about
    # 1.5 minutes at 1 GB/s to shared storage, written asynchronously while training goes on.
    c.train.save_every = 50
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    return c
