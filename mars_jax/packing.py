"""Packed training sequences (``data.packing``): several rows in one sequence of ``max_length``.

Rows (`batches.Example`, each a whole number of blocks: `chat_rows.assemble` pads it with labelled
EOS to a multiple of the block size) are taken in a seeded random order and packed first-fit:
each goes into the lowest-numbered sequence that still has room for it, a new one when none
has. A row is never split, so no block straddles two rows. A packed sequence carries, beside
its ids and labels, ``segment_ids`` (1, 2, ... for its rows in order, 0 for the padding after
the last) and ``positions`` that restart at 0 in every row; `objectives` builds from them each
row's own attention mask (nothing attends across rows) and normalises the loss per row.

The packing is done once per run, a pure function of the rows, ``max_length`` and the seed, so
a resumed run rebuilds it identically and its data position (a batch index) means the same
batch; the sequences, not the rows, are then shuffled per epoch (`batches.batched_dataset`).

First-fit over every open sequence costs O(max_length / block) numpy work per row: open
sequences are kept in one heap per amount of room left (in blocks), and the first with room for
a row is the smallest index among the heaps' tops of that room or more.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple, Sequence

import numpy as np

from mars_jax.common_types import IGNORE_INDEX
from mars_jax.errors import InputError


class Packed(NamedTuple):
    """One packed sequence: input_ids, labels, positions and segment_ids int32[n] (n <= max_length:
    its rows end to end, unpadded), and ``rows``, the source row (`batches.Example.row`) of each
    segment, in order."""

    input_ids: np.ndarray
    labels: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    rows: tuple[int, ...]


def first_fit(lengths: Sequence[int], capacity: int, unit: int = 1) -> list[list[int]]:
    """First-fit bin packing: item i (in the given order) goes into the lowest-numbered bin whose
    room is at least ``lengths[i]``, else into a new bin. ``lengths`` are counted in whole
    ``unit``s (a length is rounded up to one), each at most ``capacity``. Returns the bins as
    lists of item indices, in bin order."""
    levels = capacity // unit
    heaps: list[list[int]] = [[] for _ in range(levels + 1)]  # bins by their room, in units
    none = np.iinfo(np.int64).max
    top = np.full(levels + 1, none, np.int64)  # smallest bin index of each room; `none` if empty
    bins: list[list[int]] = []
    for item, length in enumerate(lengths):
        need = -(-int(length) // unit)
        if not 0 < need <= levels:
            raise ValueError(f"item {item} has length {length}, outside (0, {capacity}]")
        room = need + int(np.argmin(top[need:]))
        if top[room] == none:  # no open bin has room: a new one
            b, room = len(bins), levels
            bins.append([])
        else:
            b = heapq.heappop(heaps[room])
            top[room] = heaps[room][0] if heaps[room] else none
        bins[b].append(item)
        left = room - need
        if left:  # a full bin can take nothing more
            heapq.heappush(heaps[left], b)
            top[left] = heaps[left][0]
    return bins


def pack(examples: Sequence, *, max_length: int, block_size: int, seed: int) -> list[Packed]:
    """Packs ``examples`` (`batches.Example`s no longer than ``max_length``) first-fit into
    sequences of at most ``max_length`` tokens, the rows taken in the order of a permutation
    seeded by ``seed``; each row occupies a whole number of blocks (a row whose length is not
    a multiple of ``block_size`` is followed, within its segment, by unlabelled padding to the
    next block, as batch padding follows it unpacked). Returns the sequences in order of
    creation (`Packed`)."""
    if not examples:
        raise InputError("no examples to pack")
    if (longest := max(len(e.input_ids) for e in examples)) > max_length:
        raise InputError(f"an example has {longest} tokens, more than max_length={max_length}")
    order = np.random.default_rng([seed, 0x5ACC]).permutation(len(examples))
    lengths = [len(examples[i].input_ids) for i in order]
    out = []
    for members in first_fit(lengths, max_length, block_size):
        rows = [examples[order[m]] for m in members]
        out.append(_concatenate(rows, block_size))
    return out


def _concatenate(rows: list, block_size: int) -> Packed:
    """The `Packed` of ``rows`` end to end, each padded to a multiple of ``block_size``."""
    ids, labels, positions, segments = [], [], [], []
    for s, row in enumerate(rows, start=1):
        n = len(row.input_ids)
        pad = -n % block_size
        ids.append(np.concatenate([row.input_ids, np.full(pad, row.input_ids[-1], np.int32)]))
        labels.append(np.concatenate([row.labels, np.full(pad, IGNORE_INDEX, np.int32)]))
        positions.append(np.arange(n + pad, dtype=np.int32))
        segments.append(np.full(n + pad, s, np.int32))
    cat = lambda parts: np.concatenate(parts).astype(np.int32)
    return Packed(
        cat(ids), cat(labels), cat(positions), cat(segments), tuple(int(r.row) for r in rows)
    )


def padding_fraction(sequences: Sequence, max_length: int) -> float:
    """The fraction of the ``len(sequences) * max_length`` token slots that hold no row's token
    (`Packed` sequences, or `batches.Example` rows each padded to ``max_length`` alone)."""
    used = sum(len(s.input_ids) for s in sequences)
    return 1.0 - used / (len(sequences) * max_length)
