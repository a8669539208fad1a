r"""Generation: complete prompts with a trained run's checkpoint or a Hugging Face directory.

  python -m mars_jax.generate --workdir=runs/mars --prompt="What is 12 * 7?" \
      --threshold=0.95 [--block_size=4 --max_new_tokens=256 --cache_mode sliding --rule prob \
      --stream --json]
  python -m mars_jax.generate --workdir=runs/mars --prompts_file=prompts.jsonl --json
  python -m mars_jax.generate --workdir=hf_out/mars --prompt="What is 12 * 7?"

``--workdir`` is a run or a Hugging Face directory (`mars_jax.sources`).

From Python (`sources.open`, then one `DecodeOptions` at the model's block size)::

  opened = sources.open("runs/mars")
  options = DecodeOptions(block_size=opened.block_size, threshold=0.95)
  generate.complete(opened, ["What is 12 * 7?"], options)

Each prompt is a user turn rendered with the run's chat template; all prompts are decoded as one
batch. ``--prompt`` may be repeated; ``--prompts_file`` is a JSONL file of objects
{"prompt": str, "threshold": float (optional: this row's threshold)}. The CLI prints the
completion, or with several prompts each completion under a header line ``=== [i] 'prompt'
===``, completions separated by a blank line (`format_text`); or with --json one JSON object
per prompt: {"prompt", "tokens" (ids), "text", "tokens_per_forward"}. With --stream the text
is printed as the decoder commits it, one chunk per forward (rows tagged ``[i]`` when there are
several), so several tokens can be seen landing at once.
"""

from __future__ import annotations

import json
import sys
from typing import Callable, Sequence

import numpy as np
from absl import flags

from mars_jax import cli, decode, sources, vocab
from mars_jax.decode_options import DecodeOptions, OptionError
from mars_jax.detokenizer import Detokenizer
from mars_jax.errors import InputError
from mars_jax.rows import read_rows
from mars_jax.tokenizer import Tokenizer


class TextStream:
    """An ``on_accept`` callback for `decode.generate`: each row's newly committed text, one
    `Detokenizer` per row, handed to ``write(row, text)`` after every forward (nothing from a
    row's first stop id on). `finish` (after the decode) writes what was held back (an
    incomplete last character); each row's chunks then add up to `texts`."""

    def __init__(
        self,
        tok: Tokenizer,
        rows: int,
        eos_ids: Sequence[int],
        write: Callable[[int, str], None] | None = None,
    ):
        self.rows = [Detokenizer(tok, stop_ids=eos_ids) for _ in range(rows)]
        self.write = write

    def __call__(self, tokens: np.ndarray, counts: np.ndarray) -> None:
        """tokens int32 [R, C], counts int32 [R]: row r committed tokens[r, :counts[r]]."""
        for r, (row, n) in enumerate(zip(np.asarray(tokens), np.asarray(counts))):
            self._write(r, self.rows[r].add(row[:n].tolist()))

    def add(self, completions: Sequence[Sequence[int]]) -> None:
        """Reads whole completions at once (a decode without ``on_accept``)."""
        for r, ids in enumerate(completions):
            self._write(r, self.rows[r].add(ids))

    def finish(self) -> list[str]:
        """Writes each row's text still held back; returns every row's whole text."""
        for r, row in enumerate(self.rows):
            self._write(r, row.finish())
        return [row.text for row in self.rows]

    def _write(self, row: int, text: str) -> None:
        if text and self.write is not None:
            self.write(row, text)


def complete(
    opened: sources.Opened,
    prompts: Sequence[str],
    options: DecodeOptions,
    *,
    system: str | None = None,
    stream: Callable[[int, str], None] | None = None,
    parse_control_tokens: bool = False,
) -> list[dict]:
    """Decodes ``prompts`` (user messages) as one batch with the model ``opened`` (`sources.open`)
    as ``options`` say (its threshold one value or one per prompt).

    ``system`` is an optional system message; text in a prompt that spells a control token
    stays text unless ``parse_control_tokens``; ``stream(row, text)``, if given, receives each
    row's text as it is committed (`TextStream`: the returned texts are those chunks).
    Returns one dict per prompt: {"prompt" (str), "tokens" (completion ids,
    EOS excluded; Qwen2.5 ids, also for a trimmed run), "text", "tokens_per_forward" (float)}.
    Raises ValueError as `decode.generate`.
    """
    tok = opened.tokenizer
    system_turn = [{"role": "system", "content": system}] if system else []
    ids = [
        tok.apply_chat_template(
            system_turn + [{"role": "user", "content": p}],
            add_generation_prompt=True,
            content_as_text=not parse_control_tokens,
        )
        for p in prompts
    ]
    text_stream = TextStream(tok, len(prompts), opened.stop_ids, stream)
    out = decode.generate(
        opened.model,
        *decode.pad_prompts(ids, opened.pad_id),
        options,
        mask_id=opened.mask_id,
        eos_ids=opened.stop_ids,
        on_accept=None if stream is None else text_stream,
    )
    if stream is None:
        text_stream.add(out.completions())
    texts = text_stream.finish()
    return [
        {
            "prompt": prompt,
            "tokens": vocab.qwen_ids(tok, tokens),
            "text": text,
            "tokens_per_forward": float(tpf),
        }
        for prompt, tokens, text, tpf in zip(
            prompts, out.completions(), texts, out.row_tokens_per_forward
        )
    ]


