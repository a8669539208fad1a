"""The decoding wing's shared fixtures (its oracles and helpers: tests/decode_oracles.py)."""

import pytest

from tests.decode_oracles import make_model


@pytest.fixture(scope="session")
def mid():
    """A tiny model whose logits are scaled so that a threshold of 0.9 accepts some candidates
    and not others (`decode_oracles.make_model`), built once per worker."""
    return make_model(300.0)
