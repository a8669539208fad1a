"""mars_jax.chat: a multi-turn session decodes each turn as `decode.generate` decodes the
rendered conversation, compiles once for the session, and runs through its stdin."""

import pytest

from mars_jax import chat, decode, sources
from tests.helpers import python_env, run_python, write_released


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "released"
    write_released(path, block_size=4)
    return path


def test_each_turn_decodes_the_conversation_so_far(model_dir):
    opened = sources.open(str(model_dir))
    options = opened.options(threshold=0.5, max_new_tokens=6)
    session = chat.Session(opened, options, width=96, system="Be brief.")
    compiles = 0  # the session's own (the oracle below compiles one per prompt width)
    users = ["What is 2 + 2?", "And 3 + 3, with the steps?", "Thanks"]
    for k, user in enumerate(users):
        pieces, before = [], decode._generate._cache_size()
        result = session.turn(user, pieces.append)
        compiles += decode._generate._cache_size() - before
        # The oracle: the rendered conversation (system, earlier turns, this one) decoded alone.
        history = session.turns[:-2]
        ids = opened.tokenizer.apply_chat_template(
            [
                {"role": "system", "content": "Be brief."},
                *history,
                {"role": "user", "content": user},
            ],
            add_generation_prompt=True,
            content_as_text=True,
        )
        want = decode.generate(
            opened.model,
            *decode.pad_prompts([ids], opened.pad_id),
            options,
            eos_ids=opened.stop_ids,
            mask_id=opened.mask_id,
        )
        assert "".join(pieces) == result["text"] == opened.tokenizer.decode(want.completions()[0])
        assert result["tokens_per_forward"] == pytest.approx(want.tokens_per_forward)
        assert len(session.turns) == 2 * (k + 1)
    assert compiles == 1  # one program for every turn


def test_a_long_conversation_drops_its_oldest_turns(model_dir):
    opened = sources.open(str(model_dir))
    session = chat.Session(opened, opened.options(max_new_tokens=2), width=60)
    for user in ["one two three four five six", "seven eight nine ten", "eleven twelve"]:
        result = session.turn(user)
    assert result["dropped"] >= 1
    ids, dropped = session.prompt_ids("thirteen")
    assert len(ids) <= 60


def test_the_command_reads_turns_from_stdin(model_dir):
    proc = run_python(
        "-m",
        "mars_jax.chat",
        f"--workdir={model_dir}",
        "--threshold=0.5",
        "--max_new_tokens=5",
        "--max_prompt_len=96",
        input="What is 2 + 2?\n/reset\nWhat is 2 + 2?\n/quit\nnever read\n",
        env=python_env(JAX_PLATFORMS="cpu"),
    )
    out = proc.stdout.splitlines()
    status = [line for line in out if line.startswith("[threshold 0.5 · block size 4 · ")]
    assert len(status) == 2 and "[a new conversation]" in out
    first, second = proc.stdout.split("[a new conversation]\n")
    answer = lambda part: part.split("\n[threshold")[0]
    assert answer(first) == answer(second) != ""  # the reset conversation answers as the first
    assert "tokens/forward" in status[0] and status[0].endswith("tokens/s]")
