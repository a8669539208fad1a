"""Continuous batching (`mars_jax.engine`): every request's completion equals `decode.generate` of
its prompt alone with its settings, whatever else is in flight and whenever it was admitted
(staggered arrivals, more requests than slots, mixed thresholds, budgets, temperatures and
seeds), and a cancelled request frees its slot for the next one; a failed device call ends the
requests in flight with an error, and the engine recovers or gives up."""

import ast
import dataclasses
import pathlib
import threading
import time

import numpy as np
import pytest
from flax import nnx

from mars_jax import decode, engine
from mars_jax.decode_state import RowSettings
from mars_jax.errors import InputError
from mars_jax.model import CausalLM
from mars_jax.tokenizer import DEFAULT_EOS_IDS, IM_END_ID
from tests.decode_oracles import (
    CFG,
    Uncached,
    make_batch,
    make_model,
    qwen_engine,
    qwen_generate,
    reference_mars,
    swap_head_columns,
)

B, SLOTS, WIDTH, MAX_NEW = 4, 3, 12, 16


@pytest.fixture(scope="module")
def model():
    return make_model(300.0)


@pytest.fixture(scope="module")
def eng(model):
    return qwen_engine(
        model,
        slots=SLOTS,
        max_prompt_len=WIDTH,
        max_new_tokens=MAX_NEW,
        block_size=B,
        steps_per_call=3,
    )


def alone(model, request: engine.Request) -> list[int]:
    """The oracle: `decode.generate` of the request's prompt alone (padded to a fixed width),
    run to the engine's whole budget MAX_NEW and cut at the request's: a budget only stops a
    row, it never changes the tokens before it (each is accepted left to right, and a draw is
    keyed by its position), so one compile per setting serves every budget."""
    out = alone_output(model, request, max_new_tokens=MAX_NEW)
    return out.tokens[0, : out.lengths[0]].tolist()[: request.max_tokens]


def alone_output(model, request: engine.Request, max_new_tokens=None) -> decode.DecodeOutput:
    """`decode.generate` of the request alone, to ``max_new_tokens`` (None: the request's
    own budget), as a whole `decode.DecodeOutput` (its row_forwards too)."""
    n = len(request.prompt_ids)
    ids = np.zeros((1, max(n, WIDTH)), np.int32)
    ids[0, :n] = request.prompt_ids
    return qwen_generate(
        model,
        ids,
        np.asarray([n], np.int32),
        block_size=B,
        threshold=request.threshold,
        max_new_tokens=max_new_tokens or request.max_tokens,
        temperature=request.temperature,
        seed=request.seed,
        top_p=request.top_p,
    )


def answer_forwards(model, request: engine.Request, n: int) -> int:
    """The uncached reference's forwards up to the n-th token of the request's answer."""
    fwd = Uncached(model, WIDTH + MAX_NEW + B)
    *_, steps = reference_mars(
        fwd,
        list(request.prompt_ids),
        block_size=B,
        threshold=request.threshold,
        max_new=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
    )
    accepted = np.cumsum([len(step) for step in steps])
    return int(np.searchsorted(accepted, n) + 1) if n else 0


def requests(n, seed=0):
    lengths = np.random.default_rng(seed).integers(1, WIDTH + 1, size=n)
    _, _, prompts = make_batch(lengths.tolist(), seed=seed)
    rng = np.random.default_rng(seed + 1)
    return [
        engine.Request(
            tuple(p),
            max_tokens=int(rng.integers(1, MAX_NEW + 1)),
            threshold=float(rng.choice([1.0, 0.9, 0.5])),
            temperature=float(rng.choice([0.0, 0.0, 0.7])),
            seed=int(rng.integers(0, 2**32)),
        )
        for p in prompts
    ]


def test_staggered_requests_decode_as_alone(model, eng):
    """9 requests through 3 slots, submitted in three waves between engine turns."""
    reqs = requests(9)
    streams = []
    for wave in range(3):
        streams += [eng.submit(r) for r in reqs[3 * wave : 3 * wave + 3]]
        for _ in range(wave + 1):  # the earlier requests are mid-decode when the next arrive
            eng.run_once()
    while eng.run_once():
        pass
    for request, stream in zip(reqs, streams):
        tokens, last = stream.result(timeout=1)
        assert tokens == alone(model, request), request
        assert last.done and last.completion_tokens == len(tokens)
        # The answer's forwards, up to its last token: a row stops at its own budget inside a
        # 3-forward device call, and an EOS accepted in a later forward than the last token
        # (which the answer leaves out) does not count.
        assert last.forwards == answer_forwards(model, request, len(tokens)), request
        expected = "length" if len(tokens) == request.max_tokens else "stop"
        assert last.finish_reason == expected
        assert not set(tokens) & set(DEFAULT_EOS_IDS)
    assert eng.active == 0 and eng.waiting == 0


