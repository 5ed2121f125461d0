"""``DistributedCheckpointer`` takes its options as ``LazyCheckpointer`` does: one
``CheckpointerOptions`` (``options=``), keywords, or both (keywords override); ``process_group`` and
``commit_timeout`` are its own keywords (1-rank gloo group, in this process)."""

from __future__ import annotations

import dataclasses

import pytest

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed unavailable", allow_module_level=True)

import _launch  # noqa: E402
from lazyckpt import CheckpointerOptions  # noqa: E402
from lazyckpt.distributed import DistributedCheckpointer  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    with _launch.one_rank_group():
        yield


def _inner_options(ckpt: DistributedCheckpointer) -> CheckpointerOptions:
    return ckpt._inner.options  # the test looks inside: which options reached the engine


def test_options_as_one_value_keywords_or_both():
    opts = CheckpointerOptions(host_memory_budget=4 << 20, chunk_bytes=1 << 20, writer_threads=2, fsync=False)
    with DistributedCheckpointer(opts, commit_timeout=7) as positional:
        assert positional.options == opts and _inner_options(positional) == opts
        assert positional.commit_timeout == 7.0
    with DistributedCheckpointer(options=opts) as named:
        assert named.options == opts
    with DistributedCheckpointer(options=opts, writer_threads=3) as both:  # keywords override
        assert both.options == dataclasses.replace(opts, writer_threads=3)
        assert _inner_options(both).writer_threads == 3
    with DistributedCheckpointer(host_memory_budget=4 << 20, fsync=False) as keywords:  # as before
        assert keywords.options.fsync is False and keywords.options.host_memory_budget == 4 << 20


def test_bad_options_are_refused_before_anything_starts():
    with pytest.raises(TypeError, match="CheckpointerOptions"):
        DistributedCheckpointer({"fsync": False})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="skip"):
        DistributedCheckpointer(CheckpointerOptions(on_backpressure="skip"))
    with pytest.raises(ValueError, match="skip"):
        DistributedCheckpointer(on_backpressure="skip")
    with pytest.raises(ValueError, match="commit_timeout"):
        DistributedCheckpointer(commit_timeout=0)
    with pytest.raises(TypeError):
        DistributedCheckpointer(no_such_option=1)
