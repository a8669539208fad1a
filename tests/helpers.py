"""Helpers the tests of every wing share: configs/tiny.py's config with overrides
(`tiny_config`), `generate.complete` from a path (`complete`), a Python subprocess from the
repository root (`run_python`, `python_env`), tiny transformers checkpoints of each family
(`make_hf_model`, `save_hf`, `hf_logits`), the released MARS checkpoints' format
(`write_released`) and SmolLM2's tokenizer layout on a tiny model (`write_smol_layout`).
Fixtures live in the conftest.py files: tests/conftest.py for those several wings use, each
wing's own conftest.py for its own."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import tokenizers
import torch
from tokenizers import processors
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
)

from mars_jax.tokenizer import MASK_ID, MASK_TOKEN, _bpe_model, _byte_to_unicode, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def tiny_config(stage="ar", *layers, **overrides):
    """configs/tiny.py's ConfigDict for ``stage``, loaded by path as ``--config=configs/tiny.py``
    loads it, then overridden: each mapping in ``layers`` in turn, then ``overrides``. A key is a
    config path, "a.b" or, as a keyword, "a__b"; it must already exist in the config."""
    spec = importlib.util.spec_from_file_location("_tiny_config", ROOT / "configs" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config(stage)
    for layer in (*layers, overrides):
        for key, value in layer.items():
            *parents, leaf = key.replace("__", ".").split(".")
            node = cfg
            for p in parents:
                node = node[p]
            assert leaf in node, key
            node[leaf] = value
    return cfg


def config_file(name: str, stage: str):
    """``configs/<name>.py``'s config for ``stage``, loaded by path as ``--config`` loads it."""
    spec = importlib.util.spec_from_file_location(f"_{name}", ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(stage)


def complete(path, prompts, *, block_size=None, step=None, **kwargs):
    """`generate.complete` with the model at ``path`` (`sources.open` at ``block_size`` and
    ``step``); the keyword arguments that are not complete's are its `DecodeOptions` fields."""
    from mars_jax import generate, sources

    opened = sources.open(str(path), block_size=block_size, step=step)
    keep = ("system", "stream", "parse_control_tokens")
    options = opened.options(**{k: v for k, v in kwargs.items() if k not in keep})
    return generate.complete(
        opened, prompts, options, **{k: v for k, v in kwargs.items() if k in keep}
    )


def python_env(**variables):
    """This process's environment for a Python subprocess: jax on the CPU, libtpu not waiting
    for a metadata server, the repository first on PYTHONPATH; then ``variables`` (a value of
    None removes the variable)."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "TPU_SKIP_MDS_QUERY": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    for name, value in variables.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run_python(*args, check=True, env=None, timeout=600, **kwargs):
    """``python ARGS`` (``"-m", module``, ``"-c", code`` or a script and its flags) in the
    repository root with ``env`` (default: `python_env()`), its output captured as text. With
    ``check``, an exit status other than 0 fails the test with the command and the tails of
    its output. Returns the CompletedProcess; ``kwargs`` go to subprocess.run."""
    proc = subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=ROOT,
        env=python_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )
    if check:
        assert proc.returncode == 0, (
            f"python {' '.join(map(str, args))[:500]} exited {proc.returncode}\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


# Tiny Qwen2 shapes: GQA (4 query heads over 2 kv heads), non-default rope_theta.
TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=2500.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


# The other model families on TINY's shape: Qwen3 (no q/k/v biases, per-head q/k RMSNorm,
# head_dim not hidden_size / heads) and Llama 3 (no biases, llama3 RoPE scaling over a short
# original context, so that test positions reach the scaled band).
FAMILY_CONFIGS = {
    "qwen3": (Qwen3Config, dict(head_dim=12, attention_bias=False)),
    "llama": (
        LlamaConfig,
        dict(
            rope_theta=500.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
}


def make_hf_model(seed: int = 0, family: str = "qwen2", **overrides):
    """A random fp32 transformers causal LM of ``family`` (Qwen2ForCausalLM, or FAMILY_CONFIGS)
    on TINY's shape, with O(1)-sized logits.

    transformers initializes with std 0.02 and zero biases, which would make logits (and any
    comparison of them) nearly trivial; every parameter is perturbed so that biases, norm
    weights and the LM head all matter.
    """
    torch.manual_seed(seed)
    config_class, family_fields = FAMILY_CONFIGS.get(family, (Qwen2Config, {}))
    model = AutoModelForCausalLM.from_config(config_class(**{**TINY, **family_fields, **overrides}))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if "embed" in name or "lm_head" in name else 0.15
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


def save_hf(path, seed: int = 0, max_shard_size=None, **overrides):
    model = make_hf_model(seed, **overrides)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(path), **kwargs)
    return model


def hf_logits(model, ids, attention_mask=None, position_ids=None) -> np.ndarray:
    with torch.no_grad():
        out = model(
            input_ids=torch.as_tensor(np.asarray(ids), dtype=torch.long),
            attention_mask=None
            if attention_mask is None
            else torch.as_tensor(np.asarray(attention_mask), dtype=torch.long),
            position_ids=None
            if position_ids is None
            else torch.as_tensor(np.asarray(position_ids), dtype=torch.long),
        )
    return out.logits.float().numpy()


def write_released(path, *, mask: bool = True, block_size: int | None = None):
    """A tiny random untied Qwen2 (real special-token rows) saved in the format of the paper's
    released MARS checkpoints: save_pretrained, then config.json as the reference's wrapper
    writes it (model_type "a2d-qwen2", A2DQwen2LMHeadModel, an auto_map), and tokenizer files
    with <|mask|> added as a special token (``mask=False``: a plain Qwen2.5 tokenizer, without
    it); ``block_size`` is recorded as our exports do (mars_block_size). Returns the
    transformers model."""
    path = Path(path)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=151680,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=5000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.3)
    model.eval()
    model.save_pretrained(str(path))
    hf = json.loads((path / "config.json").read_text())
    hf.update(
        model_type="a2d-qwen2",
        architectures=["A2DQwen2LMHeadModel"],
        auto_map={
            "AutoConfig": "configuration_a2d.A2DQwen2Config",
            "AutoModelForCausalLM": "modeling_a2d.A2DQwen2LMHeadModel",
        },
    )
    if block_size is not None:
        hf["mars_block_size"] = block_size
    (path / "config.json").write_text(json.dumps(hf))
    load_tokenizer(None).save(str(path))
    if not mask:  # a plain Qwen2.5 tokenizer: no <|mask|> in its files
        tj = json.loads((path / "tokenizer.json").read_text())
        tj["added_tokens"] = [t for t in tj["added_tokens"] if t["content"] != MASK_TOKEN]
        (path / "tokenizer.json").write_text(json.dumps(tj))
        tc = json.loads((path / "tokenizer_config.json").read_text())
        tc["added_tokens_decoder"].pop(str(MASK_ID))
        tc.pop("mask_token")
        (path / "tokenizer_config.json").write_text(json.dumps(tc))
    return model


def write_smol_layout(path, smollm2_dir):
    """(path, transformers model): a tiny random untied Llama (49,152 rows, no <|mask|>) saved at
    ``path`` with SmolLM2-135M-Instruct's tokenizer files, its stop id 2."""
    torch.manual_seed(0)
    fields = {k: v for k, v in TINY.items() if k not in ("vocab_size", "tie_word_embeddings")}
    config = LlamaConfig(**fields, vocab_size=49152, tie_word_embeddings=False, eos_token_id=2)
    hf = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape) * 0.15)
    hf.eval().save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(smollm2_dir) / name, Path(path) / name)
    (Path(path) / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return Path(path), hf


# A Llama 3 style Hugging Face directory (tests/programs/test_lm_eval_hflm.py, test_serve.py).
LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
LLAMA3_TEMPLATE = (  # Llama 3's layout: the template writes the BOS itself
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Words the Llama 3 style BPE spells as one token: "hello wor" + "ld" then has a token across
# the join (" world"), as it has in Qwen2.5's vocabulary.
LLAMA3_WORDS = ["hello", " world", " wor", " apples", " Tom", " has"]


def write_llama3_style(path, max_position_embeddings: int = 40) -> int:
    """A tiny Llama 3 (llama3 RoPE) with a byte-level BPE whose tokenizer.json post-processor
    adds <|begin_of_text|>, named ``bos_token`` as Llama 3's tokenizer_config.json does.
    Returns the BOS id."""
    alphabet = _byte_to_unicode()
    vocab, merges = {c: b for b, c in alphabet.items()}, []
    for word in LLAMA3_WORDS:
        piece = "".join(alphabet[b] for b in word.encode())
        for i in range(2, len(piece) + 1):
            if piece[:i] not in vocab:
                merges.append((piece[: i - 1], piece[i - 1]))
                vocab[piece[:i]] = len(vocab)
    backend = _bpe_model(vocab, merges)
    backend.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIALS]
    )
    bos = backend.token_to_id("<|begin_of_text|>")
    backend.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "model_max_length": 131072,
        "chat_template": LLAMA3_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    model = make_hf_model(
        3,
        family="llama",
        vocab_size=backend.get_vocab_size(),
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bos,
        eos_token_id=bos + 1,
    )
    model.save_pretrained(str(path))
    return bos
