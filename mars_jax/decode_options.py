"""`DecodeOptions`: the settings of one decode, as one frozen, checked value.

Every way of asking for a decode builds one: the run config (``eval.*``, `from_eval`), the
command-line flags of ``generate``, the lm-eval adapter's arguments, a server request.
`decode.generate` and the engine take it and check nothing again: each rule below is written
once, in `DecodeOptions.__post_init__`, and a bad value raises `OptionError` naming the field
(``threshold must lie in (0, 1], got 2.0``), which the config turns into its own key
(``eval.thresholds=...``) and the server into its request field.

A leaf module (it imports only `mars_jax.errors`), so the config can check decoding settings
before anything heavy is imported.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from mars_jax.errors import InputError, SettingError


class CacheMode(str, enum.Enum):
    """The KV-cache schemes of `mars_jax.decode` (its module docstring)."""

    SLIDING = "sliding"
    BLOCK = "block"
    NONE = "none"


class Rule(str, enum.Enum):
    """The built-in acceptance rules of `mars_jax.decode` (``ACCEPTANCE_RULES``, by value)."""

    PROB = "prob"
    ENTROPY = "entropy"
    MARGIN = "margin"
    VERIFY = "verify"


CACHE_MODES = tuple(m.value for m in CacheMode)
RULES = tuple(r.value for r in Rule)
# name -> `acceptance.AcceptanceRule`, filled by mars_jax.acceptance: a new rule is one class
# registered there, and its name is then a valid ``rule`` (a built-in name is valid before decode loads).
ACCEPTANCE_RULES: dict[str, object] = {}


class OptionError(InputError):
    """A bad decoding setting: ``field`` (a `DecodeOptions` field), its ``value`` and the
    ``reason``; the message is ``{field} {reason}, got {value!r}`` unless given whole."""

    def __init__(self, field: str, value, reason: str, message: str | None = None):
        super().__init__(message or f"{field} {reason}, got {value!r}")
        self.field, self.value, self.reason = field, value, reason

    def prefixed(self, prefix: str) -> OptionError:
        """The same error with ``prefix`` before its message (e.g. ``mars_jax: ``)."""
        return OptionError(self.field, self.value, self.reason, prefix + str(self))


def _enum(kind, field: str, value):
    try:
        return kind(value.value if isinstance(value, enum.Enum) else value)
    except ValueError:
        choices = tuple(m.value for m in kind)
        raise OptionError(field, value, f"must be one of {choices}") from None


def _rule(value) -> Rule | str:
    """A built-in rule's `Rule`, or the name of one registered in `ACCEPTANCE_RULES`."""
    name = value.value if isinstance(value, enum.Enum) else value
    if name in RULES:
        return Rule(name)
    if isinstance(name, str) and name in ACCEPTANCE_RULES:
        return name
    names = tuple(dict.fromkeys((*RULES, *ACCEPTANCE_RULES)))
    raise OptionError("rule", value, f"must be one of {names}")


def check_threshold(value) -> float | tuple[float, ...]:
    """``value`` (one threshold or several) as floats in (0, 1]; `OptionError` otherwise."""
    many = not isinstance(value, (str, int, float)) and getattr(value, "ndim", 1) != 0
    try:
        values = [
            math.nan if isinstance(t, bool) else float(t) for t in (value if many else [value])
        ]
    except (TypeError, ValueError):
        raise OptionError("threshold", value, "must lie in (0, 1]") from None
    for raw, t in zip(value if many else [value], values):
        if not 0.0 < t <= 1.0:  # NaN (and a bool) fail too
            raise OptionError("threshold", t if isinstance(raw, str) else raw, "must lie in (0, 1]")
    if many and not values:
        raise OptionError("threshold", value, "must list a threshold")
    return tuple(values) if many else values[0]


def check_temperature(value) -> float:
    """``value`` as a float >= 0 (0: greedy); `OptionError` otherwise (NaN too)."""
    try:
        temperature = float(value)
    except (TypeError, ValueError):
        raise OptionError("temperature", value, "must be >= 0 (0: greedy)") from None
    if not temperature >= 0:  # NaN fails too
        raise OptionError("temperature", value, "must be >= 0 (0: greedy)")
    return temperature


