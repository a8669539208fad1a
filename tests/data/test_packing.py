"""Packing rows into sequences (mars_jax/packing.py): first-fit against a plain first-fit written
the obvious way, each packed row read back intact from its segment, and the packed batches that
`batches.batched_dataset` collates."""

import numpy as np
import pytest

from mars_jax import packing
from mars_jax.batches import Example, batched_dataset
from mars_jax.common_types import IGNORE_INDEX

PAD = 7


def naive_first_fit(lengths, capacity, unit):
    """First-fit as its definition reads: scan the bins in order, take the first with room."""
    bins, room = [], []
    for i, n in enumerate(lengths):
        need = -(-n // unit) * unit
        for b, r in enumerate(room):
            if r >= need:
                bins[b].append(i)
                room[b] -= need
                break
        else:
            bins.append([i])
            room.append(capacity - need)
    return bins


@pytest.mark.parametrize("seed", range(6))
def test_first_fit_is_first_fit(seed):
    rng = np.random.default_rng(seed)
    unit = int(rng.choice([1, 4, 8]))
    capacity = unit * int(rng.integers(4, 64))
    lengths = rng.integers(1, capacity + 1, int(rng.integers(1, 400)))
    if seed % 2:  # mostly short items: many open bins with room at once
        lengths = np.minimum(lengths, capacity // 5 + 1)
    assert packing.first_fit(lengths, capacity, unit) == naive_first_fit(lengths, capacity, unit)


def test_first_fit_refuses_an_item_that_cannot_fit():
    with pytest.raises(ValueError, match="item 1 has length 9"):
        packing.first_fit([4, 9], 8, 1)


def examples(seed=0, n=40, block=4, longest=60):
    """Rows as `build_examples` makes them: prompt (IGNORE) + labelled answer, a multiple of
    ``block`` long; lengths spread from one block to ``longest``."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(n):
        length = block * int(rng.integers(1, longest // block + 1))
        ids = rng.integers(10, 1000, length).astype(np.int32)
        prompt = int(rng.integers(1, length)) if length > 1 else 0
        labels = np.where(np.arange(length) >= prompt, ids, IGNORE_INDEX).astype(np.int32)
        out.append(Example(ids, labels, row=100 + r))
    return out


def test_pack_keeps_every_row_whole_in_its_own_segment():
    rows = examples()
    by_row = {e.row: e for e in rows}
    packed = packing.pack(rows, max_length=64, block_size=4, seed=3)
    seen = []
    for seq in packed:
        assert len(seq.input_ids) <= 64
        segments = seq.segment_ids
        assert segments[0] == 1 and np.all(np.diff(segments) >= 0)
        assert sorted(set(segments.tolist())) == list(range(1, len(seq.rows) + 1))
        for s, row in enumerate(seq.rows, start=1):
            where = np.flatnonzero(segments == s)
            assert where[0] % 4 == 0  # a row starts at a block boundary
            e = by_row[row]
            np.testing.assert_array_equal(seq.input_ids[where], e.input_ids)
            np.testing.assert_array_equal(seq.labels[where], e.labels)
            np.testing.assert_array_equal(seq.positions[where], np.arange(len(e.input_ids)))
        seen.extend(seq.rows)
    assert sorted(seen) == sorted(by_row)  # every row once
    # First-fit: no row of a later sequence would have fitted into an earlier one when placed.
    assert len(packed) == len(naive_first_fit([len(by_row[r].input_ids) for r in seen], 64, 4))


def test_pack_is_a_function_of_the_seed():
    rows = examples()
    a = packing.pack(rows, max_length=64, block_size=4, seed=0)
    b = packing.pack(rows, max_length=64, block_size=4, seed=0)
    c = packing.pack(rows, max_length=64, block_size=4, seed=1)
    assert [s.rows for s in a] == [s.rows for s in b]
    assert [s.rows for s in a] != [s.rows for s in c]


def test_pack_pads_a_row_that_is_not_whole_blocks_within_its_segment():
    ids = np.arange(10, 16, dtype=np.int32)  # 6 tokens, block 4
    labels = np.where(np.arange(6) >= 2, ids, IGNORE_INDEX).astype(np.int32)
    rows = [Example(ids, labels, 0), Example(ids[:4], labels[:4], 1)]
    (seq,) = packing.pack(rows, max_length=16, block_size=4, seed=0)
    first = np.flatnonzero(seq.segment_ids == seq.segment_ids[0])
    assert len(first) % 4 == 0 and len(seq.input_ids) == 12
    assert np.all(seq.labels[first[len(rows[seq.rows[0]].input_ids) :]] == IGNORE_INDEX)


def test_pack_refuses_a_row_longer_than_max_length():
    with pytest.raises(ValueError, match="more than max_length=32"):
        packing.pack(examples(longest=60), max_length=32, block_size=4, seed=0)


def test_padding_fraction_of_rows_and_of_packed_sequences():
    rows = examples()
    packed = packing.pack(rows, max_length=64, block_size=4, seed=0)
    tokens = sum(len(e.input_ids) for e in rows)
    assert packing.padding_fraction(rows, 64) == pytest.approx(1 - tokens / (64 * len(rows)))
    assert packing.padding_fraction(packed, 64) == pytest.approx(1 - tokens / (64 * len(packed)))
    assert packing.padding_fraction(packed, 64) < packing.padding_fraction(rows, 64)


def test_batched_dataset_collates_packed_sequences():
    rows = examples()
    packed = packing.pack(rows, max_length=64, block_size=4, seed=0)
    ds = batched_dataset(packed, batch_size=4, max_length=64, seed=0, pad_id=PAD, rows=[1, 3])
    batch = ds[0]
    assert set(batch) == {"input_ids", "labels", "positions", "segment_ids", "row_ids"}
    assert all(batch[k].shape == (2, 64) for k in ("input_ids", "labels", "positions"))
    most = max(len(s.rows) for s in packed)
    assert batch["row_ids"].shape == (2, most)
    whole = batched_dataset(packed, batch_size=4, max_length=64, seed=0, pad_id=PAD)[0]
    for k in batch:
        np.testing.assert_array_equal(batch[k], whole[k][[1, 3]])
    by_rows = {s.rows: s for s in packed}
    for i in range(4):
        ids = tuple(int(r) for r in whole["row_ids"][i] if r >= 0)
        seq = by_rows[ids]
        n = len(seq.input_ids)
        np.testing.assert_array_equal(whole["input_ids"][i, :n], seq.input_ids)
        np.testing.assert_array_equal(whole["segment_ids"][i, :n], seq.segment_ids)
        assert np.all(whole["input_ids"][i, n:] == PAD)
        assert np.all(whole["labels"][i, n:] == IGNORE_INDEX)
        assert np.all(whole["segment_ids"][i, n:] == 0)
    # An epoch is every packed sequence once.
    full = batched_dataset(packed, batch_size=4, max_length=64, seed=0, pad_id=PAD)
    epoch = [
        tuple(int(r) for r in row if r >= 0)
        for i in range(len(packed) // 4)
        for row in full[i]["row_ids"]
    ]
    assert len(set(epoch)) == len(epoch) == 4 * (len(packed) // 4)


def test_another_process_packs_the_same_sequences():
    """A resumed run rebuilds its packing in a new process (after kill -9 too): the same rows
    and seed pack into the same sequences there, whatever that process's hash seed."""
    import json
    import subprocess
    import sys

    from tests.helpers import ROOT

    code = (
        "import json; from tests.data.test_packing import examples; from mars_jax import packing; "
        "print(json.dumps([s.rows for s in packing.pack(examples(n=200), max_length=64, "
        "block_size=4, seed=5)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={"PATH": "", "PYTHONHASHSEED": "12345", "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    here = packing.pack(examples(n=200), max_length=64, block_size=4, seed=5)
    assert json.loads(out) == [list(s.rows) for s in here]
