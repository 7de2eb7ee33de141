"""staged_directory: a directory is replaced whole or not at all."""

from pathlib import Path

import pytest

from k2lab.fsutil import staged_directory


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
