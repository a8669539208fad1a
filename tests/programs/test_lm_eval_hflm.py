"""The lm_eval adapter (`mars_jax.lm_eval_adapter.MarsLM`) against lm_eval's own transformers
backend (``HFLM``: pretrained=the same directory, cpu, batch size 1, float32) on the same requests.

Two tiny Hugging Face directories: a Llama 3 style one (a byte-level BPE whose tokenizer.json
post-processor adds ``<|begin_of_text|>``, as Llama 3's does) and a Qwen2 style one (the Qwen2.5
tokenizer, which adds nothing); both models have a 40-position context, shorter than some
requests. Log-likelihoods, greedy flags, rolling log-likelihoods and generations must equal
HFLM's: the BOS the tokenizer adds, the default ``max_length`` read from the model config, the
context / continuation split. A continuation whose first token spans the join with its context
(``"hello wor"`` + ``"ld"``) has no token of its own: HFLM stops on an assertion, the adapter
refuses it naming the request.
"""

import numpy as np
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from mars_jax.lm_eval_adapter import MarsLM
from mars_jax.tokenizer import load_tokenizer
from tests.helpers import make_hf_model, write_llama3_style

CONTEXT = 40  # max_position_embeddings of both models
LONG = (
    "Tom has 3 apples and buys 4 more at the market on Sunday; then he gives two of them to "
    "his sister, who eats one, and he counts again. How many apples does Tom have now?"
)


def write_qwen2_style(path) -> None:
    """A tiny Qwen2 over the Qwen2.5 tokenizer (no BOS: its tokenizer.json has no
    post-processor and its tokenizer_config.json names no bos_token)."""
    model = make_hf_model(4, vocab_size=151680, max_position_embeddings=CONTEXT)
    model.save_pretrained(str(path))
    load_tokenizer(None).save(str(path))


@pytest.fixture(scope="module", params=["llama3", "qwen2"])
def family_dir(request, tmp_path_factory):
    """(style, directory, HFLM on it)."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llama3":
        bos = write_llama3_style(path, CONTEXT)
    else:
        write_qwen2_style(path)
    hflm = HFLM(pretrained=str(path), device="cpu", batch_size=1, dtype="float32")
    # The directories are what they claim: a BOS the tokenizer adds, or none.
    if request.param == "llama3":
        assert hflm.tok_encode("hello")[0] == bos == hflm.prefix_token_id
    else:
        assert hflm.tokenizer.bos_token is None
        assert hflm.tok_encode("hello") == hflm.tok_encode("hello", add_special_tokens=False)
    return request.param, str(path), hflm


@pytest.fixture(scope="module")
def ours(family_dir):
    return MarsLM.from_args(workdir=family_dir[1], block_size=1, batch_size=2, max_gen_toks=6)


def _instances(kind, args):
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def _greedy_continuation(hflm, context: str) -> str:
    """The text of the token HFLM's model ranks first after ``context`` (as HFLM encodes it)."""
    ids = hflm.tok_encode(context)
    with torch.no_grad():
        logits = hflm.model(input_ids=torch.tensor([ids])).logits[0, -1]
    return hflm.tokenizer.decode([int(logits.argmax())])


def test_max_length_is_the_model_configs_as_hflm_reads_it(family_dir, ours):
    _, path, hflm = family_dir
    assert ours.max_length == hflm.max_length == CONTEXT
    explicit = MarsLM.from_args(workdir=path, block_size=1, max_length=24)
    assert explicit.max_length == 24


def test_loglikelihood_equals_hflm(family_dir, ours):
    _, _, hflm = family_dir
    context = "Question: Tom has 3 apples."
    pairs = [
        (context, " How many?"),
        (context + " ", "Seven apples."),  # the trailing space moves to the continuation
        ("", "hello world"),  # empty context: HFLM's prefix token
        (context, _greedy_continuation(hflm, context)),
        (LONG, " Five apples."),  # longer than the model's context: cut on the left
    ]
    expected = hflm.loglikelihood(_instances("loglikelihood", pairs))
    got = ours.loglikelihood(_instances("loglikelihood", pairs))
    np.testing.assert_allclose([g[0] for g in got], [e[0] for e in expected], rtol=0, atol=1e-4)
    assert [g[1] for g in got] == [e[1] for e in expected]
    assert expected[3][1] and not expected[0][1]  # both greedy flags occur
    assert len(hflm.tok_encode(LONG)) > CONTEXT


