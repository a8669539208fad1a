"""Continuous batching of MARS threshold decoding (arXiv 2604.07023, Sec. 3.3) on the decoder's
per-row cursors: a fixed number of slots, each decoding
its own request with its own threshold, temperature, seed and token budget; a request waiting
for a slot takes the first one that frees, while the others keep decoding.

The engine has the shape of JetStream's (prefill a request, insert it into a free slot, run
decode steps for all slots, free the slot) over the engine API of `mars_jax.decoder.Decoder`,
which owns every device update; the engine keeps only slot ids, queues, host counts and numpy
arrays, and never imports jax:

- ``prefill``: the requests admitted in one turn together, each row with its own settings
  (threshold, temperature, top_p, seed as in `decode.generate`): `Decoder.begin`, then one
  `Decoder.prefill_chunk` forward per chunk, one chunk per host turn, so a long prompt delays
  the decoding slots by one chunk's forward per turn, not by its whole prefill. A group is
  padded to a power-of-two number of rows and its chunks to the least of `widths` (16, 24, 32,
  48, ..., ``prefill_chunk``) that holds its longest prompt: a few compiled shapes (`warmup`
  compiles them all), and no 256-token forward for a 40-token prompt.
- ``insert``: `Decoder.insert` writes the group's rows into their slots of the batch state (KV
  cache rows, tokens, cursors and settings) in one update, the batch state donated.
- ``steps``: `Decoder.steps`, a few forwards per device call of the slots up to the highest
  busy one (rounded up to a power of two: a few compiled shapes); requests take the lowest free
  slots, so one user's steps compute one row, not ``slots``. A slot that is empty, finished or
  still prefilling is carried unchanged.
- ``free``: `Decoder.free` marks the rows of finished or cancelled requests done.

`Engine.run_once` is one turn of the host loop: reserve free slots for waiting requests (one
group), run one prefill chunk of each group, insert the groups whose prompts are done, run the steps, read back each slot's
tokens committed since the last turn (`Decoder.read_new_tokens`: those tokens alone, not the
token buffer) and hand them to its request (`Stream`), and free the slots of finished or
cancelled requests. `Engine.start` runs it in a thread. A request decodes exactly
as `decode.generate` of its prompt alone with the same settings (its budget as
``max_new_tokens``): a row's tokens depend only on its prompt, settings and seed (see
`mars_jax.decode`), never on the other slots or on when it was admitted.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
from typing import Any, Callable, Sequence

import numpy as np
from absl import logging
from flax import nnx

from mars_jax.decode_options import (
    CacheMode,
    DecodeOptions,
    OptionError,
    check_temperature,
    check_threshold,
    check_top_p,
)
from mars_jax.decode_state import DecoderSettings, DecodeState, RowSettings
from mars_jax.decoder import Decoder
from mars_jax.errors import InputError
from mars_jax.model import CausalLM
from mars_jax.sharding import axis_size


@dataclasses.dataclass(frozen=True)
class Request:
    """One completion request: prompt token ids, a budget of new tokens, and its settings;
    ``logprobs`` (None: none) asks for each token's log-probability and that many most likely
    alternatives (at most the engine's ``logprobs``)."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    threshold: float = 1.0
    temperature: float = 0.0
    seed: int = 0
    top_p: float = 1.0
    logprobs: int | None = None


@dataclasses.dataclass
class Update:
    """What a request received in one turn: ``tokens`` committed since the last update (EOS
    left out), ``done`` with ``finish_reason`` ("stop": an EOS; "length": the budget;
    "cancelled"; "error": a failed device call, ``error`` saying which), and the request's
    counts so far: ``forwards`` up to its last token handed out (those a device call ran after
    the answer ended are not its), and ``token_forwards`` [int], each of ``tokens``' forwards up
    to it (a caller that cuts the answer at a stop string counts up to there). With the
    request's ``logprobs``: ``logprobs`` [float] of ``tokens`` under
    the model (`decode_state.DecodeState.logprobs`) and ``top_logprobs`` [[(id, logprob)]], each
    token's most likely alternatives."""

    tokens: list[int]
    done: bool = False
    finish_reason: str | None = None
    completion_tokens: int = 0
    forwards: int = 0
    error: str | None = None
    token_forwards: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class EngineFailed(Exception):
    """The engine gave up after repeated failures of its device calls: it takes no requests."""


class Stream:
    """A submitted request's handle: `updates` yields its `Update`s as they come (blocking), or
    each goes to ``on_update`` (called from the engine's thread; e.g. to hand it to an event
    loop); `cancel` frees its slot at the engine's next turn (a client that went away)."""

    def __init__(self, request: Request, on_update: Callable[[Update], None] | None = None):
        self.request = request
        self._queue: queue.Queue[Update] = queue.Queue()
        self._on_update = on_update
        self.cancelled = threading.Event()

    def put(self, update: Update) -> None:
        if self._on_update is not None:
            self._on_update(update)
        else:
            self._queue.put(update)

    def updates(self, timeout: float | None = None):
        """Yields the request's `Update`s until its last (``done``); blocks up to ``timeout``
        seconds for each (queue.Empty past it). Not with ``on_update``."""
        while True:
            update = self._queue.get(timeout=timeout)
            yield update
            if update.done:
                return

    def result(self, timeout: float | None = None) -> tuple[list[int], Update]:
        """All tokens of the completion and the last update (blocking)."""
        tokens, last = [], None
        for last in self.updates(timeout):
            tokens += last.tokens
        return tokens, last

    def cancel(self) -> None:
        self.cancelled.set()


@dataclasses.dataclass
class _Prefill:
    """Requests admitted in one turn, prefilled together: their state (one row each, plus
    padding rows, ``streams`` None there), the slots they go to, the width of each prefill
    forward and the prompt tokens written so far."""

    streams: list[Stream | None]
    slots: list[int]
    state: DecodeState
    width: int
    done: int = 0

    @property
    def longest(self) -> int:
        return max(len(s.request.prompt_ids) for s in self.streams if s is not None)


def bucket(n: int, largest: int) -> int:
    """The compiled number of rows that holds ``n``: the least power of two >= n, capped at
    ``largest``."""
    size = 1
    while size < n:
        size *= 2
    return min(size, largest)


def widths(largest: int) -> list[int]:
    """The compiled prefill widths up to ``largest``: 16, 24, 32, 48, 64, 96, ... (powers of
    two and the midpoints 1.5x them: a prompt pads by at most a third), then ``largest``."""
    sizes, size = set(), 16
    while size < largest:
        sizes |= {size, size * 3 // 2}
        size *= 2
    return sorted({w for w in sizes if w < largest} | {largest})


def width_for(n: int, largest: int) -> int:
    """The least compiled width (`widths`) that holds ``n`` tokens, else ``largest``."""
    return next((w for w in widths(largest) if w >= n), largest)


def _refused(field: str, value, reason: str) -> OptionError:
    """The error of a request's ``field``: ``field: value; reason``."""
    return OptionError(field, value, reason, f"{field}: {value}; {reason}")


class Engine:
    """``slots`` rows of continuous batching with one model (see the module docstring).

    Args:
      model: a `CausalLM` (placed on its mesh, if any).
      options: the engine's `DecodeOptions`: block_size, cache_mode (not block) and rule;
        max_new_tokens is the largest budget of one request, threshold and temperature the
        defaults a server gives its requests. Each request brings its own threshold,
        temperature, budget and seed.
      slots: rows decoded together.
      max_prompt_len: the prompt width every request is padded to (longer ones are refused).
      eos_ids, mask_id, mesh, axis_rules: as `decode.generate`.
      pad_id: the id that fills prompt slots and empty rows (the tokenizer's ``pad_id``: a
        trimmed run's model id); any id of the embedding.
      steps_per_call: forwards per device call (per host turn).
      prefill_chunk: prompt tokens per prefill forward (None: the whole prompt width in one);
        the prompt width is rounded up to a multiple of it.
      sampling: compile the sampling path (needed for any request with temperature > 0; never
        with rule ``verify``, which is greedy).
      refill: admit a waiting request as soon as a slot frees (continuous batching); False
        admits only into an empty batch (static batching: the baseline of the load benchmark).
      max_failures: failed turns in a row after which the engine gives up (see `start`).
      logprobs: the most alternatives per token a request may ask for (None: the engine
        records no log-probabilities; 0: only the tokens' own).
    """

    def __init__(
        self,
        model: CausalLM,
        options: DecodeOptions,
        *,
        slots: int,
        max_prompt_len: int,
        eos_ids: Sequence[int],
        mask_id: int | None,
        pad_id: int,
        steps_per_call: int = 4,
        prefill_chunk: int | None = None,
        sampling: bool = True,
        refill: bool = True,
        max_failures: int = 3,
        logprobs: int | None = None,
        mesh=None,
        axis_rules: Any = None,
    ):
        block_size, max_new_tokens = options.block_size, options.max_new_tokens
        chunk = max_prompt_len if prefill_chunk is None else prefill_chunk
        if min(slots, max_prompt_len, max_new_tokens, steps_per_call, chunk) < 1:
            raise InputError(
                "slots, max_prompt_len, max_new_tokens, steps_per_call, prefill_chunk must be >= 1"
            )
        if options.cache_mode is CacheMode.BLOCK:
            raise InputError("the block cache mode makes rows wait at block ends: use 'sliding'")
        sampling = sampling and options.rule_name != "verify"
        self.options = options
        graphdef, self.params = nnx.split(model)
        self.decoder = Decoder(
            graphdef,
            DecoderSettings.of(
                options,
                eos_ids=eos_ids,
                mask_id=mask_id,
                sampling=sampling,
                mesh=mesh,
                axis_rules=axis_rules,
                logprobs=logprobs,
            ),
        )
        self.slots, self.max_prompt_len = slots, max_prompt_len
        self.vocab_size, self.pad_id = model.cfg.vocab_size, int(pad_id)
        self.context = model.cfg.max_position_embeddings  # prompt + completion at most
        if not 0 <= self.pad_id < self.vocab_size:
            raise InputError(f"pad_id: {pad_id}; not a row of the {self.vocab_size}-row embedding")
        self.prefill_chunk = min(chunk, max_prompt_len)
        self._width = -(-max_prompt_len // self.prefill_chunk) * self.prefill_chunk
        self.max_new_tokens, self.steps_per_call = max_new_tokens, steps_per_call
        self.refill = refill
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self._read_width = steps_per_call * block_size  # the most tokens a row gets per turn
        # Rows a device call decodes come in multiples of the devices the rows are split over.
        self._row_multiple = 1
        if mesh is not None:
            batch_axes = dict(axis_rules).get("batch") if axis_rules is not None else None
            self._row_multiple = slots if axis_rules is None else axis_size(mesh, batch_axes)
        self.state = self._empty()
        self._streams: list[Stream | None] = [None] * slots  # decoding
        self._prefills: list[_Prefill] = []  # groups of requests being prefilled
        self._sent = [0] * slots  # tokens handed to each slot's stream
        self._forwards = [0] * slots  # its forwards up to the last of them
        self._waiting: collections.deque[Stream] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.forwards = 0  # decoding forwards run so far (each of all slots)
        # Failures (see `start`): turns that raised, in all and in a row, and the last error.
        self.max_failures, self.failures, self._failed_in_a_row = max_failures, 0, 0
        self.last_error: str | None = None
        self.healthy = True  # False from a failed turn until a request decodes again
        self.dead = threading.Event()  # set once the engine gave up
        self.on_dead: Callable[[], None] | None = None  # called (engine thread) when it gives up
        self._probe: Stream | None = None

    # -- requests --------------------------------------------------------------------------------
    def check(self, request: Request) -> None:
        """Raises `OptionError` (its ``field`` a `Request` field) for a request this engine
        cannot decode: the one place a request's prompt and budget meet this engine's limits
        and the model's context; the threshold, temperature and top_p by `DecodeOptions`' rules
        (its validators: nothing is built to be thrown away). `submit` runs it."""
        n, budget = len(request.prompt_ids), request.max_tokens
        if not 1 <= n <= self.max_prompt_len:
            raise _refused("prompt", f"{n} tokens", f"this engine takes 1 to {self.max_prompt_len}")
        if n >= self.context:
            raise _refused("prompt", f"{n} tokens", f"the model's context is {self.context}")
        if not all(0 <= t < self.vocab_size for t in request.prompt_ids):
            bad = next(t for t in request.prompt_ids if not 0 <= t < self.vocab_size)
            reason = f"is not a row of the model's {self.vocab_size}"
            raise OptionError("prompt", bad, reason, f"prompt: token id {bad} {reason}")
        if not 1 <= budget <= self.max_new_tokens:
            raise _refused("max_tokens", budget, f"must lie in [1, {self.max_new_tokens}]")
        if n + budget > self.context:
            room = self.context - n
            reason = (
                f"the prompt ({n} tokens) and {budget} new tokens exceed the model's context of "
                f"{self.context} tokens; at most {room} fit"
            )
            raise _refused("max_tokens", budget, reason)
        try:
            check_threshold(request.threshold)
            check_temperature(request.temperature)
            check_top_p(request.top_p)
        except OptionError as e:
            raise _refused(e.field, e.value, e.reason) from None
        most = self.decoder.settings.logprobs
        if request.logprobs is not None and (most is None or not 0 <= request.logprobs <= most):
            reason = "this engine records none" if most is None else f"it takes 0 to {most}"
            raise _refused("logprobs", request.logprobs, reason)
        if request.temperature > 0 and not self.decoder.settings.sampling:
            raise _refused("temperature", request.temperature, "this engine decodes greedily")
        if not 0 <= request.seed < 2**32:
            raise _refused("seed", request.seed, "must lie in 0..2**32-1")

    def submit(self, request: Request, on_update: Callable[[Update], None] | None = None) -> Stream:
        """Queues ``request`` (checked first, `check`); returns its `Stream` (see there for
        ``on_update``). `EngineFailed` once the engine gave up."""
        self.check(request)
        if self.dead.is_set():
            raise EngineFailed(f"the engine gave up after repeated failures: {self.last_error}")
        stream = Stream(request, on_update)
        with self._lock:
            self._waiting.append(stream)
        self._wake.set()
        return stream

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiting)

    @property
    def active(self) -> int:
        """Slots decoding a request."""
        return sum(s is not None for s in self._streams)

    @property
    def prefilling(self) -> int:
        """Slots whose request's prompt is still being prefilled."""
        return sum(s is not None for p in self._prefills for s in p.streams)

    def _reserved(self) -> set[int]:
        return {slot for p in self._prefills for slot in p.slots}

    # -- the host loop ---------------------------------------------------------------------------
    def _empty(self) -> DecodeState:
        """A batch state of ``slots`` free rows."""
        empty = self._begin([Request((self.pad_id,), 1)] * self.slots)
        return self.decoder.free(empty, np.ones((self.slots,), bool))

    def _begin(self, requests: Sequence[Request]) -> DecodeState:
        rows, width = len(requests), self._width
        ids = np.full((rows, width), self.pad_id, np.int32)
        for r, q in enumerate(requests):
            ids[r, : len(q.prompt_ids)] = q.prompt_ids
        row_settings = RowSettings.build(
            rows,
            threshold=[q.threshold for q in requests],
            max_accept=self.decoder.settings.block_size,
            # Each row stops at its own budget inside a device call: its forwards count only
            # those that decoded for it (usage's tokens_per_forward).
            max_new_tokens=[q.max_tokens for q in requests],
            temperature=[q.temperature for q in requests],
            seed=[q.seed for q in requests],
            top_p=[q.top_p for q in requests],
            want_logprobs=[q.logprobs is not None for q in requests],
        )
        lengths = np.asarray([len(q.prompt_ids) for q in requests], np.int32)
        return self.decoder.begin(self.params, ids, lengths, row_settings)

    def _admit(self) -> None:
        """Takes waiting requests into the free slots: those admitted in one turn are one
        prefill group, padded to a power-of-two number of rows (at most ``slots``) and
        prefilled at the least of `widths` (16, 24, 32, 48, ... up to ``prefill_chunk``) that
        holds their longest prompt, so that a few compiled shapes serve every group."""
        if not self.refill and (self.active or self._prefills):
            return
        reserved = self._reserved()
        free = [
            slot
            for slot in range(self.slots)
            if self._streams[slot] is None and slot not in reserved
        ]
        streams = []
        with self._lock:
            while self._waiting and len(streams) < len(free):
                stream = self._waiting.popleft()
                if stream.cancelled.is_set():
                    stream.put(Update([], True, "cancelled"))
                else:
                    streams.append(stream)
        if not streams:
            return
        rows = bucket(len(streams), self.slots)
        padded = streams + [None] * (rows - len(streams))
        empty = Request((self.pad_id,), 1)
        try:
            state = self._begin([empty if s is None else s.request for s in padded])
        except Exception as error:  # noqa: BLE001 - the group's own: it fails alone
            self._fail_group(streams, error)
            return
        longest = max(len(s.request.prompt_ids) for s in streams)
        width = width_for(longest, self.prefill_chunk)
        self._prefills.append(_Prefill(padded, free[: len(streams)], state, width))

    def _prefill_chunks(self) -> None:
        """One chunk of every group being prefilled; a group whose prompts are done goes into
        its slots (one `Decoder.insert`)."""
        for p in list(self._prefills):
            for i, stream in enumerate(p.streams):
                if stream is not None and stream.cancelled.is_set():
                    p.streams[i] = None
                    stream.put(Update([], True, "cancelled"))
            if all(s is None for s in p.streams):
                self._prefills.remove(p)
                continue
            if p.state.cache is None:  # cache_mode "none": each forward reads the prompt
                p.done = p.longest
            else:
                chunk = np.full((len(p.streams), p.width), self.pad_id, np.int32)
                for r, stream in enumerate(p.streams):
                    if stream is not None:
                        piece = stream.request.prompt_ids[p.done : p.done + p.width]
                        chunk[r, : len(piece)] = piece
                start = np.full((len(p.streams),), p.done, np.int32)
                try:
                    p.state = self.decoder.prefill_chunk(self.params, p.state, chunk, start)
                except Exception as error:  # noqa: BLE001 - the group's own: it fails alone
                    self._prefills.remove(p)
                    self._fail_group(p.streams, error)
                    continue
                p.done += p.width
            if p.done >= p.longest:
                self._prefills.remove(p)
                # Row r goes to its slot; padding rows and cancelled ones nowhere (dropped).
                slots = np.full((len(p.streams),), self.slots, np.int32)
                for r, (stream, slot) in enumerate(zip(p.streams, p.slots)):
                    if stream is not None:
                        slots[r] = slot
                        self._streams[slot], self._sent[slot] = stream, 0
                        self._forwards[slot] = 0
                self.state = self.decoder.insert(self.state, p.state, slots)

    def warmup(self) -> int:
        """Compiles every program a turn can run, by running each once on padding rows: the
        prefill of each group shape (`_admit`'s row and width buckets), their insert (the rows
        dropped), the steps, the read-back and the free; so that no request waits for a
        compile. Call it before `start`; returns the number of group shapes."""
        row_sizes = sorted({bucket(n, self.slots) for n in range(1, self.slots + 1)})
        sizes = widths(self.prefill_chunk)
        for rows, width in itertools.product(row_sizes, sizes):
            # A group's first chunk takes `begin`'s state, a later one (only at the full chunk
            # width) a chunk's: their arrays' placements differ, and so do the programs.
            group = self._begin([Request((self.pad_id,), 1)] * rows)
            later = width == self.prefill_chunk < self._width
            for _ in range(1 + later if group.cache is not None else 0):
                ids = np.full((rows, width), self.pad_id, np.int32)
                group = self.decoder.prefill_chunk(
                    self.params, group, ids, np.zeros((rows,), np.int32)
                )
            nowhere = np.full((rows,), self.slots, np.int32)
            self.state = self.decoder.insert(self.state, group, nowhere)
        for rows in {self._step_rows(n) for n in range(1, self.slots + 1)}:
            self.state = self.decoder.steps(self.params, self.state, self.steps_per_call, rows)
        self.decoder.read_new_tokens(self.state, self._sent, self._read_width)
        self.state = self.decoder.free(self.state, np.zeros((self.slots,), bool))
        return len(row_sizes) * len(sizes)

    def _step_rows(self, top: int) -> int | None:
        """The rows a device call decodes when slots 0..top-1 hold the busy ones: the least
        power of two >= top (and a multiple of the row devices); None: all slots."""
        rows = bucket(max(top, self._row_multiple), self.slots)
        return None if rows >= self.slots or rows % self._row_multiple else rows

    def run_once(self) -> bool:
        """One turn: admit, one prefill chunk per new request, decode ``steps_per_call``
        forwards, hand out tokens, free slots. Returns whether any request is active, being
        prefilled or waiting afterwards."""
        self._admit()
        self._prefill_chunks()
        if self.active == 0:
            return bool(self._waiting or self._prefills)
        top = 1 + max(slot for slot, s in enumerate(self._streams) if s is not None)
        rows = self._step_rows(top)
        self.state = self.decoder.steps(self.params, self.state, self.steps_per_call, rows)
        new = self.decoder.read_new_tokens(self.state, self._sent, self._read_width)
        self.forwards += int(new.forwards)
        free = np.zeros((self.slots,), bool)
        for slot, stream in enumerate(self._streams):
            if stream is None:
                continue
            budget = stream.request.max_tokens
            count = max(min(int(new.new_tokens[slot]), budget) - self._sent[slot], 0)
            fresh = new.tokens[slot, :count].tolist()
            reason = None
            for i, t in enumerate(fresh):
                if t in self.eos_ids:
                    fresh, reason = fresh[:i], "stop"
                    break
            self._sent[slot] += len(fresh)
            if reason is None and self._sent[slot] >= budget:
                reason = "length"
            if reason is None and stream.cancelled.is_set():
                reason = "cancelled"
            token_forwards = new.token_forwards[slot, : len(fresh)].tolist()
            if token_forwards:
                self._forwards[slot] = token_forwards[-1]
            update = Update(
                fresh,
                reason is not None,
                reason,
                self._sent[slot],
                self._forwards[slot],
                token_forwards=token_forwards,
            )
            if stream.request.logprobs is not None:
                self._add_logprobs(update, new, slot, stream.request.logprobs)
            if update.done:  # the slot is free before its client hears it is done
                self._streams[slot], free[slot] = None, True
            if fresh or update.done:
                stream.put(update)
        self.state = self.decoder.free(self.state, free)
        self.healthy, self._failed_in_a_row = True, 0  # a decoding turn went through
        return self.active > 0 or bool(self._waiting or self._prefills)

    @staticmethod
    def _add_logprobs(update: Update, new, slot: int, k: int) -> None:
        n = len(update.tokens)
        update.logprobs = new.logprobs[slot, :n].tolist()
        ids, lps = new.top_ids[slot, :n, :k].tolist(), new.top_logprobs[slot, :n, :k].tolist()
        update.top_logprobs = [list(zip(i, lp)) for i, lp in zip(ids, lps)]

    def start(self) -> None:
        """Runs the host loop in a daemon thread until `stop`.

        A prefill that raises (one group's own program: its state is not the batch's) ends
        that group's requests with finish_reason "error", and the others go on. Any other turn
        that raises (a failed device call) ends the requests in flight with
        finish_reason "error" (their ``error`` naming it) and rebuilds the batch state, whose
        donated buffers may be gone; the engine is not `healthy` until a request decodes again
        (with none waiting, it decodes a one-token probe of its own, after a pause that doubles
        with each failure). After ``max_failures`` failed turns in a row it gives up: `dead` is
        set, waiting requests end with "error", `submit` raises `EngineFailed`, and
        ``on_dead`` is called (the server exits non-zero, for a supervisor to restart it).
        """

        def loop():
            while not self._stop.is_set() and not self.dead.is_set():
                try:
                    if not self.healthy and self._probe is None and not self._waiting:
                        self._probe = Stream(Request((self.pad_id,), 1))
                        with self._lock:
                            self._waiting.appendleft(self._probe)
                    busy = self.run_once()
                except Exception as error:  # noqa: BLE001 - every failure ends its requests
                    self._fail(error)
                    self._stop.wait(min(0.05 * 2**self._failed_in_a_row, 2.0))
                    continue
                if self.healthy:  # a decoding turn went through: no probe is needed
                    self._probe = None
                if not busy:
                    self._wake.wait(0.05)
                    self._wake.clear()

        self._thread = threading.Thread(target=loop, name="mars-engine", daemon=True)
        self._thread.start()

    def _fail_group(self, streams, error: Exception) -> None:
        """A prefill group's own program raised ``error`` (e.g. out of memory on a long
        prompt): its requests end with finish_reason "error"; the batch state is not its, so
        the requests decoding go on."""
        self.failures += 1
        self.last_error = f"{type(error).__name__}: {error}"
        logging.error("prefill failed: %s", self.last_error, exc_info=error)
        for stream in streams:
            if stream is not None:
                stream.put(
                    Update(
                        [], True, "error", error=f"prefill failed on the device: {self.last_error}"
                    )
                )

    def _fail(self, error: Exception) -> None:
        """A turn raised ``error``: see `start`."""
        self.failures += 1
        self._failed_in_a_row += 1
        self.healthy, self._probe = False, None
        self.last_error = f"{type(error).__name__}: {error}"
        logging.error(
            "decoding failed (%d in a row): %s",
            self._failed_in_a_row,
            self.last_error,
            exc_info=error,
        )
        message = f"decoding failed on the device: {self.last_error}"
        in_flight = [*self._streams, *(s for p in self._prefills for s in p.streams)]
        self._streams, self._sent = [None] * self.slots, [0] * self.slots
        self._forwards = [0] * self.slots
        self._prefills.clear()
        if self._failed_in_a_row < self.max_failures:
            try:
                self.state = self._empty()
            except Exception as again:  # noqa: BLE001 - no state to decode with: give up
                self.last_error = f"{type(again).__name__}: {again}"
                self._failed_in_a_row = self.max_failures
        if self._failed_in_a_row >= self.max_failures:
            self.dead.set()
            with self._lock:
                in_flight += list(self._waiting)
                self._waiting.clear()
        for stream in in_flight:
            if stream is not None:
                stream.put(Update([], True, "error", error=message))
        if self.dead.is_set():
            logging.error("the engine gives up after %d failed turns", self._failed_in_a_row)
            if self.on_dead is not None:
                self.on_dead()

    def stop(self) -> None:
        """Ends the loop after its current turn; requests still queued or decoding are ended
        with finish_reason "cancelled"."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        prefilling = [s for p in self._prefills for s in p.streams]
        for stream in [*self._streams, *prefilling, *self._waiting]:
            if stream is not None:
                stream.put(Update([], True, "cancelled"))
        self._streams = [None] * self.slots
        self._prefills.clear()
        self._waiting.clear()
