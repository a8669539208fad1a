"""Constants shared by several modules of mars_jax. A leaf: it imports nothing of mars_jax."""

IGNORE_INDEX = -100  # label of a token that is not trained on (the loss ignores it)
