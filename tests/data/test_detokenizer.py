"""The incremental `Detokenizer` against the uncached reference: the whole token list decoded at
once (and, for stop strings, every prefix of it decoded again until one contains a stop string).

Checked on the offline Qwen2.5 tokenizer and on SmolLM2-135M-Instruct's (byte-level BPE both;
characters of several bytes split across tokens, a lone invalid byte, special tokens), with the
tokens fed one at a time, in random chunks and all at once."""

import random

import numpy as np
import pytest

from mars_jax.detokenizer import Detokenizer
from mars_jax.generate import TextStream
from mars_jax.tokenizer import load_tokenizer

TEXTS = [
    "Natalia sold 48 clips in April and half as many in May: 48 + 24 = 72.\n#### 72",
    "café 東京 🙂🙂 naïve — ü\n\n  spaces\ttabs",
    "The answer is 84. #### 84<|im_end|> trailing",
]


@pytest.fixture(scope="module")
def qwen():
    return load_tokenizer(None)


def _byte_token(tok, byte: int) -> int:
    """The id of the byte-level token of one raw byte (GPT-2's byte-to-unicode map)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    char = chr(byte) if byte in printable else chr(256 + others.index(byte))
    return tok.backend.token_to_id(char)


def _sequences(tok):
    """Token lists: the texts, a character split across tokens, a lone continuation byte, and
    random ids of the vocabulary (arbitrary bytes and special tokens among them)."""
    seqs = [tok.encode(t) for t in TEXTS]
    emoji = list("🙂".encode())
    seqs.append(tok.encode("a") + [_byte_token(tok, b) for b in emoji] + tok.encode(" b"))
    seqs.append(tok.encode("x") + [_byte_token(tok, 0x80)] + tok.encode(" y z"))
    rng = random.Random(0)
    seqs += [[rng.randrange(len(tok)) for _ in range(40)] for _ in range(20)]
    return seqs


def _feed(det, ids, how, rng):
    """The chunks ``det`` returns for ``ids`` fed one at a time, in random chunks or at once."""
    if how == "one":
        parts = [[i] for i in ids]
    elif how == "all":
        parts = [ids]
    else:
        cuts = sorted(rng.sample(range(1, len(ids)), min(5, len(ids) - 1))) if len(ids) > 1 else []
        parts = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
    chunks = [det.add(p) for p in parts]
    return chunks + [det.finish()]


@pytest.mark.parametrize("how", ["one", "chunks", "all"])
def test_the_chunks_add_up_to_the_whole_decode(qwen, how):
    rng = random.Random(1)
    for ids in _sequences(qwen):
        det = Detokenizer(qwen)
        chunks = _feed(det, ids, how, rng)
        assert "".join(chunks) == qwen.decode(ids) == det.text
        assert det.tokens == len(ids) and det.finish_reason is None
        # Before the end no chunk shows half a character (a replacement char comes only where
        # the bytes are invalid for good, which the whole decode shows too).
        assert all(c.count("\ufffd") <= qwen.decode(ids).count("\ufffd") for c in chunks)


def test_a_split_character_is_held_back_until_complete(qwen):
    emoji = [_byte_token(qwen, b) for b in "🙂".encode()]
    det = Detokenizer(qwen)
    assert det.add(qwen.encode("a")) == "a"
    assert [det.add([t]) for t in emoji] == ["", "", "", "🙂"]
    # A completion that ends inside a character: finish gives what the whole decode gives.
    det = Detokenizer(qwen)
    det.add(qwen.encode("a") + emoji[:2])
    assert det.text == "a" and det.finish() == qwen.decode(emoji[:2])


def _reference_stop(tok, ids, stops):
    """(text, tokens read) by decoding every prefix: the first prefix whose text holds a stop
    string ends the completion, cut before the leftmost match."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            return text[: min(found)], k
    return tok.decode(ids), len(ids)


