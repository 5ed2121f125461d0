"""The format planners: each one's bytes are exactly the stock writer's, and reserved fields stay ours."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lazyckpt import LazyCheckpointer, SaveRefusedError, verify


@pytest.mark.parametrize("crc", [True, False])
@pytest.mark.parametrize("value", ["abc", "12345678", "00000000"])
def test_reserved_safetensors_metadata_key_is_refused(tmp_path, crc, value):
    """Issue 11 item 1: a user's ``lazyckpt_crc32`` (e.g. metadata copied from an earlier lazyckpt
    file) used to land where the CRC is patched in: the file did not parse (short value) or did not
    verify (any other value). It is refused before anything is written."""
    path = tmp_path / "m.safetensors"
    with LazyCheckpointer(crc=crc) as c, pytest.raises(SaveRefusedError, match="lazyckpt_crc32"):
        c.save({"w": torch.arange(4.0)}, path, format="safetensors", metadata={"lazyckpt_crc32": value, "a": "b"})
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def test_metadata_copied_from_a_lazyckpt_file_saves_once_the_reserved_key_is_dropped(tmp_path):
    from safetensors import safe_open

    with LazyCheckpointer() as c:
        c.save({"w": torch.arange(4.0)}, tmp_path / "a.safetensors", format="safetensors", metadata={"k": "v"}).wait()
        with safe_open(tmp_path / "a.safetensors", "pt") as f:
            meta = f.metadata()
        assert "lazyckpt_crc32" in meta
        meta.pop("lazyckpt_crc32")
        c.save({"w": torch.ones(3)}, tmp_path / "b.safetensors", format="safetensors", metadata=meta).wait()
    assert torch.equal(load_file(tmp_path / "b.safetensors")["w"], torch.ones(3))
    assert verify(tmp_path / "b.safetensors").ok
