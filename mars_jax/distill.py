r"""Self-distillation data: a chat SFT set of a model's own answers to a set of prompts, so that a
user with a model and prompts but no SFT set can train MARS on what the model itself would say.

  python -m mars_jax.distill --workdir=models/smollm2 \
      --rows=../shared/data/gsm8k/train.jsonl --format=gsm8k \
      --output=runs/distill/smollm2_gsm8k_train.jsonl [--batch_size=32 --max_new_tokens=256 \
      --limit=N]
  python -m mars_jax.train --config=configs/smollm2_curve.py:self ...   # trains on it

``--workdir`` is a run or a Hugging Face directory (`mars_jax.sources`). Each input row gives a
prompt: format ``gsm8k`` its ``question`` as the user turn; format ``messages`` its ``messages``
without a final assistant turn (and its ``tools``). The prompts are rendered with the model's
chat template and decoded in batches of ``--batch_size`` (greedy AR by default: threshold 1.0 at
block size 1, the output a MARS model gives at threshold 1.0 too, at the cheapest step), and
each answer is written as one row ``{"messages": [...prompt turns, {"role": "assistant",
"content": answer}], "source_row": i}`` (plus the row's ``tools``), in input order: the
``messages`` format of ``data.source="messages"``.

Every row written is one training accepts (`chat_rows.chat_segments`, the check training runs),
and its prompt is decoded as training tokenizes it. Not written, counted by reason and logged:
prompts training would skip (``missing_field``, ``non_string_content``, ``bad_tools``, ... as
`tokenize_chat` names them; ``template_timeout``), ``prompt_too_long`` (over
``--max_prompt_tokens``), ``budget`` (the answer did not end within ``--max_new_tokens``: cut
answers would teach the model to stop mid-way), ``empty`` answers and answers training would
skip (e.g. ``special_token_in_content``: text spelling ``<|im_end|>``); lines of the rows file
that hold no row, up to 1% of them (`rows.read_rows`).

Resumable: the output and ``OUTPUT.progress.json`` are written before the first batch, then after
each batch the rows are flushed and the progress file records the input rows done, the counts,
the output's size and the decoding time. A rerun with the same flags goes on from there (a
batch cut short by a kill is dropped from the output and decoded again), and one with a larger
``--limit`` goes on past it. A rerun with other settings or a changed rows file, an output
without its progress file, or one shorter than the progress file says, is refused rather than
mixed. Local files only.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from typing import Any, Sequence

import numpy as np
from absl import flags, logging

from mars_jax import cli, decode
from mars_jax.chat_rows import SkipRow, chat_segments, rows_to_messages
from mars_jax.decode_options import DecodeOptions
from mars_jax.errors import AlreadyExists, InputError
from mars_jax.rows import read_rows
from mars_jax.sources import Opened
from mars_jax.tokenizer import TemplateTimeout

FORMATS = ("gsm8k", "messages")


@dataclasses.dataclass
class Prompt:
    """One input row's prompt: its index in the input file, its turns (and tools), its ids."""

    row: int
    messages: list[dict]
    tools: Any  # the row's tools as given (a list, or a string holding one), or None
    ids: list[int]


def prompt_messages(row: dict, fmt: str) -> list[dict]:
    """The turns of ``row`` that make its prompt: ``fmt`` ``gsm8k``, the question as a user turn;
    ``messages``, the row's turns without a final assistant turn. Raises SkipRow
    ("missing_field") for a row that has none."""
    if fmt == "gsm8k":
        if not isinstance(row.get("question"), str):
            raise SkipRow("missing_field")
        return [{"role": "user", "content": row["question"]}]
    messages = list(rows_to_messages(row, fmt))
    if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        messages = messages[:-1]
    if not messages:
        raise SkipRow("missing_field")
    return messages


