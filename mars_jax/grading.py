"""Grading of math answers: the final number of a GSM8K reference or a model completion
(`answer_value`), written canonically (`format_number`, `extract_answer`), and whether a
completion's answer equals the reference's (`answers_match`, `accuracy`)."""

from __future__ import annotations

import decimal
import fractions
import re

import numpy as np

from mars_jax.errors import InputError

# An unsigned number: digits with comma thousands separators in groups of exactly three
# ("1,000", "12,345.5"), or plain digits ("1000", "5.50"), or a bare decimal part (".5").
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"
# Not inside a number; then a sign (not after a word character or closing bracket: "3-5" is 3
# and 5) and an optional currency sign, or a currency sign and an optional sign; the number; an
# optional denominator ("a/b"); an optional percent sign.
_NUMBER = re.compile(
    r"(?<![\d.])(?:(?<![\w)\]}])(?P<sign>[-+\u2212])(?:\\?\$)?|\\?\$(?P<sign2>[-+\u2212])?)?"
    rf"(?P<num>{_UNSIGNED})(?:/(?P<den>{_UNSIGNED}))?(?:\s?\\?%)?"
)
_FRAC = re.compile(rf"\\[dt]?frac\{{\s*({_UNSIGNED})\s*\}}\{{\s*({_UNSIGNED})\s*\}}")


def _to_fraction(number: str) -> fractions.Fraction:
    return fractions.Fraction(number.replace(",", ""))


def _numbers(text: str) -> list[fractions.Fraction]:
    """The numbers written in ``text``, in order, as exact fractions (see `answer_value`)."""
    text = _FRAC.sub(r"\1/\2", text.replace("{,}", ","))
    out = []
    for m in _NUMBER.finditer(text):
        value = _to_fraction(m["num"])
        if m["den"] is not None:
            den = _to_fraction(m["den"])
            if den == 0:
                continue
            value /= den
        negative = (m["sign"] or m["sign2"] or "+") != "+"
        out.append(-value if negative else value)
    return out


def _boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` in ``text`` (braces balanced; an unclosed
    one runs to the end), else None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return text[i + 1 :]  # unclosed: the rest of the text


def answer_value(text: str) -> fractions.Fraction | None:
    r"""The final answer of a GSM8K reference or a model completion, as an exact number.

    Where: the first number after the first ``####`` (GSM8K's answer line; None when no number
    follows it); else the last number inside the last ``\boxed{...}``; else the last number in
    the text. What counts as a number (numbers are compared exactly, as fractions):

    - a sign ``-``, ``+`` or ``−`` (U+2212), not right after a letter, digit or closing
      bracket: "3-5" holds 3 and 5;
    - a currency sign ``$`` (or LaTeX ``\$``), before or after the sign: "$1,000", "-$5";
    - digits with comma thousands separators in groups of exactly three ("1,000", "12,345.50";
      LaTeX "1{,}000" too), or plain digits; a decimal part after a point (".5" included).
      Trailing zeros do not matter: "5.50" = "5.5", "18.00" = "18". A point not followed by a
      digit ends the number ("is 18." is 18);
    - a fraction "a/b" or ``\frac{a}{b}`` (``\dfrac``, ``\tfrac``) of such numbers (b != 0);
    - a percent sign (``%`` or ``\%``) is dropped: "25%" is 25, as GSM8K writes percentages bare.

    Not numbers, by decision: commas as decimal points or points as thousands separators
    (European "1.000" is 1 and "3,5" is 3 then 5), spaces as thousands separators ("1 000" is 1
    then 0), number words, scientific notation, mixed numbers ("1 1/2" is 1 then 1/2).

    Returns a `fractions.Fraction`, or None when there is no number.
    """
    if "####" in text:
        numbers = _numbers(text.split("####", 1)[1])
        return numbers[0] if numbers else None
    boxed = _boxed(text)
    if boxed is not None and (numbers := _numbers(boxed)):
        return numbers[-1]
    numbers = _numbers(text)
    return numbers[-1] if numbers else None


def format_number(value: fractions.Fraction) -> str:
    """``value`` written canonically: an integer ("1000", "-3"), an exact decimal without
    trailing zeros ("5.5", "0.25"), or "p/q" where no finite decimal is exact ("1/3")."""
    if value.denominator == 1:
        return str(value.numerator)
    d = value.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    if d != 1:
        return str(value)
    digits = len(str(value.numerator)) + len(str(value.denominator)) + 2
    with decimal.localcontext(decimal.Context(prec=digits)):
        exact = decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator)
    return format(exact.normalize(), "f")


def extract_answer(text: str) -> str | None:
    """The final answer of ``text`` (`answer_value`) written canonically (`format_number`): two
    texts' answers are numerically equal exactly when these strings are equal. None when there
    is no number."""
    value = answer_value(text)
    return None if value is None else format_number(value)


def answers_match(completion: str, reference: str) -> bool:
    """Whether the final answers of ``completion`` and ``reference`` (`answer_value`) are the
    same number; False when either has none."""
    answer, expected = answer_value(completion), answer_value(reference)
    return answer is not None and expected is not None and answer == expected


def accuracy(completions: list[str], references: list[str]) -> float:
    """The fraction of ``completions`` whose final answer equals that of the reference at the
    same index (`answers_match`); 0.0 for no completions. Raises ValueError for lists of
    different lengths."""
    if len(completions) != len(references):
        raise InputError(f"{len(completions)} completions for {len(references)} references")
    correct = [answers_match(c, r) for c, r in zip(completions, references)]
    return float(np.mean(correct)) if correct else 0.0
