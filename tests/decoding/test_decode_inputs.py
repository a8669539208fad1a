"""Inputs at the edges of `decode.generate`: empty prompts, a zero budget, a batch of 64 with
rows that end at very different times, and prompts holding <|mask|> and <|endoftext|>."""

import numpy as np
import pytest

from mars_jax import decode
from mars_jax.tokenizer import ENDOFTEXT_ID, IM_END_ID, MASK_ID
from tests.decode_oracles import (
    MAX_NEW,
    Uncached,
    make_batch,
    qwen_generate,
    reference_mars,
    swap_head_columns,
)

KW = dict(block_size=4, threshold=0.9)


def test_an_empty_prompt_is_refused_naming_its_row(mid):
    ids, _, _ = make_batch([3, 5, 4])
    with pytest.raises(ValueError, match=r"row 1 has 0 \(an empty prompt\)"):
        qwen_generate(mid, ids, np.array([3, 0, 4]), max_new_tokens=4, **KW)
    with pytest.raises(ValueError, match=r"row 2 has 6"):
        qwen_generate(mid, ids, np.array([3, 5, 6]), max_new_tokens=4, **KW)
    with pytest.raises(ValueError, match="no prompts"):
        qwen_generate(mid, ids[:0], np.zeros((0,), np.int32), max_new_tokens=4, **KW)


def test_a_zero_budget_gives_empty_completions_without_compiling(mid, monkeypatch):
    ids, lengths, _ = make_batch([3, 5])

    def never(*args, **kwargs):
        raise AssertionError("the decoder was compiled or run for max_new_tokens=0")

    monkeypatch.setattr(decode, "_generate", never)
    calls = []
    out = qwen_generate(mid, ids, lengths, max_new_tokens=0, on_accept=calls.append, **KW)
    assert out.tokens.shape == (2, 0) and out.tokens.dtype == np.int32
    assert out.completions() == [[], []]
    np.testing.assert_array_equal(out.lengths, 0)
    np.testing.assert_array_equal(out.accepted, 0)
    assert out.forwards == 0 and out.tokens_per_forward == 0.0 and calls == []
    # The other arguments are still checked.
    with pytest.raises(ValueError, match="threshold"):
        qwen_generate(mid, ids, lengths, block_size=4, threshold=1.5, max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        qwen_generate(mid, ids, lengths, max_new_tokens=-1, **KW)


def test_batch_of_64_early_eos_and_special_tokens_in_prompts(mid):
    ids, lengths, prompts = make_batch([6, 9] + [5, 8, 3, 7] * 15 + [4, 6], seed=11)
    # Row 1's prompt holds <|mask|> and <|endoftext|> as ordinary tokens.
    ids[1, 2], ids[1, 5], ids[1, 7] = MASK_ID, ENDOFTEXT_ID, MASK_ID
    prompts[1] = ids[1, : lengths[1]].tolist()
    fwd = Uncached(mid, ids.shape[1] + MAX_NEW + 4)
    ref = [reference_mars(fwd, p, max_new=MAX_NEW, **KW)[0] for p in prompts[:2]]
    # The model now emits <|im_end|> where it emitted row 0's first token: row 0 ends at once.
    first = ref[0][0]
    assert first not in ref[1] and IM_END_ID not in ref[1] and ENDOFTEXT_ID not in ref[1]
    model = swap_head_columns(mid, first, IM_END_ID)
    assert len(ref[1]) == MAX_NEW  # row 1 runs to the budget

    out = qwen_generate(model, ids, lengths, max_new_tokens=MAX_NEW, **KW)
    assert out.tokens.shape == (64, MAX_NEW)
    assert out.lengths[0] == 0 and out.accepted[0] == 1 and out.row_forwards[0] <= 1
    np.testing.assert_array_equal(out.tokens[0], ENDOFTEXT_ID)  # cut, the last stop id after
    # The late row: its uncached reference (the prompt's <|mask|> read as a token) and itself
    # decoded alone, whatever the other 63 rows do.
    assert out.completions()[1] == ref[1]
    alone = qwen_generate(model, ids[1:2, : lengths[1]], lengths[1:2], max_new_tokens=MAX_NEW, **KW)
    np.testing.assert_array_equal(out.tokens[1], alone.tokens[0])
    assert (out.accepted[1], out.row_forwards[1]) == (alone.accepted[0], alone.row_forwards[0])
    assert out.forwards >= alone.forwards


def test_a_prompt_longer_than_any_training_context_decodes(mid):
    # ModelConfig records no context limit and RoPE has none: a 700-token prompt (the tiny
    # model was never trained at all, let alone on 700 positions) decodes as the uncached
    # reference does, past the 512 positions of a small HF config.
    ids, lengths, prompts = make_batch([700, 3], seed=12)
    out = qwen_generate(mid, ids, lengths, max_new_tokens=MAX_NEW, **KW)
    fwd = Uncached(mid, ids.shape[1] + MAX_NEW + 4)
    assert out.completions()[0] == reference_mars(fwd, prompts[0], max_new=MAX_NEW, **KW)[0]