def trainable(tok, messages: list[dict], tools) -> str:
    """The text of ``messages``' (and ``tools``') conversation up to its final assistant turn's
    generation prompt, as training renders it (`chat_rows.chat_segments`: the same checks).
    Raises SkipRow with training's reason for a conversation training would skip, and
    ("template_timeout") for a template that does not finish."""
    try:
        return chat_segments(tok, messages, False, tools)[0][0]
    except TemplateTimeout:
        raise SkipRow("template_timeout") from None


def read_prompts(
    path: str,
    fmt: str,
    tok,
    *,
    max_prompt_tokens: int,
    limit: int | None,
    skips: collections.Counter,
) -> list[Prompt]:
    """The prompts of the first ``limit`` rows (None: all) of the rows file ``path``, as training
    renders and tokenizes them (`trainable`, with a placeholder answer). Rows without a prompt,
    that training would skip or longer than ``max_prompt_tokens`` are counted in ``skips``;
    InputError (naming the format's field) when no row gives a prompt."""
    if fmt not in FORMATS:
        raise InputError(f"--format: {fmt!r}; expected one of {FORMATS}")
    rows = read_rows(path, max_bad_fraction=0.01, skips=skips)
    prompts = []
    for i, row in enumerate(rows[:limit] if limit is not None else rows):
        try:
            messages = prompt_messages(row, fmt)
            tools = row.get("tools") if fmt == "messages" else None
            text = trainable(tok, messages + [{"role": "assistant", "content": "x"}], tools)
        except SkipRow as e:
            skips[e.reason] += 1
            continue
        except InputError as e:
            raise InputError(f"{path}: row {i + 1}: {e}") from None
        ids = tok.encode(text)
        if len(ids) > max_prompt_tokens:
            skips["prompt_too_long"] += 1
            continue
        prompts.append(Prompt(i, messages, tools, ids))
    if not prompts:
        fields = {"gsm8k": "question", "messages": "messages"}
        other = "messages" if fmt == "gsm8k" else "gsm8k"
        hint = ""
        if rows and isinstance(rows[0], dict) and fields[other] in rows[0]:
            hint = f" (its first row has {fields[other]!r}: --format={other}?)"
        raise InputError(
            f"{path}: none of its {len(rows)} rows gives a prompt (skipped: {dict(skips)}); "
            f"--format={fmt} reads {fields[fmt]!r} from each row{hint}"
        )
    return prompts


def answer_rows(
    opened: Opened,
    batch: Sequence[Prompt],
    out: decode.DecodeOutput,
    budget: int,
    skips: collections.Counter,
) -> list[dict]:
    """The rows to write for ``batch``'s decode ``out``: answers that ended (an EOS within
    ``budget`` tokens), are not empty and that training accepts (`trainable`); the others
    counted in ``skips``."""
    rows = []
    for prompt, ids, length in zip(batch, out.completions(), out.lengths):
        if length >= budget:  # no stop id within the budget
            skips["budget"] += 1
            continue
        text = opened.tokenizer.decode(ids)
        if not text.strip():
            skips["empty"] += 1
            continue
        row = {"messages": prompt.messages + [{"role": "assistant", "content": text}]}
        if prompt.tools:
            row["tools"] = prompt.tools
        try:
            trainable(opened.tokenizer, row["messages"], prompt.tools)
        except SkipRow as e:
            skips[e.reason] += 1
            continue
        rows.append({**row, "source_row": prompt.row})
    return rows


