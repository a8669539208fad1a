"""benchmarks/roofline.py: the parameter counts it derives from the config shapes equal those of
the model code (`abstract_model`, shapes only), and a memory-bound step costs one AR step."""

import importlib.util
import math
import sys
from pathlib import Path

import jax
import pytest
from flax import nnx

from mars_jax.model import abstract_model

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("_roofline", ROOT / "benchmarks" / "roofline.py")
roofline = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # for its dataclasses
spec.loader.exec_module(roofline)


@pytest.mark.parametrize("name", list(roofline.MODELS))
def test_parameter_count_matches_the_model(name):
    cfg = roofline.model_config(name)
    _, params = nnx.split(abstract_model(cfg), nnx.Param)
    assert roofline.total_params(cfg) == sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def test_memory_bound_window_costs_one_ar_step():
    cfg, v5e = roofline.model_config("Qwen2.5-7B"), roofline.ACCELERATORS[0]
    assert roofline.relative(cfg, v5e, "sliding", 1, 8, 512) == 1.0
    assert roofline.relative(cfg, v5e, "sliding", 64, 8, 512) > 1.1
    assert 0 < roofline.ridge_batch(cfg, v5e, 8, 512, 0.1) < 64
