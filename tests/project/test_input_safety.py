"""Nothing read from a checkpoint, tokenizer, config override or data file runs code.

Each hostile input carries a payload that creates a marker file when it is run (unpickled,
imported, evaluated); the tests assert that our loaders refuse or ignore it and that the marker
never appears, and check, as the oracle that the test can fail, that running the payload the
way an unsafe loader would does create its marker.
"""

import json
import pickle
import re
import runpy
import time
from pathlib import Path

import jax
import jinja2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from absl import flags
from flax import nnx
from ml_collections import config_flags

from mars_jax import chat_rows, huggingface, sharding
from mars_jax import tokenizer as T
from mars_jax.batches import build_examples
from mars_jax.model import CausalLM, ModelConfig, abstract_params
from mars_jax.rows import read_rows
from tests.helpers import make_hf_model, run_python

REPO = Path(__file__).resolve().parents[2]
TINY = ModelConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
_real_loads = pickle.loads


class _Touch:
    """Unpickling this creates the file ``path``: a stand-in for any code a pickle runs."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _touch_module(path, marker):
    """Writes a Python module at ``path`` whose import creates ``marker``."""
    path.write_text(f"open({str(marker)!r}, 'w').close()\n")


@pytest.fixture
def no_unpickling(monkeypatch):
    """Fails the test on any call of pickle's or torch's loaders (also the restricted
    ``torch.load(weights_only=True)``, which the marker payload alone would not reveal)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a loader unpickled a file")

    for module, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)


def _all_loaders(path):
    """Every public way of loading the HF directory ``path``, each a thunk."""
    abstract = abstract_params(TINY, sharding.make_mesh(), sharding.logical_rules())[1]
    return {
        "read_hf_config": lambda: huggingface.read_hf_config(path),
        "load_hf": lambda: huggingface.load_hf(path),
        "load_hf_state": lambda: huggingface.load_hf_state(path, TINY),
        "load_hf_sharded": lambda: huggingface.load_hf_sharded(path, TINY, abstract),
    }


@pytest.mark.parametrize(
    "files",
    [
        ["pytorch_model.bin"],
        ["model.pt"],
        ["weights.pth"],
        ["last.ckpt"],
        ["pytorch_model.bin.index.json", "pytorch_model-00001-of-00001.bin"],
    ],
)
def test_pickled_weights_are_refused_unopened(tmp_path, files, no_unpickling):
    marker = tmp_path / "unpickled"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(huggingface.config_to_hf(TINY)))
    payload = pickle.dumps(_Touch(marker))
    for name in files:
        (ckpt / name).write_bytes(payload)
    for loader, load in _all_loaders(str(ckpt)).items():
        with pytest.raises(FileNotFoundError) as err:
            load()
        message = str(err.value)
        assert "\n" not in message, loader
        assert message.startswith(
            f"{ckpt}: no model.safetensors, only pickle-based weights ({', '.join(sorted(files))})"
        ), loader
        assert "pickle" in message and "save_pretrained(d)" in message, loader
    assert not marker.exists()
    _real_loads(payload)  # the oracle: unpickling the file would have run its payload
    assert marker.exists()


def test_an_index_naming_a_pickle_shard_is_refused(tmp_path, no_unpickling):
    marker = tmp_path / "unpickled"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(huggingface.config_to_hf(TINY)))
    (ckpt / "pytorch_model.bin").write_bytes(pickle.dumps(_Touch(marker)))
    tensors = ["model.embed_tokens.weight", "model.norm.weight"]
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps(
            {"weight_map": {tensors[0]: "model.safetensors", tensors[1]: "pytorch_model.bin"}}
        )
    )
    for loader, load in _all_loaders(str(ckpt)).items():
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"{ckpt}/model.safetensors.index.json: weight_map names 'pytorch_model.bin', "
                "not a .safetensors file"
            ),
        ):
            load()
    assert not marker.exists()