class Progress:
    """``OUTPUT.progress.json``: the settings, input rows done, rows written, answers skipped by
    reason (``skips``) and the output's size after the last whole batch. `resume` cuts the
    output back to that size (a batch a kill left half written); `save` records a batch after
    its rows are on disk."""

    def __init__(self, output: str, settings: dict):
        self.output, self.path, self.settings = output, output + ".progress.json", settings
        self.done, self.written, self.size, self.seconds = 0, 0, 0, 0.0
        self.skips: collections.Counter = collections.Counter()

    def resume(self) -> None:
        if output_exists := os.path.exists(self.output):
            if not os.path.exists(self.path):
                raise AlreadyExists(
                    f"{self.output}: exists without {self.path}; give a new --output (or remove "
                    "it) rather than mixing rows into a file this program did not write"
                )
        if not os.path.exists(self.path):
            self.save(0, [])  # the output and its progress file exist from now on
            return
        try:
            with open(self.path) as f:
                saved = json.load(f)
        except json.JSONDecodeError as e:
            raise InputError(f"{self.path}: not a progress file ({e}); give a new --output")
        for key, value in self.settings.items():
            if saved["settings"].get(key) != value:
                raise InputError(
                    f"{self.path}: this output was made with {key}={saved['settings'].get(key)!r}, "
                    f"not {value!r}; give a new --output, or the same settings to resume"
                )
        self.done, self.written, self.size = saved["done"], saved["written"], saved["size"]
        self.seconds = saved.get("seconds", 0.0)
        self.skips.update(saved["skipped"])
        size = os.path.getsize(self.output) if output_exists else None
        if size is None or size < self.size:
            raise InputError(
                f"{self.output}: {'missing' if size is None else f'{size} bytes'}, but "
                f"{self.path} records {self.size} bytes written; give a new --output"
            )
        with open(self.output, "r+b") as f:
            f.truncate(self.size)
        logging.info(
            "%s: resuming after %d input rows (%d written)", self.output, self.done, self.written
        )

    def save(self, rows_done: int, rows: list[dict], seconds: float = 0.0) -> None:
        """Appends ``rows`` (the answers of the input rows before ``rows_done``, decoded in
        ``seconds``), then records them."""
        with open(self.output, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
            f.flush()
            os.fsync(f.fileno())
        self.done, self.written = rows_done, self.written + len(rows)
        self.seconds += seconds
        self.size = os.path.getsize(self.output)
        state = {
            "settings": self.settings,
            "done": self.done,
            "written": self.written,
            "size": self.size,
            "skipped": dict(self.skips),
            "seconds": round(self.seconds, 1),
        }
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(state, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def distill(
    opened: Opened,
    prompts: Sequence[Prompt],
    options: DecodeOptions,
    progress: Progress,
    *,
    batch_size: int,
    seed: int = 0,
) -> None:
    """Decodes ``prompts`` past ``progress.done`` input rows in batches of ``batch_size`` and
    appends their answer rows to the output, recording each batch in ``progress``. Every batch
    has the shape [batch_size, longest prompt], so the decoder compiles once; prompt i samples
    with seed ``seed + its input row`` (greedy ignores it), so a resumed run writes what one
    uninterrupted run would."""
    todo = [p for p in prompts if p.row >= progress.done]
    width = max((len(p.ids) for p in prompts), default=1)
    tokens, spent = 0, 0.0  # this process's
    for b in range(0, len(todo), batch_size):
        start = time.time()
        batch = todo[b : b + batch_size]
        ids = np.full((batch_size, width), opened.pad_id, np.int32)
        lengths = np.ones((batch_size,), np.int32)
        seeds = np.zeros((batch_size,), np.int64)
        for r, p in enumerate(batch):
            ids[r, : len(p.ids)], lengths[r], seeds[r] = p.ids, len(p.ids), seed + p.row
        out = decode.generate(
            opened.model,
            ids,
            lengths,
            options,
            seed=seeds,
            eos_ids=opened.stop_ids,
            mask_id=opened.mask_id,
        )
        rows = answer_rows(opened, batch, out, options.max_new_tokens, progress.skips)
        following = todo[b + batch_size].row if b + batch_size < len(todo) else None
        took = time.time() - start
        spent += took
        progress.save(following if following is not None else batch[-1].row + 1, rows, took)
        tokens += int(out.lengths[: len(batch)].sum())
        logging.info(
            "%d / %d prompts, %d rows written, skipped %s, %.1f h, %.0f answer tokens/s",
            min(b + batch_size, len(todo)),
            len(todo),
            progress.written,
            dict(progress.skips),
            progress.seconds / 3600,
            tokens / max(spent, 1e-9),
        )


def main() -> None:
    """``python -m mars_jax.distill --workdir=MODEL --rows=FILE --output=FILE.jsonl``."""
    workdir = cli.workdir_flag("A run or a Hugging Face directory, the model that answers.")
    rows = flags.DEFINE_string("rows", None, "Rows file (.jsonl / .json / .parquet) of prompts.")
    fmt = flags.DEFINE_enum("format", "messages", FORMATS, "Row format of --rows.")
    output = flags.DEFINE_string("output", None, "JSONL file the answer rows are appended to.")
    batch_size = flags.DEFINE_integer("batch_size", 32, "Prompts decoded together.")
    limit = flags.DEFINE_integer("limit", None, "Only the first N rows of --rows.")
    max_prompt = flags.DEFINE_integer(
        "max_prompt_tokens", 1024, "Longer prompts are skipped (prompt_too_long)."
    )
    seed = flags.DEFINE_integer("seed", 0, "Sampling seed (with --temperature > 0).")
    decoding = cli.DecodingFlags(
        threshold=1.0,
        max_new_tokens=256,
        budget_help="Answer budget: answers that do not end within it are skipped (budget).",
    )
    step = cli.step_flag()

    def run():
        if not rows.value or not output.value:
            raise InputError("give --rows (the prompts) and --output (the answer rows)")
        if "://" in output.value:
            raise InputError(f"--output: {output.value}; local files only (resumed in place)")
        if batch_size.value < 1:
            raise InputError(f"--batch_size: {batch_size.value}; must be at least 1")
        if limit.value is not None and limit.value < 0:
            raise InputError(f"--limit: {limit.value}; must be 0 or more")
        if not 0 <= seed.value < 2**32:
            raise InputError(f"--seed: {seed.value}; must lie in 0..2**32-1")
        # Threshold 1.0 is greedy AR whatever the block size: decode it at block size 1.
        block_size = decoding.block_size.value or (1 if decoding.threshold.value == 1.0 else None)
        opened, options = decoding.open(workdir.value, step=step.value, block_size=block_size)
        settings = {
            "workdir": os.path.abspath(workdir.value),
            "step": opened.step,
            "rows": os.path.abspath(rows.value),
            "rows_bytes": os.path.getsize(rows.value) if os.path.exists(rows.value) else None,
            "format": fmt.value,
            "max_prompt_tokens": max_prompt.value,
            "seed": seed.value,
            "batch_size": batch_size.value,
            **{
                k: getattr(options, k)
                for k in (
                    "threshold",
                    "block_size",
                    "max_new_tokens",
                    "temperature",
                    "top_p",
                    "cache_mode",
                    "rule",
                )
            },
        }
        skipped: collections.Counter = collections.Counter()  # prompts: counted on every run
        prompts = read_prompts(
            rows.value,
            fmt.value,
            opened.tokenizer,
            max_prompt_tokens=max_prompt.value,
            limit=limit.value,
            skips=skipped,
        )
        if seed.value + prompts[-1].row >= 2**32:
            raise InputError(f"--seed: {seed.value} + row {prompts[-1].row} is past 2**32-1")
        os.makedirs(os.path.dirname(os.path.abspath(output.value)), exist_ok=True)
        progress = Progress(output.value, settings)
        progress.resume()
        distill(opened, prompts, options, progress, batch_size=batch_size.value, seed=seed.value)
        skipped.update(progress.skips)
        print(
            json.dumps(
                {
                    "output": output.value,
                    "rows": progress.written,
                    "skipped": dict(skipped),
                    "hours": round(progress.seconds / 3600, 3),
                }
            )
        )

    cli.run(run)


if __name__ == "__main__":
    main()