@pytest.mark.parametrize("how", ["one", "chunks", "all"])
def test_stop_strings_cut_as_the_uncached_reference(qwen, how):
    rng = random.Random(2)
    cases = [
        (TEXTS[0], ["\n"]),
        (TEXTS[0], ["####", "72"]),
        (TEXTS[0], ["half as", "May"]),
        (TEXTS[0], ["+ 24 =", " 24"]),  # the shorter completes first
        (TEXTS[1], ["🙂"]),
        (TEXTS[1], ["ü\n"]),
        (TEXTS[2], ["#### 84<|im_end|>"]),
        (TEXTS[0], ["not there"]),
    ]
    for text, stops in cases:
        ids = qwen.encode(text) + qwen.encode(" and more text after it")
        want, read = _reference_stop(qwen, ids, stops)
        det = Detokenizer(qwen, stops)
        chunks = _feed(det, ids, how, rng)
        assert "".join(chunks) == det.text == want, (text, stops)
        assert det.tokens == read
        assert det.finish_reason == ("stop" if read < len(ids) else None)
        # What was shown is never taken back: no chunk holds a part of the match.
        assert all(s not in "".join(chunks) for s in stops)


def test_stop_ids_end_the_completion_and_are_not_shown(qwen):
    ids = qwen.encode("The answer is 84.")
    det = Detokenizer(qwen, stop_ids=[151645, 151643])
    shown = det.add(ids[:3]) + det.add(ids[3:] + [151645] + qwen.encode(" more"))
    assert shown + det.finish() == qwen.decode(ids)
    assert det.tokens == len(ids) and det.finish_reason == "stop"
    assert det.add(qwen.encode(" ignored")) == ""


def test_empty_stop_strings_are_refused(qwen):
    with pytest.raises(ValueError, match="non-empty"):
        Detokenizer(qwen, ["ok", ""])


def test_text_stream_writes_each_rows_chunks(qwen):
    """generate's on_accept callback: per-row chunks after each forward, EOS dropped, the
    held-back character flushed by finish; each row's chunks add up to its decode."""
    emoji = [_byte_token(qwen, b) for b in "🙂".encode()]
    rows = [qwen.encode("Hello there") + emoji[:2], qwen.encode("Yes.") + [151645, 11, 12]]
    written = [[], []]
    stream = TextStream(qwen, 2, [151645], lambda r, t: written[r].append(t))
    width = max(len(r) for r in rows)
    tokens = np.zeros((2, width), np.int32)
    for r, ids in enumerate(rows):
        tokens[r, : len(ids)] = ids
    for start in range(0, width, 2):  # two tokens per forward
        counts = np.array([max(0, min(2, len(r) - start)) for r in rows])
        stream(tokens[:, start : start + 2], counts)
    texts = stream.finish()
    assert texts == [qwen.decode(rows[0]), "Yes."]
    assert ["".join(w) for w in written] == texts
    assert all(w for w in written[0][:-1])  # no empty writes


@pytest.mark.real_model
def test_smollm2_tokenizer(smollm2_dir):
    tok = load_tokenizer(str(smollm2_dir))
    rng = random.Random(3)
    for ids in _sequences(tok):
        det = Detokenizer(tok, stop_ids=tok.eos_ids)
        chunks = _feed(det, ids, "chunks", rng)
        stop = next((i for i, t in enumerate(ids) if t in tok.eos_ids), len(ids))
        assert "".join(chunks) == tok.decode(ids[:stop])


def test_a_trimmed_runs_model_ids(qwen):
    """A trimmed run's `MappedTokenizer`: model ids, mapped to Qwen2.5's, read as its decode."""
    from mars_jax.vocab import MappedTokenizer, VocabMap

    text = TEXTS[1] + TEXTS[0]
    kept = sorted(set(qwen.encode(text)) | {151643, 151644, 151645, 151665})
    mapped = MappedTokenizer(qwen, VocabMap(kept))
    ids = mapped.encode(text)
    assert ids != qwen.encode(text)  # model ids differ from Qwen2.5's
    det = Detokenizer(mapped, ["####"], stop_ids=[mapped.eos_id])
    out = det.add(ids[:5]) + det.add(ids[5:]) + det.finish()
    assert out == mapped.decode(ids).split("####")[0]
