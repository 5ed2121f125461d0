"""HostBufferPool and piece cutting: buffers sit at the page phase of their file offset, fit their
chunk, never overlap while live, and pieces cover each source exactly."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lazyckpt.core.engine import Engine
from lazyckpt.core.pool import PAGE, HostBufferPool
from lazyckpt.formats.capture import Source

CHUNK = 16 * PAGE


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, CHUNK), st.integers(0, 10 * CHUNK)), min_size=1, max_size=30))
def test_pieces_fit_their_chunk_at_their_phase(requests):
    pool = HostBufferPool(8 * CHUNK, CHUNK, pin_memory=False)
    engine = Engine.__new__(Engine)  # only _pieces is used: no threads
    engine.pool = pool
    live = []
    for nbytes, file_offset in requests:
        src = Source("k", torch.empty(0, dtype=torch.uint8), nbytes, [], file_offset=file_offset)
        pieces = engine._pieces(None, src)
        assert sum(p.nbytes for p in pieces) == nbytes and pieces[0].start == 0
        assert all(a.start + a.nbytes == b.start for a, b in zip(pieces, pieces[1:], strict=False))
        for piece in pieces:
            phase = piece.file_offset % PAGE
            if len(live) >= 6:  # keep within the budget: release the oldest
                pool.release(live.pop(0)[0])
            buf = pool.alloc(piece.nbytes, phase)
            if piece.nbytes >= PAGE:
                assert buf.view.data_ptr() % PAGE == phase
            assert buf.view.numel() == piece.nbytes
            live.append((buf, buf.view.data_ptr(), buf.view.data_ptr() + piece.nbytes))
            spans = sorted((a, b) for _, a, b in live)
            assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:], strict=False)), "live buffers overlap"
    for buf, _, _ in live:
        pool.release(buf)
    pool.close()


def test_alloc_refuses_a_piece_that_cannot_fit():
    pool = HostBufferPool(4 * CHUNK, CHUNK, pin_memory=False)
    with pytest.raises(ValueError):
        pool.alloc(CHUNK, phase=8)
    with pytest.raises(ValueError):
        pool.alloc(PAGE, phase=PAGE)
    assert pool.alloc(CHUNK - 8, phase=8).view.data_ptr() % PAGE == 8
    pool.close()


def test_alloc_blocks_until_a_release():
    pool = HostBufferPool(2 * CHUNK, CHUNK, pin_memory=False)
    a, b = pool.alloc(CHUNK), pool.alloc(CHUNK)
    got = threading.Event()

    def taker():
        pool.alloc(CHUNK)
        got.set()

    t = threading.Thread(target=taker)
    t.start()
    assert not got.wait(0.1)
    pool.release(a)
    t.join(10)
    assert got.is_set()
    pool.release(b)
    pool.close()