def check_top_p(value) -> float:
    """``value`` as a float in (0, 1] (1: every token); `OptionError` otherwise."""
    try:
        top_p = float(value)
    except (TypeError, ValueError):
        top_p = float("nan")
    if not 0 < top_p <= 1:
        raise OptionError("top_p", value, "must lie in (0, 1] (1: every token)")
    return top_p


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """What one decode does (hashable; every check runs once, at construction).

    block_size: B, the most tokens accepted per forward (the training block size; 1 is AR).
    threshold: confidence needed to accept a candidate after the first, in (0, 1]; one value,
      or one per row (a tuple, `decode.generate` only). 1.0 is greedy AR decoding exactly.
    max_new_tokens: the completion budget per row (>= 0; 0 decodes nothing).
    temperature: 0 greedy; > 0 samples each candidate from softmax(logits / temperature).
    top_p: in (0, 1]; a sampled candidate is drawn from the smallest set of the most likely
      tokens whose probabilities sum to >= top_p (nucleus sampling; 1.0: every token).
      Temperature and top_p choose candidates only: the threshold compares the model's own
      probability of each (softmax at temperature 1), so neither loosens acceptance.
    cache_mode: a `CacheMode` (or its name); rule: a `Rule` (or its name), or the name of a
      rule registered in `ACCEPTANCE_RULES`. ``verify``
      reproduces greedy AR decoding: it needs temperature 0 and a cache mode other than block.
    max_accept_per_step: the most tokens a row accepts per forward (None: B).
    adaptive_window: in sliding mode, a B-slot window on steps where every row fits in one.
    """

    block_size: int = 1
    threshold: float | tuple[float, ...] = 1.0
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    cache_mode: CacheMode = CacheMode.SLIDING
    rule: Rule | str = Rule.PROB
    max_accept_per_step: int | None = None
    adaptive_window: bool = True

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        for name, low in (("block_size", 1), ("max_new_tokens", 0)):
            value = getattr(self, name)
            if not _integral(value):
                raise OptionError(name, value, "must be an integer")
            if int(value) < low:
                raise OptionError(name, value, f"must be >= {low}")
            set_(name, int(value))
        set_("threshold", check_threshold(self.threshold))
        set_("temperature", check_temperature(self.temperature))
        set_("top_p", check_top_p(self.top_p))
        set_("cache_mode", _enum(CacheMode, "cache_mode", self.cache_mode))
        set_("rule", _rule(self.rule))
        if self.max_accept_per_step is not None:
            if not _integral(self.max_accept_per_step) or int(self.max_accept_per_step) < 1:
                raise OptionError("max_accept_per_step", self.max_accept_per_step, "must be >= 1")
            set_("max_accept_per_step", int(self.max_accept_per_step))
        set_("adaptive_window", bool(self.adaptive_window))
        if self.rule is Rule.VERIFY and (self.sampling or self.cache_mode is CacheMode.BLOCK):
            reason = (
                "reproduces greedy AR decoding: it needs temperature 0 and cache_mode 'sliding' "
                f"or 'none' (got temperature={self.temperature}, cache_mode "
                f"{self.cache_mode.value!r})"
            )
            raise OptionError("rule", "verify", reason, f"rule='verify' {reason}")

    @property
    def sampling(self) -> bool:
        """Whether candidates are sampled (temperature > 0)."""
        return self.temperature > 0

    @property
    def rule_name(self) -> str:
        """The acceptance rule's name (a key of `ACCEPTANCE_RULES`)."""
        return self.rule.value if isinstance(self.rule, Rule) else self.rule

    @property
    def accept_limit(self) -> int:
        """The most tokens a row accepts per forward: ``max_accept_per_step``, else B."""
        return self.block_size if self.max_accept_per_step is None else self.max_accept_per_step

    def summary(self) -> dict:
        """block_size, threshold, cache_mode and rule as plain values (for logs and reports)."""
        return {
            "block_size": self.block_size,
            "threshold": self.threshold,
            "cache_mode": self.cache_mode.value,
            "rule": self.rule_name,
        }

    def replace(self, **changes) -> DecodeOptions:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_eval(cls, e, *, block_size: int = 1, threshold: float = 1.0) -> DecodeOptions:
        """The options of a run config's ``eval`` section at ``threshold`` and ``block_size``
        (eval.block_size resolved by the caller); a bad value raises `errors.SettingError`
        naming the config key (``eval.cache_mode``, ``eval.thresholds``, ...)."""
        keys = {"threshold": "eval.thresholds", "block_size": "eval.block_size"}
        try:
            return cls(
                block_size=block_size,
                threshold=threshold,
                max_new_tokens=e.max_new_tokens,
                temperature=e.temperature,
                cache_mode=e.cache_mode,
                rule=e.rule,
            )
        except OptionError as err:
            key = keys.get(err.field, f"eval.{err.field}")
            value = tuple(e.thresholds) if err.field == "threshold" else err.value
            reason = f"{err.value!r} is outside (0, 1]" if err.field == "threshold" else err.reason
            if err.field == "rule" and err.value == "verify":
                reason = reason.replace("temperature", "eval.temperature")
                reason = reason.replace("cache_mode", "eval.cache_mode")
            raise SettingError(key, value, reason) from None


def _integral(value) -> bool:
    try:
        return not isinstance(value, bool) and int(value) == value
    except (TypeError, ValueError):
        return False