def test_an_answer_ended_by_its_eos_counts_no_forward_after_its_last_token(model):
    """At threshold 1.0 an answer of k tokens took k forwards, though the EOS that ended it took
    one more in the same device call (`generate` counts that one: it counts the EOS)."""
    request = engine.Request(tuple(range(5, 12)), max_tokens=MAX_NEW, threshold=1.0)
    tokens = alone(model, request)
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    ended = swap_head_columns(model, tokens[k], IM_END_ID)  # the EOS where tokens[k] was
    eng = qwen_engine(
        ended,
        slots=SLOTS,
        max_prompt_len=WIDTH,
        max_new_tokens=MAX_NEW,
        block_size=B,
        steps_per_call=4,
    )
    stream = eng.submit(request)
    while eng.run_once():
        pass
    got, last = stream.result(timeout=1)
    assert got == tokens[:k] and last.finish_reason == "stop"
    assert last.forwards == k == answer_forwards(ended, request, k)
    assert alone_output(ended, request).row_forwards[0] == k + 1


def test_streamed_updates_add_up_and_threads_work(model, eng):
    reqs = requests(4, seed=7)
    eng.start()
    try:
        streams = [eng.submit(r) for r in reqs]
        for request, stream in zip(reqs, streams):
            pieces = [u.tokens for u in stream.updates(timeout=120)]
            assert sum(pieces, []) == alone(model, request)
    finally:
        eng.stop()


def test_cancel_frees_the_slot(model):
    eng = qwen_engine(
        model, slots=1, max_prompt_len=WIDTH, max_new_tokens=MAX_NEW, block_size=B, steps_per_call=1
    )
    first, second = requests(2, seed=3)
    first = engine.Request(first.prompt_ids, MAX_NEW, threshold=1.0)
    s1, s2 = eng.submit(first), eng.submit(second)
    eng.run_once()
    s1.cancel()
    while eng.run_once():
        pass
    _, last = s1.result(timeout=1)
    assert last.finish_reason in ("cancelled", "stop")
    tokens, _ = s2.result(timeout=1)
    assert tokens == alone(model, second)


def test_a_finished_request_has_left_its_slot_when_its_client_hears_so(model):
    """What a client sees after its last update (the metrics' slots in use, a scrape right
    after) counts its slot free: the slot is released before the last update is handed over."""
    eng = qwen_engine(
        model, slots=2, max_prompt_len=WIDTH, max_new_tokens=MAX_NEW, block_size=B, steps_per_call=1
    )
    seen = []
    record = lambda update: update.done and seen.append((eng.active, eng.waiting))
    for request in requests(2, seed=5):
        eng.submit(request, on_update=record)
    while eng.run_once():
        pass
    assert seen == [(1, 0), (0, 0)]  # the first to finish sees the other's slot only


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(prompt_ids=()), "prompt"),
        (dict(prompt_ids=(1,) * (WIDTH + 1)), "prompt"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=MAX_NEW + 1), "max_tokens"),
        (dict(threshold=0.0), "threshold"),
        (dict(threshold=1.5), "threshold"),
        (dict(temperature=-1.0), "temperature"),
        (dict(seed=2**32), "seed"),
    ],
)
def test_bad_requests_are_refused_by_field(eng, change, field):
    request = engine.Request(**{**dict(prompt_ids=(1, 2), max_tokens=4), **change})
    with pytest.raises(InputError, match=f"^{field}: "):
        eng.submit(request)


def test_static_batching_waits_for_an_empty_batch(model):
    """refill=False (the load benchmark's static baseline): a waiting request is admitted only
    once every slot is free; the completions are the same."""
    eng = qwen_engine(
        model,
        slots=SLOTS,
        max_prompt_len=WIDTH,
        max_new_tokens=MAX_NEW,
        block_size=B,
        steps_per_call=1,
        refill=False,
    )
    reqs = requests(5, seed=11)
    streams = [eng.submit(r) for r in reqs]
    active = []
    while eng.run_once():
        active.append((eng.active, eng.waiting))
    for (a0, w0), (a1, _) in zip(active, active[1:]):
        assert not (w0 and a0 and a1 > a0), active  # no admission into a partly busy batch
    for request, stream in zip(reqs, streams):
        assert stream.result(timeout=1)[0] == alone(model, request)