@pytest.mark.subprocess
def test_the_conversion_command_in_the_message_converts_a_pytorch_checkpoint(tmp_path):
    """A genuine ``torch.save`` checkpoint: the command our error prints turns it into one
    that loads to the same parameters as transformers' own safetensors of that model."""
    model = make_hf_model(seed=5, tie_word_embeddings=False)
    ckpt, plain = tmp_path / "torch", tmp_path / "plain"
    model.config.save_pretrained(ckpt)
    torch.save(model.state_dict(), ckpt / "pytorch_model.bin")
    model.save_pretrained(plain)
    with pytest.raises(FileNotFoundError) as err:
        huggingface.load_hf(str(ckpt))
    command = re.fullmatch(r'.*: python -c "(.*)"', str(err.value)).group(1)
    run_python("-c", command, timeout=300)
    converted = jax.tree.leaves(nnx.state(huggingface.load_hf(str(ckpt)), nnx.Param))
    expected = jax.tree.leaves(nnx.state(huggingface.load_hf(str(plain)), nnx.Param))
    assert len(converted) == len(expected) > 0
    for a, b in zip(converted, expected):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_checkpoints_auto_map_code_is_not_run(tmp_path, caplog):
    marker = tmp_path / "imported"
    ckpt = tmp_path / "ckpt"
    model = CausalLM(TINY, rngs=nnx.Rngs(1))
    huggingface.export_hf(model, str(ckpt))
    _touch_module(ckpt / "modeling_evil.py", marker)
    config = json.loads((ckpt / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (ckpt / "config.json").write_text(json.dumps(config))
    caplog.set_level("WARNING", logger="absl")
    loaded = huggingface.load_hf(str(ckpt))
    assert f"{ckpt}/config.json: auto_map" in caplog.text and "it is not run" in caplog.text
    for a, b in zip(
        jax.tree.leaves(nnx.state(loaded, nnx.Param)), jax.tree.leaves(nnx.state(model, nnx.Param))
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not marker.exists()
    runpy.run_path(str(ckpt / "modeling_evil.py"))  # the oracle: importing it makes the marker
    assert marker.exists()


@pytest.fixture(scope="module")
def offline():
    return T.load_tokenizer(None)


@pytest.fixture
def tokenizer_dir(offline, tmp_path):
    """A tokenizer directory as `Tokenizer.save` writes it (a Qwen2.5 release's layout)."""
    offline.save(str(tmp_path / "tok"))
    return tmp_path / "tok"


def test_a_tokenizers_auto_map_code_is_not_run(offline, tokenizer_dir, tmp_path, caplog):
    marker = tmp_path / "imported"
    _touch_module(tokenizer_dir / "tokenization_evil.py", marker)
    config_file = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    config_file.write_text(json.dumps(config))
    caplog.set_level("WARNING", logger="absl")
    tok = T.load_tokenizer(str(tokenizer_dir))
    assert f"{config_file}: auto_map" in caplog.text and "it is not run" in caplog.text
    text = "MARS decodes 3 tokens <|im_end|> per forward."
    assert tok.encode(text) == offline.encode(text)
    assert not marker.exists()
    runpy.run_path(str(tokenizer_dir / "tokenization_evil.py"))  # the oracle
    assert marker.exists()


MESSAGES = [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}]

# (template, attribute the sandbox stops, what Jinja without a sandbox renders: the reach works).
HOSTILE_TEMPLATES = [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "'__class__' of a 'str'", "<class 'type'>"),
    ("{{ cycler.__init__.__globals__ }}", "'__init__' of a 'type'", "'__name__': 'jinja2.utils'"),
    ("{{ ''.__class__ }}", "'__class__' of a 'str'", "<class 'str'>"),
    ("{{ messages[0]['__class__'] }}", "'__class__' of a 'dict'", "<class 'dict'>"),
    ("{{ messages.append(messages[0]) }}{{ messages | length }}", "'append' of a 'list'", "None3"),
]


@pytest.mark.parametrize("template,stopped,unsandboxed", HOSTILE_TEMPLATES)
def test_a_template_reaching_for_python_internals_fails_cleanly(
    offline, template, stopped, unsandboxed
):
    tok = T.Tokenizer(offline._tok, template, "/models/x/chat_template.jinja")
    with pytest.raises(ValueError) as err:
        tok.render_chat(MESSAGES)
    assert str(err.value) == (
        "/models/x/chat_template.jinja: the chat template was stopped by the sandbox: "
        f"access to attribute {stopped} object is unsafe"
    )
    # The oracle: without the sandbox the same template reaches what it asks for.
    rendered = (
        jinja2.Environment()
        .from_string(template)
        .render(messages=[dict(m) for m in MESSAGES], cycler=jinja2.utils.Cycler)
    )
    assert unsandboxed in rendered


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_a_hostile_template_file_is_named_and_stops_data_preparation(tokenizer_dir, where):
    """The error names the file the template came from, and reaches the caller of
    `batches.build_examples` (not counted as a row's template_error skip)."""
    template = HOSTILE_TEMPLATES[1][0]
    if where == "chat_template.jinja":
        (tokenizer_dir / where).write_text(template)
    else:
        config = json.loads((tokenizer_dir / where).read_text())
        (tokenizer_dir / where).write_text(json.dumps({**config, "chat_template": template}))
    tok = T.load_tokenizer(str(tokenizer_dir))
    with pytest.raises(
        ValueError,
        match=re.escape(f"{tokenizer_dir / where}: the chat template was stopped by the sandbox"),
    ):
        build_examples([{"messages": MESSAGES}], tok, "messages", max_length=64, block_size=4)


def test_a_template_syntax_error_names_the_file(tokenizer_dir):
    (tokenizer_dir / "chat_template.jinja").write_text("ok\n{% for m in messages %}")
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{tokenizer_dir}/chat_template.jinja: chat template line 2: Unexpected end of template"
        ),
    ):
        T.load_tokenizer(str(tokenizer_dir))


