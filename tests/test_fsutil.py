"""staged_directory and staged_file: a directory or a file is replaced whole or not at all."""

from pathlib import Path

import pytest

from k2lab.fsutil import staged_directory, staged_file


def test_staged_directory_replaces_on_success_and_leaves_the_target_on_error(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="crash"), staged_directory(target) as staging:
        (staging / "new.txt").write_text("new")
        raise RuntimeError("crash")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging left behind
    assert [p.name for p in target.iterdir()] == ["old.txt"]
    with staged_directory(target) as staging:
        (staging / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert [p.name for p in target.iterdir()] == ["new.txt"]


def test_staged_file_renames_on_success_and_keeps_the_old_file_on_error(tmp_path: Path) -> None:
    """The block writes a temporary sibling; success replaces the target (mode 0644), an error leaves the
    target as it was and no temporary behind."""
    target = tmp_path / "out.bin"
    with staged_file(target) as temporary:
        temporary.write_bytes(b"new")
        assert not target.exists()
    assert target.read_bytes() == b"new" and (target.stat().st_mode & 0o777) == 0o644
    with pytest.raises(RuntimeError), staged_file(target) as temporary:
        temporary.write_bytes(b"half")
        raise RuntimeError("failed mid-write")
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]


def test_saved_weights_are_readable_like_their_siblings(tmp_path):
    """A model directory's safetensors file had mode 0600 beside 0644 files (safetensors' writer)."""
    import stat

    from k2lab import build_model, load_preset
    from k2lab.model_dir import save_model

    out = save_model(build_model(load_preset("k2-nano")), tmp_path / "model")
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in out.iterdir()}
    assert set(modes.values()) == {0o644}, modes
