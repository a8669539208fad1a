"""Built-in synthetic data: short multi-step arithmetic word problems in the GSM8K style.

The embedded default config trains on these so that it runs with no downloaded data. Each
answer shows its working one equation per line ("a op b = c") and ends in "#### <number>",
like GSM8K answers (without GSM8K's "<<...>>" calculator annotations). Problems are kept short
(question + answer about 60-90 tokens) because the default trains on CPU.
"""

import random

_PEOPLE = [
    ("Mia", "she"),
    ("Leo", "he"),
    ("Ava", "she"),
    ("Noah", "he"),
    ("Zoe", "she"),
    ("Sam", "he"),
    ("Lily", "she"),
    ("Omar", "he"),
    ("Ruth", "she"),
    ("Ben", "he"),
]
_ITEMS = ["apples", "stickers", "marbles", "pencils", "cookies", "cards", "shells", "beads"]
_BOXES = ["bags", "boxes", "packs", "jars"]


def arithmetic_problems(n: int, seed: int) -> list[dict[str, str]]:
    """Returns `n` word problems `{"question": str, "answer": str}`, deterministic in `seed`.

    Every problem starts from a small stock and applies 2-4 arithmetic steps (buying groups,
    receiving, giving away, sharing equally); all intermediate values are non-negative
    integers, each step is one answer line "... a op b = c ...", and the answer ends in
    "#### <final value>".
    """
    rng = random.Random(seed)
    return [_problem(rng) for _ in range(n)]


def _problem(rng: random.Random) -> dict[str, str]:
    (name, he), (friend, _) = rng.sample(_PEOPLE, 2)
    He, him = he.capitalize(), "her" if he == "she" else "him"
    item, box = rng.choice(_ITEMS), rng.choice(_BOXES)
    count = rng.randint(5, 30)
    question, answer = [f"{name} has {count} {item}."], []
    ending = f"How many {item} does {he} have now?"
    steps = rng.choice((2, 2, 3, 4))
    while steps:
        divisors = [d for d in range(2, min(7, count)) if count % d == 0]
        kind = rng.choice(
            ["receive"]
            + (["give"] if count > 3 else [])
            + (["buy"] if steps >= 2 else [])
            + (["share"] * 2 if steps == 1 and divisors else [])
        )
        if kind == "buy":
            k, m = rng.randint(2, 6), rng.randint(2, 9)
            question.append(f"{He} buys {k} {box} with {m} {item} each.")
            answer.append(f"{He} buys {k} * {m} = {k * m} {item}.")
            answer.append(f"Now {he} has {count} + {k * m} = {count + k * m}.")
            count, steps = count + k * m, steps - 2
            continue
        if kind == "receive":
            x = rng.randint(2, 15)
            question.append(
                rng.choice([f"{friend} gives {him} {x} more.", f"{He} finds {x} more."])
            )
            answer.append(f"{He} gets {x} more: {count} + {x} = {count + x}.")
            count += x
        elif kind == "give":
            y = rng.randint(1, count - 2)
            question.append(f"{He} gives {y} to {friend}.")
            answer.append(f"{He} gives away {y}: {count} - {y} = {count - y}.")
            count -= y
        else:
            d = rng.choice(divisors)
            question.append(f"{He} shares them equally among {d} friends.")
            answer.append(f"Each friend gets {count} / {d} = {count // d}.")
            ending = f"How many {item} does each friend get?"
            count //= d
        steps -= 1
    answer.append(f"#### {count}")
    return {"question": " ".join(question + [ending]), "answer": "\n".join(answer)}
