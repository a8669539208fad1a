"""Loading a HF checkpoint straight into a sharded layout (`huggingface.load_hf_sharded`) on 8
simulated CPU devices (tests/multidevice/conftest.py sets the device count): the arrays equal
`load_hf_state`'s, every device's shard holds its slice, and the reads that reach safetensors
are recorded to show that each part is requested once, by its slice, never as a whole tensor.
Plus the strict errors through the sharded path (raised before any tensor data is read). The
checkpoints are tests/conftest.py's; tests/model/test_huggingface.py checks the bf16 one itself."""

import json

import jax
import numpy as np
import pytest
from safetensors import safe_open

from mars_jax import huggingface, sharding
from mars_jax import model as model_lib
from tests.model.test_model import copy_ckpt, edit_config, edit_tensors


class Recorder:
    # Stands in for safetensors.safe_open inside mars_jax.huggingface: records every method
    # used on a file and every slice read, as (tensor name, [[start, stop], ...]).
    def __init__(self):
        self.reads, self.methods = [], set()

    def open(self, file, framework):
        return Handle(self, safe_open(file, framework=framework))


class Handle:
    def __init__(self, rec, f):
        self.rec, self.f = rec, f

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        self.rec.methods.add("keys")
        return self.f.keys()

    def get_slice(self, name):
        self.rec.methods.add("get_slice")
        return Slice(self.rec, name, self.f.get_slice(name))

    def __getattr__(self, attr):  # any other way of reading (get_tensor, ...)
        self.rec.methods.add(attr)
        return getattr(self.f, attr)


class Slice:
    def __init__(self, rec, name, s):
        self.rec, self.name, self.s = rec, name, s

    def get_shape(self):
        return self.s.get_shape()

    def __getitem__(self, index):
        shape = self.s.get_shape()
        self.rec.reads.append((self.name, [list(i.indices(n)[:2]) for i, n in zip(index, shape)]))
        return self.s[index]


def _broken_checkpoints(tied, root):
    """(label, directory) of copies of the tied checkpoint that loading must reject."""
    unused = copy_ckpt(tied, root / "unused")
    edit_tensors(unused, lambda t: t.update(extra=np.ones((4,), np.float32)))
    missing_head = copy_ckpt(tied, root / "missing_head")
    edit_config(missing_head, tie_word_embeddings=False)
    missing_bias = copy_ckpt(tied, root / "missing_bias")
    edit_tensors(missing_bias, lambda t: t.pop("model.layers.1.self_attn.v_proj.bias"))
    shape = copy_ckpt(tied, root / "shape")
    edit_config(shape, intermediate_size=48)
    return [
        ("unused", unused),
        ("missing_head", missing_head),
        ("missing_bias", missing_bias),
        ("shape", shape),
    ]


@pytest.fixture(scope="module")
def result(tied_ckpt, untied_ckpt, bf16_ckpt, tmp_path_factory):
    args = {
        "loads": [
            ("tied", str(tied_ckpt[0]), "float32"),
            ("untied", str(untied_ckpt[0]), "float32"),
            ("bf16", str(bf16_ckpt[0]), "float32"),
            ("bf16", str(bf16_ckpt[0]), "bfloat16"),
        ],
        "errors": [
            (label, str(path))
            for label, path in _broken_checkpoints(tied_ckpt[0], tmp_path_factory.mktemp("bad"))
        ],
    }
    rec = Recorder()
    real_safe_open = huggingface.safe_open
    huggingface.safe_open = rec.open
    try:
        rules = sharding.logical_rules()
        meshes = {"2x2x2": sharding.make_mesh(2, 2, 2), "fsdp8": sharding.make_mesh(1, 8, 1)}
        out = {"devices": len(jax.devices()), "loads": [], "errors": {}}
        for label, path, dtype in args["loads"]:
            cfg = huggingface.read_hf_config(path, param_dtype=dtype)
            ref = jax.tree.leaves(huggingface.load_hf_state(path, cfg))
            for mesh_name, mesh in meshes.items():
                _, abstract = model_lib.abstract_params(cfg, mesh, rules)
                rec.reads.clear()
                loaded = huggingface.load_hf_sharded(path, cfg, abstract)
                arrays, specs = jax.tree.leaves(loaded), jax.tree.leaves(abstract)
                shards_ok = split = 0
                for x, a, r in zip(arrays, specs, ref):
                    shape = a.sharding.shard_shape(a.shape)
                    split += shape != a.shape
                    shards_ok += (
                        all(
                            s.data.shape == shape and np.array_equal(np.asarray(s.data), r[s.index])
                            for s in x.addressable_shards
                        )
                        and len(x.addressable_shards) == 8
                    )
                out["loads"].append(
                    {
                        "label": label,
                        "mesh": mesh_name,
                        "dtype": dtype,
                        "leaves": len(arrays),
                        "equal": sum(np.array_equal(np.asarray(x), r) for x, r in zip(arrays, ref)),
                        "same_dtype": sum(
                            x.dtype == a.dtype == r.dtype == np.dtype(dtype)
                            for x, a, r in zip(arrays, specs, ref)
                        ),
                        "same_sharding": sum(
                            x.sharding == a.sharding for x, a in zip(arrays, specs)
                        ),
                        "shards_ok": shards_ok,
                        "split": int(split),
                        "elements": sum(int(r.size) for r in ref),
                        "read_elements": sum(
                            int(np.prod([b - a for a, b in idx])) for _, idx in rec.reads
                        ),
                        "reads": rec.reads[:],
                    }
                )
        for label, path in args["errors"]:
            cfg = huggingface.read_hf_config(path)
            _, abstract = model_lib.abstract_params(cfg, meshes["2x2x2"], rules)
            rec.reads.clear()
            try:
                huggingface.load_hf_sharded(path, cfg, abstract)
                out["errors"][label] = [None, len(rec.reads)]
            except ValueError as e:
                out["errors"][label] = [str(e), len(rec.reads)]
        out["methods"] = sorted(rec.methods)
    finally:
        huggingface.safe_open = real_safe_open
    return json.loads(json.dumps(out))  # as the tests read it: tuples as lists


