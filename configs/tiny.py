"""Embedded default: a tiny Qwen2.5-architecture model on built-in arithmetic word problems.

Real Qwen2.5 vocabulary (151,936 embedding rows, offline tokenizer), random initialization,
no files needed; sized so stage 1 + stage 2 + evaluation run in minutes on 2 CPU cores.
This is `mars_jax.config.defaults`, the full config schema (one comment per key there); the
other configs start from it.
"""

import ml_collections

from mars_jax import config


def get_config(stage: str = "ar") -> ml_collections.ConfigDict:
    """Run config for ``stage`` "ar" (stage 1) or "mars" (stage 2: ``--config=configs/tiny.py:mars``).

    Every key can be overridden with --config.<key>=<value>; an unknown key is an error.
    """
    return config.defaults(stage)
