"""``fold.files``: the one atomic write every saved file goes through."""

import os

import pytest
import torch
from safetensors import safe_open

from fold.files import write_atomically, write_safetensors_atomically, write_text_atomically


def test_the_file_gets_its_content_and_a_plain_mode_and_no_temporary_is_left(tmp_path):
    seen = []
    for umask, mode in ((0o022, 0o644), (0o077, 0o600)):
        old = os.umask(umask)
        try:
            path = tmp_path / f"cache-{umask:o}.json"
            write_atomically(path, lambda tmp: (seen.append(tmp), tmp.write_text("{}")))
        finally:
            os.umask(old)
        assert path.read_text() == "{}"
        assert path.stat().st_mode & 0o777 == mode
    # the writer got a hidden name beside the file that keeps its suffix (matplotlib picks a format by it)
    assert all(t.parent == tmp_path and t.name.startswith(".cache-") and t.suffix == ".json" for t in seen)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache-22.json", "cache-77.json"]


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path, error):
    path = tmp_path / "state.json"
    write_text_atomically(path, "old")

    def broken(tmp):
        tmp.write_text("half")
        raise error
    with pytest.raises(type(error)):
        write_atomically(path, broken)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_the_file_is_replaced_whole(tmp_path):
    path = tmp_path / "results.json"
    write_text_atomically(path, "a much longer first version")
    write_text_atomically(str(path), "short")
    assert path.read_text() == "short"


def test_safetensors_get_their_tensors_metadata_and_a_plain_mode(tmp_path, plain_mode):
    """safetensors' own save_file leaves 0600 whatever the umask (0.8); the helper gives a plain file's mode."""
    tensors = {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "b": torch.ones(3)}
    path = tmp_path / "model.safetensors"
    write_safetensors_atomically(path, tensors, metadata={"format": "pt"})
    assert path.stat().st_mode & 0o777 == plain_mode
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == ["b", "w"]
        for k, v in tensors.items():
            assert torch.equal(f.get_tensor(k), v), k
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
