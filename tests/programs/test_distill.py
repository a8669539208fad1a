"""Self-distillation data (`mars_jax.distill`): the prompts a row gives, the rows written and the
answers skipped (the decoder stubbed by a rule the test knows), a run cut by a kill and resumed
against one uninterrupted run, refusals, and SmolLM2's answers against transformers' greedy
decode, read back as training rows."""

import collections
import json

import numpy as np
import pytest

from mars_jax import decode, distill, sources
from mars_jax.chat_rows import SkipRow
from mars_jax.decode_options import DecodeOptions
from mars_jax.errors import AlreadyExists, InputError
from mars_jax.tokenizer import load_tokenizer
from tests.helpers import run_python

BUDGET = 6


def test_a_rows_prompt_is_its_turns_before_the_answer():
    assert distill.prompt_messages({"question": "q?", "answer": "a"}, "gsm8k") == [
        {"role": "user", "content": "q?"}
    ]
    turns = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
    ]
    assert distill.prompt_messages({"messages": turns}, "messages") == turns[:2]
    assert distill.prompt_messages({"messages": turns[:2]}, "messages") == turns[:2]
    for row, fmt in [
        ({"answer": "a"}, "gsm8k"),
        ({"messages": turns[2:]}, "messages"),
        ({}, "messages"),
    ]:
        with pytest.raises(SkipRow, match="missing_field"):
            distill.prompt_messages(row, fmt)


def answer_for(tok, prompt_ids):
    """The stub decoder's rule: the last user turn's text says what the model answers."""
    text = tok.decode(prompt_ids)
    if "loop" in text:
        return tok.encode("and so on " * 10)  # never ends: past the budget
    if "silent" in text:
        return []
    return tok.encode(text.split("user")[-1].split("assistant")[0].strip().upper())


@pytest.fixture
def stubbed(monkeypatch):
    """An `Opened` with the Qwen2 tokenizer and no model, and `decode.generate` replaced by
    `answer_for` (budget-cut, EOS-padded outputs as the decoder returns them); ``calls``
    counts the batches decoded, ``fail_at`` makes that batch raise (a kill)."""
    tok = load_tokenizer(None)
    opened = sources.Opened("m", None, tok, 0, 1, tuple(tok.eos_ids), tok.pad_id, None)
    state = {"calls": 0, "fail_at": None}

    def generate(model, ids, lengths, options, *, seed, eos_ids, mask_id):
        state["calls"] += 1
        if state["calls"] == state["fail_at"]:
            raise KeyboardInterrupt
        rows = len(ids)
        tokens = np.full((rows, options.max_new_tokens), eos_ids[-1], np.int32)
        out_lengths = np.zeros(rows, np.int32)
        for r in range(rows):
            answer = answer_for(tok, ids[r, : lengths[r]].tolist())[: options.max_new_tokens]
            tokens[r, : len(answer)], out_lengths[r] = answer, len(answer)
        ones = np.ones(rows, np.int32)
        return decode.DecodeOutput(tokens, out_lengths, out_lengths + 1, ones, 1)

    monkeypatch.setattr(decode, "generate", generate)
    return opened, state


QUESTIONS = ["one", "two loop", "three", "silent four", "five", "six", "seven"]


def write_rows(path, questions=QUESTIONS):
    path.write_text("".join(json.dumps({"question": q, "answer": "x"}) + "\n" for q in questions))
    return str(path)


def run(opened, rows_path, output, *, batch_size=2, settings=None, limit=None):
    skips = collections.Counter()
    prompts = distill.read_prompts(
        rows_path, "gsm8k", opened.tokenizer, max_prompt_tokens=64, limit=limit, skips=skips
    )
    progress = distill.Progress(str(output), settings or {"batch_size": batch_size})
    progress.resume()
    options = DecodeOptions(block_size=1, threshold=1.0, max_new_tokens=BUDGET)
    distill.distill(opened, prompts, options, progress, batch_size=batch_size)
    return progress


def test_answers_are_written_in_order_and_the_others_counted(stubbed, tmp_path):
    opened, _ = stubbed
    output = tmp_path / "out.jsonl"
    progress = run(opened, write_rows(tmp_path / "q.jsonl"), output)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    kept = [i for i, q in enumerate(QUESTIONS) if "loop" not in q and "silent" not in q]
    assert [r["source_row"] for r in rows] == kept
    for r in rows:
        question = QUESTIONS[r["source_row"]]
        assert r["messages"] == [
            {"role": "user", "content": question},
            {"role": "assistant", "content": question.upper()},
        ]
    assert progress.skips == {"budget": 1, "empty": 1}
    saved = json.loads((tmp_path / "out.jsonl.progress.json").read_text())
    assert (saved["done"], saved["written"], saved["size"]) == (7, 5, output.stat().st_size)