def test_a_parquet_pickled_extension_type_is_not_unpickled(tmp_path, no_unpickling):
    """pyarrow before 14.0.1 unpickled a column declared ``arrow.py_extension_type``
    (CVE-2023-47248); the column must come back as its plain storage values."""
    marker = tmp_path / "unpickled"
    field = pa.field(
        "messages",
        pa.string(),
        metadata={
            "ARROW:extension:name": "arrow.py_extension_type",
            "ARROW:extension:metadata": pickle.dumps(_Touch(marker)),
        },
    )
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"messages": ["hello"]}, schema=pa.schema([field])), path)
    assert read_rows(path) == [{"messages": "hello"}]
    assert not marker.exists()


@pytest.mark.parametrize(
    "key,parsed",
    [
        ("init_from", lambda p: p),  # a string field keeps the text
        ("mesh.rules.embed", lambda p: (p,)),  # tuple fields: ast.literal_eval, else the text
        ("eval.thresholds", lambda p: (p,)),
        ("mesh.rules", None),  # a dict field: ast.literal_eval or an error
        ("train.num_steps", None),  # an int field: int() or an error
    ],
)
def test_config_overrides_are_parsed_never_evaluated(tmp_path, key, parsed):
    marker = tmp_path / "evaluated"
    payload = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    argv = ["prog", f"--config={REPO / 'configs' / 'tiny.py'}", f"--config.{key}={payload}"]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
    if parsed is None:
        with pytest.raises(flags.IllegalFlagValueError):
            values(argv)
    else:
        values(argv)
        value = values.config
        for part in key.split("."):
            value = value[part]
        assert value == parsed(payload)
    assert not marker.exists()
    eval(payload)  # the oracle: evaluating the override would have made the marker
    assert marker.exists()


def test_a_template_that_loops_for_ever_is_a_counted_skip(offline, monkeypatch, caplog):
    """A template whose rendering of one kind of row never ends (nested loops over a row's
    content) gets a time limit: that row is skipped and counted as template_timeout, the
    others are kept, and the limit is lifted afterwards (no stray alarm)."""
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% if 'loop' in m['content'] %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% endfor %}{% endfor %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = T.Tokenizer(offline._tok, template, "/models/x/chat_template.jinja")
    monkeypatch.setattr(chat_rows, "RENDER_SECONDS", 0.5)
    rows = [
        {"messages": MESSAGES},
        {"messages": [{"role": "user", "content": "loop"}, MESSAGES[1]]},
        {"messages": MESSAGES},
    ]
    caplog.set_level("INFO", logger="absl")
    start = time.monotonic()
    examples, skips = build_examples(rows, tok, "messages", max_length=64, block_size=4)
    assert time.monotonic() - start < 10
    assert [e.row for e in examples] == [0, 2] and skips == {"template_timeout": 1}
    time.sleep(0.6)  # an alarm left armed would fire here