def test_chunked_prefill_writes_the_one_forward_cache(model):
    """`Decoder.begin` + `prefill_chunk` over chunks of 5 leave the same keys/values in every
    prompt slot as `Decoder.prefill`'s one forward (the oracle), and the same cursors."""
    eng = qwen_engine(
        model, slots=1, max_prompt_len=WIDTH, max_new_tokens=MAX_NEW, block_size=B, prefill_chunk=5
    )
    request = engine.Request(tuple(range(3, 3 + WIDTH)), 4)  # every prompt slot used
    chunked = eng._begin([request])
    for start in range(0, WIDTH, 5):
        chunk = np.full((1, 5), 0, np.int32)
        piece = request.prompt_ids[start : start + 5]
        chunk[0, : len(piece)] = piece
        chunked = eng.decoder.prefill_chunk(eng.params, chunked, chunk, np.asarray([start]))
    ids = np.zeros((1, eng._width), np.int32)
    ids[0, :WIDTH] = request.prompt_ids
    row_settings = RowSettings.build(1, threshold=1.0, max_accept=B, max_new_tokens=MAX_NEW)
    one = eng.decoder.prefill(eng.params, ids, np.asarray([WIDTH]), row_settings)
    for name in ("k", "v"):
        np.testing.assert_allclose(
            np.asarray(chunked.cache[name])[:, :, :WIDTH],
            np.asarray(one.cache[name])[:, :, :WIDTH],
            rtol=1e-5,
            atol=1e-5,
        )
    assert int(chunked.cache_cursor[0]) == int(one.cache_cursor[0]) == WIDTH - 1


def test_a_long_prompt_is_prefilled_between_decode_steps(model):
    """Chunks of 4: a 12-token prompt arriving while another request decodes takes three turns
    to prefill, and the decoding request receives tokens in each of them; both completions
    equal their prompts decoded alone, as do the prompts of every length in chunks of 5."""
    eng = qwen_engine(
        model,
        slots=2,
        max_prompt_len=WIDTH,
        max_new_tokens=MAX_NEW,
        block_size=B,
        steps_per_call=1,
        prefill_chunk=4,
    )
    first = engine.Request(requests(1, seed=9)[0].prompt_ids, MAX_NEW, threshold=1.0)
    long = engine.Request(tuple(range(5, 5 + WIDTH)), 8, threshold=0.9)
    got = {"first": [], "long": []}
    eng.submit(first, on_update=lambda u: got["first"].append(u))
    eng.run_once()
    eng.submit(long, on_update=lambda u: got["long"].append(u))
    seen = []
    for _ in range(3):
        before = len(got["first"])
        eng.run_once()
        seen.append((eng.prefilling, eng.active, len(got["first"]) > before))
    # The long prompt is in prefill for two turns, and is decoding after the third chunk.
    assert seen == [(1, 1, True), (1, 1, True), (0, 2, True)], seen
    while eng.run_once():
        pass
    assert sum((u.tokens for u in got["first"]), []) == alone(model, first)
    assert sum((u.tokens for u in got["long"]), []) == alone(model, long)

    eng5 = qwen_engine(
        model, slots=3, max_prompt_len=WIDTH, max_new_tokens=MAX_NEW, block_size=B, prefill_chunk=5
    )
    reqs = requests(6, seed=13)
    streams = [eng5.submit(r) for r in reqs[:3]]
    eng5.run_once()
    streams += [eng5.submit(r) for r in reqs[3:]]
    while eng5.run_once():
        pass
    for request, stream in zip(reqs, streams):
        assert stream.result(timeout=1)[0] == alone(model, request), request