def test_loglikelihood_rolling_equals_hflm(family_dir, ours):
    _, _, hflm = family_dir
    texts = [LONG + " " + LONG, "hello world"]
    assert len(hflm.tok_encode(texts[0])) > 2 * CONTEXT  # several windows
    expected = hflm.loglikelihood_rolling(
        _instances("loglikelihood_rolling", [(t,) for t in texts])
    )
    got = ours.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in texts]))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)


def test_generate_until_equals_hflm(family_dir, ours):
    _, _, hflm = family_dir
    history = [{"role": "user", "content": "Tom has 3 apples."}]
    chat = ours.apply_chat_template(history)  # Llama 3's starts with the BOS's text
    assert chat == hflm.apply_chat_template(history)
    requests = [
        ("Question: Tom has 3 apples.", {"until": ["\n\n"], "max_gen_toks": 6}),
        (LONG, {"until": ["never"], "max_gen_toks": 6}),  # cut to its last 40 - 6 tokens
        ("hello", {"until": ["never"], "max_gen_toks": 6}),
        (chat, {"until": ["never"], "max_gen_toks": 6}),  # no second BOS
    ]
    expected = hflm.generate_until(_instances("generate_until", requests))
    assert ours.generate_until(_instances("generate_until", requests)) == expected
    assert all(expected)  # each generated something


def test_add_bos_token_model_argument_as_hflm(family_dir):
    """``add_bos_token=False`` drops the BOS the tokenizer adds (HFLM: its tokenizer loaded with
    the flag, then ``add_special_tokens=False``); ``True`` keeps it, adds none where the
    tokenizer has no bos_token."""
    style, path, _ = family_dir
    flag = style != "llama3"  # False where it changes something, True where it may not
    hflm = HFLM(pretrained=path, device="cpu", batch_size=1, dtype="float32", add_bos_token=flag)
    ours = MarsLM.from_args(workdir=path, block_size=1, max_gen_toks=6, add_bos_token=flag)
    pairs = [("Question: Tom has 3 apples.", " How many?"), ("", "hello world")]
    expected = hflm.loglikelihood(_instances("loglikelihood", pairs))
    got = ours.loglikelihood(_instances("loglikelihood", pairs))
    np.testing.assert_allclose([g[0] for g in got], [e[0] for e in expected], rtol=0, atol=1e-4)
    rolling = _instances("loglikelihood_rolling", [(LONG,)])
    np.testing.assert_allclose(
        ours.loglikelihood_rolling(rolling), hflm.loglikelihood_rolling(rolling), atol=1e-4
    )
    generate = _instances("generate_until", [(LONG, {"until": ["never"], "max_gen_toks": 6})])
    assert ours.generate_until(generate) == hflm.generate_until(generate)


def test_a_continuation_without_a_token_of_its_own_is_refused(family_dir, ours):
    """``"hello wor"`` + ``"ld"``: the whole text's last token (" world") spans the join, so
    the continuation's ids (the whole's past the context's) are none. HFLM stops on an
    assertion; the adapter refuses it, naming the request (it used to score it 0.0, greedy:
    a multiple-choice answer that always won)."""
    _, _, hflm = family_dir
    pairs = [("Question: Tom has 3 apples.", " How many?"), ("hello wor", "ld")]
    ctx, cont = hflm._encode_pair(*pairs[1])
    assert cont == [] and ctx
    requests = [
        Instance("loglikelihood", {}, pairs[0], 0, metadata=("choices", 7, 1)),
        Instance("loglikelihood", {}, pairs[1], 1, metadata=("choices", 7, 1)),
    ]
    with pytest.raises(AssertionError):
        hflm.loglikelihood(requests)
    with pytest.raises(
        ValueError,
        match=r"^mars_jax: request 1 \(task choices, doc 7\): continuation 'ld' has no token of "
        r"its own after context 'hello wor'",
    ):
        ours.loglikelihood(requests)
    # A continuation longer than the model's context: HFLM's assertion again, refused here.
    too_long = _instances("loglikelihood", [("Question:", " " + LONG)])
    with pytest.raises(AssertionError):
        hflm.loglikelihood(too_long)
    with pytest.raises(ValueError, match=r"request 0: continuation of \d+ tokens, more than "):
        ours.loglikelihood(too_long)
