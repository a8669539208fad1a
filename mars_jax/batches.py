"""Training and evaluation examples: rows -> tokenized chat examples (`build_examples`, one
batched encode, sequences padded to a multiple of the block size) -> index-addressable grain
batches (`batched_dataset`); and the evaluation prompts with their reference answers
(`eval_examples`, `eval_source`)."""

import collections
from typing import NamedTuple, Sequence

import grain
import jinja2
import numpy as np
from absl import logging

from mars_jax.chat_rows import (
    SkipRow,
    assemble,
    chat_segments,
    check_lengths,
    checked_messages,
    row_tools,
    rows_to_messages,
)
from mars_jax.common_types import IGNORE_INDEX
from mars_jax.errors import InputError
from mars_jax.packing import Packed
from mars_jax.rows import SYNTHETIC, load_rows
from mars_jax.tokenizer import ENDOFTEXT_ID, TemplateTimeout


class Example(NamedTuple):
    """One tokenized conversation: input_ids and labels int32[n], and ``row``, the 0-based index
    of its source row among the rows it was built from (`build_examples`; logged with a batch
    whose loss is not finite)."""

    input_ids: np.ndarray
    labels: np.ndarray
    row: int


def build_examples(
    rows,
    tokenizer,
    fmt: str,
    *,
    max_length: int,
    block_size: int,
    all_assistant_turns: bool = False,
    max_label_tokens: int | None = None,
    source_name: str = "",
    truncate: bool = True,
) -> tuple[list[Example], collections.Counter]:
    """Tokenizes rows (see `mars_jax.chat_rows`: `rows_to_messages`, `row_tools` and `tokenize_chat`)
    with one batched encode.

    Skipped rows are counted by reason (those of `tokenize_chat`, plus template_error: the chat
    template raised while rendering the row, and template_timeout: it ran past
    `chat_rows.RENDER_SECONDS`) and logged with `source_name`, as is the number of
    kept rows cut to `max_length` (`truncate`: see `tokenize_chat`).

    Returns:
      (examples, skips): a list of `Example` (input_ids int32[n], labels int32[n], and the
      0-based index of its row in `rows`) and a Counter of skip reasons.
    Raises:
      ValueError: as `tokenize_chat`; or a kept row has more than `max_label_tokens` labelled
        tokens (EOS padding included; the loss computes logits at no more positions per row,
        so such a row cannot be trained on faithfully). The message names source, row and count.
    """
    check_lengths(max_length, block_size)
    skips = collections.Counter()
    kept = []  # (row index, segments)
    for index, row in enumerate(rows):
        try:
            messages, tools = rows_to_messages(row, fmt), row_tools(row, fmt)
            kept.append((index, chat_segments(tokenizer, messages, all_assistant_turns, tools)))
        except SkipRow as e:
            skips[e.reason] += 1
        except TemplateTimeout:  # a template that loops (nearly) for ever on this row
            skips["template_timeout"] += 1
        except jinja2.TemplateError:  # e.g. a template that needs a turn before the assistant's
            skips["template_error"] += 1
    encoded = iter(tokenizer.encode_batch([text for _, segs in kept for text, _ in segs]))
    examples, truncated = [], 0
    for index, segments in kept:
        pieces = [next(encoded) for _ in segments]
        try:
            example = assemble(
                pieces,
                [flag for _, flag in segments],
                max_length=max_length,
                block_size=block_size,
                bos_id=tokenizer.bos_id,
                eos_id=tokenizer.eos_id,
                truncate=truncate,
            )
        except SkipRow as e:
            skips[e.reason] += 1
            continue
        truncated += sum(map(len, pieces)) + bool(segments[0][1]) > max_length  # + BOS
        num_labels = int((example[1] != IGNORE_INDEX).sum())
        if max_label_tokens is not None and num_labels > max_label_tokens:
            raise InputError(
                f"{source_name}: row {index} has {num_labels} labelled tokens, more than "
                f"max_label_tokens={max_label_tokens}"
            )
        examples.append(Example(*example, row=index))
    logging.info(
        "data %s: kept %d of %d rows%s; skipped: %s",
        source_name,
        len(examples),
        len(examples) + sum(skips.values()),
        f" ({truncated} cut to max_length={max_length})" if truncated else "",
        dict(skips) or "none",
    )
    return examples, skips


def _collate(batch: list, *, batch_size: int, max_length: int, pad_id: int, max_rows: int) -> dict:
    """Stacks examples into int32[batch_size, max_length] arrays; missing rows and positions are
    padded with `pad_id` / IGNORE_INDEX. `row_ids` int32[batch_size]: each example's source row,
    -1 for a padding row.

    Packed sequences (`packing.Packed`) add ``positions`` and ``segment_ids`` (0 where padded),
    and their `row_ids` are int32[batch_size, max_rows]: the source row of each segment, -1
    past the last."""
    input_ids = np.full((batch_size, max_length), pad_id, np.int32)
    labels = np.full((batch_size, max_length), IGNORE_INDEX, np.int32)
    if not max_rows:
        row_ids = np.full(batch_size, -1, np.int32)
        for i, (ids, lab, row) in enumerate(batch):
            input_ids[i, : len(ids)], labels[i, : len(lab)], row_ids[i] = ids, lab, row
        return {"input_ids": input_ids, "labels": labels, "row_ids": row_ids}
    positions = np.zeros((batch_size, max_length), np.int32)
    segment_ids = np.zeros((batch_size, max_length), np.int32)
    row_ids = np.full((batch_size, max_rows), -1, np.int32)
    for i, seq in enumerate(batch):
        n = len(seq.input_ids)
        input_ids[i, :n], labels[i, :n] = seq.input_ids, seq.labels
        positions[i, :n], segment_ids[i, :n] = seq.positions, seq.segment_ids
        row_ids[i, : len(seq.rows)] = seq.rows
    return {
        "input_ids": input_ids,
        "labels": labels,
        "positions": positions,
        "segment_ids": segment_ids,
        "row_ids": row_ids,
    }