def test_a_trimmed_vocabulary_pads_with_its_own_id():
    """A model of 128 embedding rows (a trimmed run's): the engine pads prompts and empty rows
    with the tokenizer's pad id, never Qwen's 151643 (no row: the gather gave NaN keys, and
    every completion turned to garbage), and refuses ids outside the embedding by field."""
    small = CausalLM(dataclasses.replace(CFG, vocab_size=128), rngs=nnx.Rngs(3))
    small.norm.weight[...] = small.norm.weight[...] * 300.0
    kw = dict(slots=2, max_prompt_len=WIDTH, max_new_tokens=MAX_NEW, block_size=B, eos_ids=(1,))
    eng = qwen_engine(small, pad_id=0, mask_id=127, prefill_chunk=5, **kw)
    rng = np.random.default_rng(4)
    reqs = [
        engine.Request(tuple(rng.integers(2, 127, size=n).tolist()), MAX_NEW, threshold=t)
        for n, t in [(7, 0.9), (12, 1.0), (3, 0.5)]
    ]
    streams = [eng.submit(r) for r in reqs]
    while eng.run_once():
        pass
    for request, stream in zip(reqs, streams):
        out = qwen_generate(
            small,
            np.asarray([request.prompt_ids], np.int32),
            np.asarray([len(request.prompt_ids)], np.int32),
            block_size=B,
            threshold=request.threshold,
            max_new_tokens=MAX_NEW,
            eos_ids=(1,),
            mask_id=127,
        )
        assert stream.result(timeout=1)[0] == [t for t in out.completions()[0] if t != 1]
    with pytest.raises(InputError, match="^prompt: token id 151643 is not a row"):
        eng.submit(engine.Request((5, 151643), 4))
    with pytest.raises(InputError, match="^pad_id: 151643"):
        qwen_engine(small, pad_id=151643, mask_id=127, **kw)