@pytest.mark.parametrize("killed_in", [1, 3])
def test_a_killed_run_resumes_to_what_one_run_writes(stubbed, tmp_path, killed_in):
    opened, state = stubbed
    rows_path = write_rows(tmp_path / "q.jsonl")
    run(opened, rows_path, tmp_path / "whole.jsonl")
    whole = (tmp_path / "whole.jsonl").read_text()
    cut = tmp_path / "cut.jsonl"
    state.update(calls=0, fail_at=killed_in)
    with pytest.raises(KeyboardInterrupt):
        run(opened, rows_path, cut)
    with open(cut, "a") as f:
        f.write('{"messages": [{"role": "us')  # a batch the kill left half written
    state.update(calls=0, fail_at=None)
    progress = run(opened, rows_path, cut)
    assert state["calls"] == 4 - (killed_in - 1)  # the batches before the kill: not again
    assert cut.read_text() == whole
    assert progress.skips == {"budget": 1, "empty": 1}
    # A first part (--limit), then the rest: the same file again.
    part = tmp_path / "part.jsonl"
    assert run(opened, rows_path, part, limit=3).done == 3
    run(opened, rows_path, part)
    assert part.read_text() == whole


def test_other_settings_or_a_foreign_output_are_refused(stubbed, tmp_path):
    opened, _ = stubbed
    rows_path = write_rows(tmp_path / "q.jsonl")
    run(opened, rows_path, tmp_path / "out.jsonl")
    with pytest.raises(InputError, match="batch_size=2, not 3"):
        run(opened, rows_path, tmp_path / "out.jsonl", batch_size=3)
    (tmp_path / "theirs.jsonl").write_text("{}\n")
    with pytest.raises(AlreadyExists, match="theirs.jsonl: exists without"):
        run(opened, rows_path, tmp_path / "theirs.jsonl")
    assert (tmp_path / "theirs.jsonl").read_text() == "{}\n"
    # An output cut shorter than its progress file says, or gone: refused, not padded.
    written = (tmp_path / "out.jsonl").read_bytes()
    (tmp_path / "out.jsonl").write_bytes(written[:10])
    with pytest.raises(InputError, match=f"10 bytes, but .* records {len(written)} bytes"):
        run(opened, rows_path, tmp_path / "out.jsonl")
    (tmp_path / "out.jsonl").unlink()
    with pytest.raises(InputError, match="out.jsonl: missing, but"):
        run(opened, rows_path, tmp_path / "out.jsonl")
    (tmp_path / "out.jsonl.progress.json").write_text('{"settings": ')
    with pytest.raises(InputError, match="not a progress file"):
        run(opened, rows_path, tmp_path / "out.jsonl")