def batched_dataset(
    examples: list,
    *,
    batch_size: int,
    max_length: int,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
    drop_remainder: bool = True,
    pad_id: int = ENDOFTEXT_ID,
    rows: Sequence[int] | None = None,
) -> grain.MapDataset:
    """A grain MapDataset whose element i is the i-th training batch, or this process's rows
    of it.

    Each element is `{"input_ids": int32[batch_size, max_length], "labels": int32[batch_size,
    max_length], "row_ids": int32[batch_size]}` padded with `pad_id` (`<|endoftext|>`),
    IGNORE_INDEX and -1 (`row_ids`: each example's `Example.row`; host-side only, not a model
    input). ``examples`` may instead be packed sequences (`packing.pack`): then each element
    also holds ``positions`` and ``segment_ids`` and its ``row_ids`` name every segment's row
    (`_collate`), and a "row" of the batch is a packed sequence. Examples are shuffled
    per epoch (grain reseeds the shuffle for every repetition: a different permutation each
    epoch, deterministic in `seed`), batched within an epoch (`drop_remainder` drops an epoch's
    last partial batch; otherwise it is filled with padding rows), and repeated `num_epochs`
    times (forever if None). Being index-addressable, training resumes at step s by reading
    element s.

    `rows` (ascending indices into the batch, e.g. `distributed.process_rows`) makes element i
    hold only those rows of the i-th batch, `[len(rows), max_length]`, in that order; None
    means all. In a multi-process run every process shuffles and batches the same examples
    identically and collates only its rows, so the processes' parts form exactly the batch that
    one process would read. A row past the end of a partial last batch is a padding row.

    Raises:
      ValueError: no examples, an example longer than max_length, fewer examples than
        batch_size with drop_remainder, or rows not ascending within [0, batch_size).
    """
    if not examples or (drop_remainder and len(examples) < batch_size):
        raise InputError(f"{len(examples)} examples cannot fill a batch of {batch_size}")
    if (longest := max(len(e.input_ids) for e in examples)) > max_length:
        raise InputError(f"an example has {longest} tokens, more than max_length={max_length}")
    ds = grain.MapDataset.source(examples)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    rows = range(batch_size) if rows is None else [int(r) for r in rows]
    if any(not 0 <= r < batch_size for r in rows) or list(rows) != sorted(set(rows)):
        raise InputError(f"rows {list(rows)} must be ascending and lie in [0, {batch_size})")

    packed = isinstance(examples[0], Packed)
    max_rows = max(len(e.rows) for e in examples) if packed else 0

    def collate(batch: list) -> dict:
        mine = [batch[r] for r in rows if r < len(batch)]
        return _collate(
            mine, batch_size=len(rows), max_length=max_length, pad_id=pad_id, max_rows=max_rows
        )

    return ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=collate).repeat(num_epochs)


def eval_examples(
    source: str, *, num_examples: int, fmt: str = "gsm8k", seed: int = 0
) -> list[tuple[list[dict], str]]:
    """Evaluation prompts: `(prompt_messages, reference_answer)` for the first `num_examples`
    usable rows of `source` (see `mars_jax.rows.load_rows`; e.g. the GSM8K test split, or
    `"synthetic"` with `seed`). The prompt is every message before the final assistant turn; the
    reference is that turn's content (for GSM8K the worked answer ending in `#### <number>`).
    Rows with `tools`, or whose final turn calls tools, are not usable: the prompt carries no
    tools and the reference is an answer in text."""
    out = []
    for row in load_rows(source, num_rows=num_examples if source == SYNTHETIC else None, seed=seed):
        try:
            messages, last = checked_messages(rows_to_messages(row, fmt))
        except SkipRow:
            continue
        if last == 0 or row_tools(row, fmt) or "tool_calls" in messages[last]:
            continue  # nothing to prompt with, or a tool-use row
        out.append((messages[:last], messages[last]["content"]))
        if len(out) == num_examples:
            break
    return out


def eval_source(cfg) -> tuple[str, str, int]:
    """(source, format, seed) of the evaluation prompts: ``data.eval_path`` read as
    ``data.eval_format`` ("" = as the training data), or, for synthetic training data, held-out
    synthetic problems (another seed)."""
    if cfg.data.source == SYNTHETIC:
        return SYNTHETIC, "gsm8k", cfg.seed + 1
    return cfg.data.eval_path, cfg.data.eval_format or cfg.data.source, cfg.seed