def test_the_engine_leaves_jax_to_the_decoder():
    """engine.py keeps slot ids, queues and numpy host arrays; every device update is a
    `Decoder` method (insert, steps, read_new_tokens, free): it imports neither jax nor
    jax.numpy."""
    tree = ast.parse(pathlib.Path(engine.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "jax.numpy" not in imported
    assert not [m for m in imported if m == "jax" or m.startswith("jax.")], imported


class FaultyDecoder:
    """A `Decoder` whose ``steps`` raise while ``broken`` is set, after running (so the batch
    state it was given is donated and gone, as after a real failed device call)."""

    def __init__(self, decoder):
        self.decoder, self.broken, self.calls = decoder, threading.Event(), 0

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def steps(self, params, state, num_steps, rows=None):
        self.calls += 1
        out = self.decoder.steps(params, state, num_steps, rows)
        if self.broken.is_set():
            raise RuntimeError("INTERNAL: injected device fault")
        return out


class PoisonedPrefill:
    """A `Decoder` whose ``prefill_chunk`` raises for a chunk holding ``poison`` (an
    out-of-memory on one request's long prompt, say)."""

    def __init__(self, decoder, poison: int):
        self.decoder, self.poison = decoder, poison

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def prefill_chunk(self, params, state, chunk, start):
        if (np.asarray(chunk) == self.poison).any():
            raise RuntimeError("RESOURCE_EXHAUSTED: injected out of memory in a prefill")
        return self.decoder.prefill_chunk(params, state, chunk, start)


def test_a_failed_prefill_ends_its_own_request_only(model):
    """A request whose prefill raises ends with finish_reason "error" naming why, while the
    requests already decoding go on and finish as alone; the engine stays healthy."""
    eng = qwen_engine(
        model,
        slots=3,
        max_prompt_len=WIDTH,
        max_new_tokens=MAX_NEW,
        block_size=B,
        steps_per_call=1,
    )
    poison = 4242
    eng.decoder = PoisonedPrefill(eng.decoder, poison)
    live = [engine.Request((5, 6, 7, 8), MAX_NEW), engine.Request((9, 10, 11), MAX_NEW, 0.9)]
    streams = [eng.submit(r) for r in live]
    eng.run_once()  # admitted and prefilled
    eng.run_once()  # decoding
    assert all(eng._sent[slot] for slot in range(2))
    bad = eng.submit(engine.Request((1, poison, 3), MAX_NEW))
    while eng.run_once():
        pass
    tokens, last = bad.result(timeout=1)
    assert (tokens, last.finish_reason) == ([], "error")
    assert "injected out of memory" in last.error and "prefill" in last.error
    for request, stream in zip(live, streams):
        assert stream.result(timeout=1)[0] == alone(model, request)
    assert eng.healthy and eng.failures == 1 and not eng.dead.is_set()


def wait_until(condition, timeout=120.0):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def test_a_failed_device_call_ends_its_requests_and_the_engine_recovers(model):
    """The requests in flight when a device call raises end with finish_reason "error" naming
    it (none hangs); the engine is unhealthy, probes while the fault lasts, and once it is gone
    decodes again, each request as alone."""
    eng = qwen_engine(
        model,
        slots=2,
        max_prompt_len=WIDTH,
        max_new_tokens=MAX_NEW,
        block_size=B,
        steps_per_call=1,
        max_failures=1000,
    )
    faulty = eng.decoder = FaultyDecoder(eng.decoder)
    reqs = requests(3, seed=21)
    faulty.broken.set()
    eng.start()
    try:
        streams = [eng.submit(r) for r in reqs]  # two decode, one waits (and is then admitted)
        for stream in streams:
            tokens, last = stream.result(timeout=120)
            assert (last.finish_reason, tokens) == ("error", [])
            assert "injected device fault" in last.error
        assert not eng.healthy and not eng.dead.is_set()
        calls = faulty.calls
        wait_until(lambda: faulty.calls > calls + 1)  # it keeps probing
        assert not eng.healthy
        faulty.broken.clear()
        wait_until(lambda: eng.healthy)
        assert eng.failures >= 3 and "injected device fault" in eng.last_error
        streams = [eng.submit(r) for r in reqs]
        for request, stream in zip(reqs, streams):
            assert stream.result(timeout=120)[0] == alone(model, request)
    finally:
        eng.stop()


def test_an_engine_that_keeps_failing_gives_up(model):
    """After max_failures failed turns in a row: dead, on_dead called once, the waiting
    requests answered with "error", and new ones refused with EngineFailed."""
    eng = qwen_engine(
        model,
        slots=1,
        max_prompt_len=WIDTH,
        max_new_tokens=MAX_NEW,
        block_size=B,
        steps_per_call=1,
        max_failures=2,
    )
    faulty = eng.decoder = FaultyDecoder(eng.decoder)
    faulty.broken.set()
    called = []
    eng.on_dead = lambda: called.append(eng.dead.is_set())
    streams = [eng.submit(r) for r in requests(4, seed=5)]  # one slot: three wait
    eng.start()
    try:
        wait_until(eng.dead.is_set)
        for stream in streams:
            assert stream.result(timeout=10)[1].finish_reason == "error"
        assert called == [True] and faulty.calls == 2 and not eng.healthy
        with pytest.raises(engine.EngineFailed, match="injected device fault"):
            eng.submit(requests(1)[0])
    finally:
        eng.stop()


def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_top_p_and_logprobs_per_request_decode_as_alone(model):
    """A batch that mixes top_p, temperatures, thresholds and log-probability requests: each
    completion equals its prompt decoded alone (`decode.generate` with its top_p). The
    log-probabilities are the model's, checked against the uncached reference: greedy requests
    against `reference_mars`'s forwards (the tokens each forward accepted, from the mask
    positions at threshold < 1), every sampled token inside its top_p nucleus of the AR
    distribution, and the alternatives the most likely tokens, in order."""
    # Spread-out distributions (the top tokens 0.25, 0.21, 0.21, 0.05 at the first position):
    # top_p cuts, and MARS at 0.5 still accepts several tokens per forward.
    soft = make_model(60.0, seed=2)
    eng = qwen_engine(
        soft,
        slots=3,
        max_prompt_len=WIDTH,
        max_new_tokens=MAX_NEW,
        block_size=B,
        steps_per_call=2,
        logprobs=3,
    )
    prompts = [r.prompt_ids for r in requests(7, seed=31)]
    settings = [  # threshold, temperature, top_p, logprobs
        (1.0, 0.0, 1.0, 3),
        (0.5, 0.0, 1.0, 2),
        (1.0, 1.0, 0.3, 0),
        (0.9, 1.0, 0.6, None),
        (1.0, 1.0, 1.0, None),
        (1.0, 0.8, 0.9, 1),
        (0.7, 0.8, 0.9, None),
    ]
    reqs = [
        engine.Request(p, MAX_NEW, threshold=t, temperature=c, seed=7 + i, top_p=q, logprobs=k)
        for i, (p, (t, c, q, k)) in enumerate(zip(prompts, settings))
    ]
    updates = {i: [] for i in range(len(reqs))}
    for i, r in enumerate(reqs):
        eng.submit(r, on_update=updates[i].append)
    while eng.run_once():
        pass
    fwd = Uncached(soft, WIDTH + MAX_NEW + B)
    for i, request in enumerate(reqs):
        tokens = sum((u.tokens for u in updates[i]), [])
        assert tokens == alone(soft, request), request
        if request.logprobs is None:
            assert all(u.logprobs is None for u in updates[i])
            continue
        logprobs = sum((u.logprobs for u in updates[i]), [])
        top = sum((u.top_logprobs for u in updates[i]), [])
        assert len(logprobs) == len(top) == len(tokens)
        seq = list(request.prompt_ids)
        if request.temperature == 0:  # the forwards that accepted each token, uncached
            _, _, _, steps = reference_mars(
                fwd, seq, block_size=B, threshold=request.threshold, max_new=MAX_NEW
            )
            expected = []
            for step in steps:
                masks = [engine_mask()] * (B - 1)
                lp = log_softmax(fwd.logits(seq + masks, len(seq) - 1, B))
                expected += [lp[j] for j in range(len(step))]
                seq += step
        else:  # sampled at threshold 1.0: one token per forward, from the AR distribution
            expected = []
            for t in tokens:
                expected.append(log_softmax(fwd.logits(seq, len(seq) - 1, 1))[0])
                seq.append(t)
            for t, lp in zip(tokens, expected):  # inside the nucleus of its temperature
                p = np.exp(log_softmax(lp / request.temperature))
                assert p[p > p[t]].sum() < request.top_p, (t, request)
        for t, got, alts, lp in zip(tokens, logprobs, top, expected):
            np.testing.assert_allclose(got, lp[t], atol=2e-4)
            assert [a for a, _ in alts] == np.argsort(-lp, kind="stable")[
                : request.logprobs
            ].tolist()
            np.testing.assert_allclose(
                [v for _, v in alts], np.sort(lp)[::-1][: len(alts)], atol=2e-4
            )
    with pytest.raises(InputError, match="^logprobs: 4; it takes 0 to 3"):
        eng.submit(engine.Request((1, 2), 4, logprobs=4))
    with pytest.raises(InputError, match="^top_p: 0.0; must lie in"):
        eng.submit(engine.Request((1, 2), 4, top_p=0.0))


def engine_mask() -> int:
    from tests.decode_oracles import MASK_ID

    return MASK_ID


class RecordingDecoder:
    """A `Decoder` that records the shape of every prefill forward and insert."""

    def __init__(self, decoder):
        self.decoder, self.prefills, self.inserts = decoder, [], []

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def prefill_chunk(self, params, state, ids, start):
        self.prefills.append((ids.shape, int(start[0])))
        return self.decoder.prefill_chunk(params, state, ids, start)

    def insert(self, state, group, slots):
        self.inserts.append(np.asarray(slots).tolist())
        return self.decoder.insert(state, group, slots)


def test_requests_admitted_together_are_prefilled_in_one_forward(model):
    """Three requests arriving together: one prefill forward of 4 rows (a power of two, the
    fourth padding) at 16 tokens (fitted to prompts of at most 12, not the 40-token chunk),
    then one insert into their slots (the padding row dropped); a 30-token prompt arriving
    alone: one row at 32, into the first free slot; a 70-token one: chunks of 40. Each completion equals its prompt
    decoded alone."""
    eng = qwen_engine(
        model,
        slots=4,
        max_prompt_len=80,
        max_new_tokens=MAX_NEW,
        block_size=B,
        steps_per_call=2,
        prefill_chunk=40,
    )
    rec = eng.decoder = RecordingDecoder(eng.decoder)
    first = requests(3, seed=41)
    streams = [eng.submit(r) for r in first]
    eng.run_once()
    assert rec.prefills == [((4, 16), 0)] and rec.inserts == [[0, 1, 2, 4]]
    later = [
        engine.Request(tuple(range(100, 130)), 6, threshold=0.9),
        engine.Request(tuple(range(200, 270)), 6, threshold=0.9),
    ]
    streams.append(eng.submit(later[0]))
    free = min(i for i, s in enumerate(eng._streams) if s is None)
    eng.run_once()
    assert rec.prefills[1:] == [((1, 32), 0)] and rec.inserts[1:] == [[free]]
    while eng.run_once():
        pass
    streams.append(eng.submit(later[1]))
    while eng.run_once():
        pass
    assert rec.prefills[2:] == [((1, 40), 0), ((1, 40), 40)]
    for request, stream in zip(first + later, streams):
        assert stream.result(timeout=1)[0] == alone(model, request), request
