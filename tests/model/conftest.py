"""Fixtures of the model wing's tests."""

import pytest

from tests.helpers import save_hf


@pytest.fixture(scope="session", params=["qwen3", "llama"])
def family_ckpt(request, tmp_path_factory):
    """(family, directory, transformers model) of a tiny Qwen3 or Llama 3 checkpoint."""
    path = tmp_path_factory.mktemp(f"hf_{request.param}")
    return request.param, path, save_hf(path, seed=21, family=request.param)
