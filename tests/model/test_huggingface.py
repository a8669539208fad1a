"""bfloat16 Hugging Face checkpoints (conftest's ``bf16_ckpt``, saved in several files): bf16 on
disk, and loaded in fp32 or bf16 they match transformers. The sharded load
(`huggingface.load_hf_sharded`) on 8 simulated devices is tests/multidevice/test_hf_load_8dev.py.
"""

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from mars_jax import huggingface
from tests.helpers import TINY, hf_logits
from tests.model.test_model import our_logits, right_padded_batch


def test_bf16_checkpoint_is_bf16_on_disk(bf16_ckpt):
    files = sorted(bf16_ckpt[0].glob("*.safetensors"))
    assert len(files) > 1 and (bf16_ckpt[0] / "model.safetensors.index.json").exists()
    dtypes = set()
    for file in files:
        with safe_open(str(file), framework="np") as f:
            dtypes |= {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes == {"BF16"}


def test_bf16_checkpoint_matches_transformers(bf16_ckpt):
    path, hf = bf16_ckpt
    # fp32 parameters hold the bf16 values exactly: the logits of transformers' own fp32 load
    # of the directory (not of ``hf.float()``, whose RoPE inverse frequencies were rounded to
    # bf16 by ``.to(torch.bfloat16)``).
    model = huggingface.load_hf(str(path), param_dtype="float32")
    assert model.embed_tokens.embedding[...].dtype == jnp.float32
    ids, valid = right_padded_batch(TINY["vocab_size"], [12, 8], 12, seed=5)
    fp32 = AutoModelForCausalLM.from_pretrained(str(path), dtype="float32").eval()
    ref = hf_logits(fp32, ids, attention_mask=valid.astype(np.int64))
    np.testing.assert_allclose(our_logits(model, ids, valid)[valid], ref[valid], rtol=0, atol=1e-4)
    # bf16 parameters: the very values on disk.
    bf16 = huggingface.load_hf(str(path), param_dtype="bfloat16")
    weights = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    emb = bf16.embed_tokens.embedding[...]
    assert emb.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(emb, np.float32), weights["model.embed_tokens.weight"])
    q = np.asarray(bf16.layers.self_attn.q_proj.kernel[...], np.float32)  # [layers, in, out]
    np.testing.assert_array_equal(q[2], weights["model.layers.2.self_attn.q_proj.weight"].T)
    head = np.asarray(bf16.lm_head.kernel[...], np.float32)
    np.testing.assert_array_equal(head, weights["lm_head.weight"].T)
