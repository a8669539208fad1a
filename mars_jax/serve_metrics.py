"""Prometheus metrics of `mars_jax.serve` (``GET /metrics``, Prometheus' text format written by
``prometheus_client``), the figures vLLM, SGLang, TGI and JetStream export and the one a MARS
server's operator watches, tokens per forward:

- ``mars_requests_total{endpoint, status}``: requests answered, by HTTP status;
- ``mars_choices_total{finish_reason}``: choices ended ("stop", "length", "error", ...);
- ``mars_prompt_tokens_total``, ``mars_completion_tokens_total``: tokens read and returned;
- ``mars_tokens_per_forward``: a histogram of each finished choice's tokens per forward;
- ``mars_time_to_first_token_seconds``, ``mars_request_latency_seconds``: histograms from the
  request's arrival;
- ``mars_queue_length``, ``mars_slots_in_use``, ``mars_slots``: the engine, read at each scrape;
- ``mars_engine_failures_total``: failed device calls (`engine.Engine.failures`).

Each server has its own registry (several servers in one process, as in tests, do not mix).
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily

CONTENT_TYPE = CONTENT_TYPE_LATEST
TOKENS_PER_FORWARD_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 16.0)
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineFailures:
    """A collector reading the engine's failure count at each scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        yield CounterMetricFamily(
            "mars_engine_failures", "Failed device calls of the engine.", self.engine.failures
        )


class ServerMetrics:
    """The metrics of one server over ``engine`` (an `engine.Engine`)."""

    def __init__(self, engine):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "mars_requests",
            "Requests answered, by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.choices = Counter(
            "mars_choices", "Choices ended, by finish reason.", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("mars_prompt_tokens", "Prompt tokens read.", registry=r)
        self.completion_tokens = Counter(
            "mars_completion_tokens", "Completion tokens returned.", registry=r
        )
        self.tokens_per_forward = Histogram(
            "mars_tokens_per_forward",
            "Tokens per forward of each finished choice.",
            buckets=TOKENS_PER_FORWARD_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "mars_time_to_first_token_seconds",
            "From a request's arrival to its first token.",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "mars_request_latency_seconds",
            "From a request's arrival to its answer's end.",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        queue = Gauge("mars_queue_length", "Requests waiting for a slot.", registry=r)
        queue.set_function(lambda: engine.waiting)
        busy = Gauge("mars_slots_in_use", "Slots decoding a request.", registry=r)
        busy.set_function(lambda: engine.active)
        Gauge("mars_slots", "Decoding slots.", registry=r).set(engine.slots)
        r.register(_EngineFailures(engine))

    def observe(self, endpoint: str, status: int, seconds: float, answer=None, prompt_tokens=0):
        """One answered request: its endpoint, HTTP status and latency; with ``answer`` (the
        server's record of its choices: finish reasons, tokens, forwards, when the first token
        came) and its ``prompt_tokens``, the token counts of the choices that ran."""
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.observe(seconds)
        if answer is None:
            return
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(sum(answer.tokens))
        for reason, tokens, forwards in zip(answer.reasons, answer.tokens, answer.forwards):
            self.choices.labels(reason or "none").inc()
            if forwards:
                self.tokens_per_forward.observe(tokens / forwards)
        if answer.first_token_seconds is not None:
            self.time_to_first_token.observe(answer.first_token_seconds)

    def scrape(self) -> bytes:
        return generate_latest(self.registry)