def format_text(results: Sequence[dict]) -> str:
    """The plain-text CLI output of `complete`'s ``results``: one result's text alone; several
    results each under a header line ``=== [i] 'prompt' ===`` (the prompt as a Python literal,
    so it stays on one line) and separated by a blank line, so completions never run together
    (an empty completion is an empty line under its header)."""
    if len(results) == 1:
        return results[0]["text"]
    return "\n\n".join(f"=== [{i}] {r['prompt']!r} ===\n{r['text']}" for i, r in enumerate(results))


def read_prompts(path: str) -> tuple[list[str], list[float | None]]:
    """The prompts of a JSONL file of {"prompt": str, "threshold": float (optional)} objects:
    (prompts, thresholds with None where a row gives none). Raises ValueError naming the file and
    the row for a missing or non-string prompt, or a threshold that is not a number in (0, 1]
    (a JSON true is not a number here)."""
    prompts, thresholds = [], []
    for i, row in enumerate(read_rows(path), start=1):
        prompt, threshold = row.get("prompt"), row.get("threshold")
        if not isinstance(prompt, str):
            raise InputError(f"{path}: row {i}: 'prompt' must be a string, got {prompt!r}")
        if threshold is not None and (
            isinstance(threshold, bool) or not isinstance(threshold, (int, float))
        ):
            raise InputError(f"{path}: row {i}: 'threshold' must be a number, got {threshold!r}")
        if threshold is not None:
            try:
                DecodeOptions(threshold=threshold)  # the one check of the range
            except OptionError as e:
                raise InputError(f"{path}: row {i}: 'threshold' {e.reason}, got {threshold!r}")
        prompts.append(prompt)
        thresholds.append(threshold)
    return prompts, thresholds


def main() -> None:
    """``python -m mars_jax.generate --workdir=DIR --prompt=TEXT [--prompt=TEXT ...]``."""
    workdir = cli.workdir_flag()
    prompt = flags.DEFINE_multi_string("prompt", None, "User message(s).")
    prompts_file = flags.DEFINE_string(
        "prompts_file", None, 'JSONL file of {"prompt": str, "threshold": float (optional)}.'
    )
    system = flags.DEFINE_string("system", None, "Optional system message.")
    decoding = cli.DecodingFlags(
        threshold=0.95,
        max_new_tokens=256,
        budget_help="Completion budget per prompt.",
    )
    step = cli.step_flag()
    as_json = flags.DEFINE_bool("json", False, "Print one JSON object per prompt.")
    stream = flags.DEFINE_bool("stream", False, "Print text as it is committed, per forward.")
    parse = flags.DEFINE_bool(
        "parse_control_tokens",
        False,
        "Read <|im_end|> etc. written in a prompt as control tokens (default: as text).",
    )

    def run():
        prompts, thresholds = list(prompt.value or []), [None] * len(prompt.value or [])
        if prompts_file.value:
            more, more_thresholds = read_prompts(prompts_file.value)
            prompts, thresholds = prompts + more, thresholds + more_thresholds
        if not prompts:
            raise InputError("give at least one --prompt or a --prompts_file")
        tagged = len(prompts) > 1

        def write(row: int, text: str) -> None:
            sys.stdout.write(f"[{row}] {text!r}\n" if tagged else text)
            sys.stdout.flush()

        per_row = tuple(decoding.threshold.value if t is None else t for t in thresholds)
        opened, options = decoding.open(workdir.value, step=step.value, threshold=per_row)
        results = complete(
            opened,
            prompts,
            options,
            system=system.value,
            stream=write if stream.value else None,
            parse_control_tokens=parse.value,
        )
        if stream.value and not tagged:
            print()
        if as_json.value:
            for result in results:
                print(json.dumps(result))
        elif not stream.value:
            print(format_text(results))

    cli.run(run)


if __name__ == "__main__":
    main()
