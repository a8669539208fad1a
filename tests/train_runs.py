"""Shared helpers of the tests that run training (test_train, test_checkpoints): the tiny
config shrunk further, as a ConfigDict or as command-line flags."""

import jax
import numpy as np
from flax import nnx

from tests.helpers import ROOT, tiny_config  # noqa: F401 (ROOT: for test_train, test_checkpoints)

LR = 3e-3
# Tiny overrides, applied in-process and as --config.<key>=<value> on the command lines.
OVERRIDES = {
    "train.num_steps": 4,
    "train.batch_size": 4,
    "train.log_every": 1,
    "train.save_every": 2,
    "train.learning_rate": LR,
    "data.num_synthetic_train": 32,
    "model.num_layers": 1,
    "model.hidden_size": 32,
    "model.intermediate_size": 64,
    "model.head_dim": 8,
    "eval.num_examples": 4,
    "eval.batch_size": 4,
    "eval.max_new_tokens": 8,
    "eval.thresholds": (1.0, 0.9),
    "eval.nll_examples": 4,
}


def get_config(stage="ar", **extra):
    """configs/tiny.py's config for ``stage`` with OVERRIDES and ``extra`` ("a__b" = "a.b")."""
    return tiny_config(stage, OVERRIDES, **extra)


def cli_flags():
    """OVERRIDES as --config.<key>=<value> flags."""

    def fmt(v):
        return "(" + ",".join(map(str, v)) + ")" if isinstance(v, tuple) else str(v)

    return [f"--config.{k}={fmt(v)}" for k, v in OVERRIDES.items()]


def flat_params(model):
    """{path: numpy array} of the parameters of an NNX ``model``."""
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}
