"""mars-jax: JAX/Flax MARS (Mask AutoRegression) fine-tuning for Qwen2.5."""
