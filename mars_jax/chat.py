r"""A chat in the terminal with a run or a Hugging Face directory: multi-turn, streamed.

  python -m mars_jax.chat --workdir=runs/mars [--threshold=0.9 --max_new_tokens=256 \
      --system="You are terse." --max_prompt_len=1024]

Each line read from standard input is a user turn. The conversation so far is rendered with the
model's chat template, the answer is printed as the decoder commits it (several tokens can land
in one forward), and a line after it gives the turn's threshold, tokens per forward and tokens
per second. ``/reset`` starts a new conversation, ``/quit`` (or the end of the input) ends.
Every turn decodes one row padded to ``--max_prompt_len`` tokens, so the decoder compiles once
for the session (the first turn pays for it); a conversation longer than that drops its oldest
turns (the system message kept) and says so.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

import numpy as np
from absl import flags

from mars_jax import cli, decode, sources
from mars_jax.decode_options import DecodeOptions
from mars_jax.errors import InputError
from mars_jax.generate import TextStream

COMMANDS = {"/reset": "a new conversation", "/quit": "end the session"}


class Session:
    """One conversation with ``opened`` (`sources.open`) decoded as ``options`` say, each turn
    padded to ``width`` prompt tokens (one compiled program for every turn)."""

    def __init__(
        self,
        opened: sources.Opened,
        options: DecodeOptions,
        *,
        width: int,
        system: str | None = None,
    ):
        self.opened, self.options, self.width = opened, options, width
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict] = []
        self._stream: TextStream | None = None

    def reset(self) -> None:
        self.turns = []

    def _on_accept(self, tokens, counts) -> None:
        """The decoder's ``on_accept``: the turn's committed tokens to its `TextStream`."""
        self._stream(tokens, counts)

    def prompt_ids(self, user: str) -> tuple[list[int], int]:
        """The rendered conversation with ``user``'s turn added, and how many earlier turns
        were dropped so that it fits ``width`` tokens. Raises InputError when the turn alone
        does not fit."""
        tok = self.opened.tokenizer
        turns, dropped = self.turns + [{"role": "user", "content": user}], 0
        while True:
            ids = tok.apply_chat_template(
                self.system + turns, add_generation_prompt=True, content_as_text=True
            )
            if len(ids) <= self.width:
                return ids, dropped
            if len(turns) <= 1:
                raise InputError(
                    f"this turn is {len(ids)} tokens with the system message; the session takes "
                    f"{self.width} (--max_prompt_len)"
                )
            turns, dropped = turns[2:], dropped + 1  # the oldest user turn and its answer

    def turn(self, user: str, write: Callable[[str], None] | None = None) -> dict:
        """Answers ``user``: {"text", "tokens", "tokens_per_forward", "seconds", "dropped"},
        ``write(text)`` receiving the answer as it is committed; the turn and its answer join
        the conversation."""
        ids, dropped = self.prompt_ids(user)
        if dropped:
            self.turns = self.turns[2 * dropped :]
        prompt = np.full((1, self.width), self.opened.pad_id, np.int32)
        prompt[0, : len(ids)] = ids
        to_write = None if write is None else (lambda _, text: write(text))
        stream = self._stream = TextStream(self.opened.tokenizer, 1, self.opened.stop_ids, to_write)
        start = time.perf_counter()
        out = decode.generate(
            self.opened.model,
            prompt,
            np.asarray([len(ids)], np.int32),
            self.options,
            mask_id=self.opened.mask_id,
            eos_ids=self.opened.stop_ids,
            on_accept=self._on_accept,  # one callable for the session: part of the program
        )
        seconds = time.perf_counter() - start
        text = stream.finish()[0]
        self.turns += [{"role": "user", "content": user}, {"role": "assistant", "content": text}]
        return {
            "text": text,
            "tokens": int(out.accepted[0]),
            "tokens_per_forward": float(out.row_tokens_per_forward[0]),
            "seconds": seconds,
            "dropped": dropped,
        }


def status_line(options: DecodeOptions, result: dict) -> str:
    """The line after an answer: threshold, block size, tokens per forward, tokens/s."""
    rate = result["tokens"] / result["seconds"] if result["seconds"] > 0 else 0.0
    return (
        f"[threshold {options.threshold} · block size {options.block_size} · "
        f"{result['tokens_per_forward']:.2f} tokens/forward · {rate:.1f} tokens/s]"
    )


def chat(session: Session, lines: TextIO, out: TextIO) -> int:
    """Runs ``session`` over the user turns of ``lines`` (``/reset``, ``/quit``), writing to
    ``out``; returns the number of turns answered."""
    answered = 0
    for line in lines:
        user = line.rstrip("\n")
        if not user.strip():
            continue
        if user.strip() == "/quit":
            break
        if user.strip() == "/reset":
            session.reset()
            out.write("[a new conversation]\n")
            continue

        def write(text: str) -> None:
            out.write(text)
            out.flush()

        result = session.turn(user, write)
        if result["dropped"]:
            out.write(f"\n[the {result['dropped']} oldest turn(s) dropped to fit]")
        out.write("\n" + status_line(session.options, result) + "\n")
        out.flush()
        answered += 1
    return answered


def main() -> None:
    """``python -m mars_jax.chat --workdir=DIR`` (the module docstring)."""
    workdir = cli.workdir_flag("Run or Hugging Face directory to chat with.")
    decoding = cli.DecodingFlags(
        threshold=0.9,
        max_new_tokens=256,
        budget_help="Answer budget per turn.",
    )
    system = flags.DEFINE_string("system", None, "Optional system message.")
    width = flags.DEFINE_integer(
        "max_prompt_len", 1024, "The conversation's tokens a turn reads (older turns dropped)."
    )
    step = cli.step_flag()

    def run():
        opened, options = decoding.open(workdir.value, step=step.value)
        session = Session(opened, options, width=width.value, system=system.value)
        if sys.stdin.isatty():
            names = ", ".join(f"{c} ({what})" for c, what in COMMANDS.items())
            print(f"chatting with {workdir.value}; {names}", file=sys.stderr)
        chat(session, sys.stdin, sys.stdout)

    cli.run(run)


if __name__ == "__main__":
    main()