def test_sharded_load_equals_host_load(result):
    assert result["devices"] == 8
    loads = result["loads"]
    assert len(loads) == 4 * 2
    for load in loads:
        n = load["leaves"]
        assert n == (14 if load["label"] == "tied" else 15), load["label"]
        # Global arrays, their dtype and placement, and every device's shard.
        assert load["equal"] == load["same_dtype"] == load["same_sharding"] == n, load["label"]
        assert load["shards_ok"] == n, (load["label"], load["mesh"])
        # Most parameters really are split: all but the 3 norms on 2x2x2; on fsdp8 (tensor = 1)
        # the q/k/v biases, split over tensor only, are whole too.
        whole = 3 if load["mesh"] == "2x2x2" else 6
        assert load["split"] == n - whole, (load["label"], load["mesh"])


def test_each_part_is_read_once_by_its_slice(result):
    for load in result["loads"]:
        # Every element read exactly once per process: the parts partition each tensor
        # (devices along the data axis and replicated parameters share one read).
        assert load["read_elements"] == load["elements"], (load["label"], load["mesh"])
    # Only headers and slices are read: no whole-tensor reads (get_tensor) or other methods.
    assert result["methods"] == ["get_slice", "keys"]
    fsdp8 = next(l for l in result["loads"] if l["label"] == "untied" and l["mesh"] == "fsdp8")
    reads = {}
    for name, index in fsdp8["reads"]:
        reads.setdefault(name, []).append(index)
    # q_proj kernel [layers, 32 in, 48 out], in split 8 ways over fsdp = HF [48 out, 32 in]
    # read by columns: each device's 4 columns of every layer's tensor, once.
    for layer in range(3):
        q = reads[f"model.layers.{layer}.self_attn.q_proj.weight"]
        assert sorted(q) == [[[0, 48], [4 * k, 4 * k + 4]] for k in range(8)]
    # The embedding [96 vocab, 32 embed] (vocab on tensor = 1 device, embed over fsdp).
    assert sorted(reads["model.embed_tokens.weight"]) == [
        [[0, 96], [4 * k, 4 * k + 4]] for k in range(8)
    ]
    # lm_head kernel [32 embed, 96 vocab] (embed over fsdp) = HF [96, 32]: columns again.
    assert sorted(reads["lm_head.weight"]) == [[[0, 96], [4 * k, 4 * k + 4]] for k in range(8)]
    # A replicated parameter: read once, whole.
    assert reads["model.norm.weight"] == [[[0, 32]]]
    # On the 2x2x2 mesh the o_proj kernel [in 32 (tensor), out 32 (fsdp)] = HF [out, in]:
    # 4 distinct 16 x 16 blocks per layer, each read once although 8 devices hold them.
    mesh = next(l for l in result["loads"] if l["label"] == "tied" and l["mesh"] == "2x2x2")
    o = sorted(i for n, i in mesh["reads"] if n == "model.layers.0.self_attn.o_proj.weight")
    assert o == [[[a, a + 16], [b, b + 16]] for a in (0, 16) for b in (0, 16)]


def test_strict_errors_through_the_sharded_path(result):
    errors = result["errors"]
    for label, (message, reads) in errors.items():
        assert message is not None, label
        assert reads == 0, label  # names and shapes come from the headers alone
    assert "not used" in errors["unused"][0] and "extra (model.safetensors)" in errors["unused"][0]
    assert "missing tensor 'lm_head.weight'" in errors["missing_head"][0]
    assert "missing tensor 'model.layers.1.self_attn.v_proj.bias'" in errors["missing_bias"][0]
    shape = errors["shape"][0]
    assert "/model.safetensors: tensor 'model.layers.0.mlp." in shape
    assert (
        "has shape (64, 32), expected (48, 32)" in shape or "(32, 64), expected (32, 48)" in shape
    )