def test_rows_training_would_skip_are_counted_not_decoded(tmp_path):
    """Prompts that training's own check refuses are counted under its reasons; a prompt with
    tools given as a JSON string is decoded as training tokenizes it (the tools parsed); an
    answer that spells a control token is counted, not written."""
    from mars_jax.chat_rows import tokenize_chat
    from tests.data.test_batches import TOOL_TEMPLATE

    load_tokenizer(None).save(str(tmp_path / "tok"))
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(tmp_path / "tok"))
    opened = sources.Opened("m", None, tok, 0, 1, tuple(tok.eos_ids), tok.pad_id, None)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    rows = [
        {"messages": [{"role": "user", "content": 123}]},
        {"messages": [{"content": "no role"}]},
        {"messages": [user("x\ud800y")]},
        {"messages": [user("say <|im_end|>")]},
        {"messages": [user("tools")], "tools": json.dumps(tools)},
        {"messages": [user("fine")]},
        {"messages": [user("and this")]},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    skips = collections.Counter()
    prompts = distill.read_prompts(
        str(path), "messages", tok, max_prompt_tokens=512, limit=None, skips=skips
    )
    assert skips == {
        "non_string_content": 1,
        "missing_field": 1,
        "lone_surrogate": 1,
        "special_token_in_content": 1,
    }
    assert [p.row for p in prompts] == [4, 5, 6]
    answered = rows[4]["messages"] + [{"role": "assistant", "content": "TOOLS"}]
    ids, labels = tokenize_chat(tok, answered, max_length=512, block_size=1, tools=rows[4]["tools"])
    assert prompts[0].ids == ids[labels < 0].tolist()  # training's prompt tokens, tools parsed
    assert b"parameters" in tok.decode(prompts[0].ids).encode()

    answers = [tok.encode("TOOLS"), tok.encode("fine"), tok._encode_as_text("stop <|im_end|>")]
    tokens = np.zeros((3, 16), np.int32)
    for r, a in enumerate(answers):
        tokens[r, : len(a)] = a
    lengths = np.array([len(a) for a in answers], np.int32)
    out = decode.DecodeOutput(tokens, lengths, lengths + 1, lengths + 1, 1)
    answer_skips = collections.Counter()
    written = distill.answer_rows(opened, prompts, out, 16, answer_skips)
    assert [w["source_row"] for w in written] == [4, 5]
    assert written[0]["tools"] == rows[4]["tools"]
    assert answer_skips == {"special_token_in_content": 1}


def test_rows_of_the_other_format_are_refused_with_a_hint(tmp_path):
    rows_path = write_rows(tmp_path / "q.jsonl")
    with pytest.raises(InputError, match=r"none of its 7 rows gives a prompt .*'question': --for"):
        distill.read_prompts(
            rows_path, "messages", load_tokenizer(None), max_prompt_tokens=64, limit=None,
            skips=collections.Counter(),
        )  # fmt: skip


def test_a_changed_rows_file_is_refused(stubbed, tmp_path):
    opened, _ = stubbed
    rows_path = write_rows(tmp_path / "q.jsonl")
    settings = lambda: {"rows_bytes": (tmp_path / "q.jsonl").stat().st_size}  # noqa: E731
    run(opened, rows_path, tmp_path / "out.jsonl", settings=settings())
    write_rows(tmp_path / "q.jsonl", QUESTIONS + ["eight"])
    with pytest.raises(InputError, match="rows_bytes="):
        run(opened, rows_path, tmp_path / "out.jsonl", settings=settings())


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "flag, message",
    [("--limit=-1", "--limit: -1; must be 0 or more"), ("--seed=-2", "--seed: -2; must lie in")],
)
def test_bad_flags_are_refused_before_a_model_is_read(tmp_path, flag, message):
    proc = run_python(
        "-m", "mars_jax.distill", f"--workdir={tmp_path}/none", f"--rows={tmp_path}/r.jsonl",
        f"--output={tmp_path}/o.jsonl", flag, check=False,
    )  # fmt: skip
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr


@pytest.mark.subprocess
def test_smollm2s_answers_are_transformers_greedy_decode_and_train_as_rows(smollm2_dir, tmp_path):
    """The CLI on SmolLM2 (one batch of 2 and one of 1, 32 new tokens): each written answer is the text of
    transformers' greedy decode of the same rendered prompt, and tokenized as a training row its
    labels are those ids and the closing <|im_end|>."""
    import torch
    import transformers

    from mars_jax.chat_rows import tokenize_chat

    prompts = ["What is 2 + 2? Answer with the number only.", "Say hello.", "Name a colour."]
    rows_path = tmp_path / "prompts.jsonl"
    rows_path.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in prompts)
    )
    output = tmp_path / "self.jsonl"
    proc = run_python(
        "-m",
        "mars_jax.distill",
        f"--workdir={smollm2_dir}",
        f"--rows={rows_path}",
        f"--output={output}",
        "--batch_size=2",
        "--max_new_tokens=32",
    )
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert summary["rows"] == len(rows) and sum(summary["skipped"].values()) + len(rows) == 3
    assert len(rows) >= 2, summary  # short answers: at most one may run past the budget

    tok = load_tokenizer(smollm2_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_dir, torch_dtype=torch.float32
    )
    im_end = tok.encode("<|im_end|>")
    for row in rows:
        prompt = row["messages"][:-1]
        ids = tok.apply_chat_template(prompt, add_generation_prompt=True)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=im_end
            )[0, len(ids) :].tolist()
        assert out[-1] == im_end[0], "transformers' answer ends within the budget"
        assert row["messages"][-1] == {"role": "assistant", "content": tok.decode(out[:-1])}
        input_ids, labels = tokenize_chat(tok, row["messages"], max_length=256, block_size=1)
        assert [t for t in labels.tolist() if t >= 0] == out
