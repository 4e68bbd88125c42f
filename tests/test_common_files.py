"""megatron.common.files: outputs appear complete or not at all, with umask permissions."""

import os
import stat

import pytest

from megatron.common.files import (
    atomic_write,
    leftover_temporaries,
    missing_file,
    staged_paths,
)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_write_replaces_the_file_with_umask_permissions(tmp_path):
    target = tmp_path / "out.txt"
    target.write_bytes(b"old")
    old_mask = os.umask(0o027)
    try:
        atomic_write(str(target), lambda stream: stream.write(b"new"))
    finally:
        os.umask(old_mask)
    assert target.read_bytes() == b"new"
    assert _mode(target) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_atomic_write_error_keeps_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.txt"
    target.write_bytes(b"old")

    def fail(stream):
        stream.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(str(target), fail)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_staged_files_appear_together_in_order_only_when_the_body_returns(tmp_path):
    targets = [str(tmp_path / "d.bin"), str(tmp_path / "d.idx")]
    with staged_paths(*targets) as temporaries:
        assert [os.path.dirname(t) for t in temporaries] == [str(tmp_path)] * 2
        for temporary, content in zip(temporaries, (b"bin", b"idx")):
            with open(temporary, "wb") as f:  # writers open them by path
                f.write(content)
        assert not any(os.path.exists(t) for t in targets)
    assert [open(t, "rb").read() for t in targets] == [b"bin", b"idx"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]


def test_staged_files_are_removed_on_error(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with staged_paths(str(tmp_path / "a"), str(tmp_path / "b")) as temporaries:
            with open(temporaries[0], "wb") as f:
                f.write(b"partial")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_staged_directory_is_renamed_into_place_or_removed(tmp_path):
    old_mask = os.umask(0o022)
    try:
        with staged_paths(str(tmp_path / "built"), directories=True) as (temporary,):
            (tmp_path / temporary / "inside.txt").write_text("x")
    finally:
        os.umask(old_mask)
    assert (tmp_path / "built" / "inside.txt").read_text() == "x"
    assert _mode(tmp_path / "built") == 0o755

    with pytest.raises(ValueError):
        with staged_paths(str(tmp_path / "other"), directories=True) as (temporary,):
            (tmp_path / temporary / "inside.txt").write_text("x")
            raise ValueError
    assert [p.name for p in tmp_path.iterdir()] == ["built"]


def test_leftover_temporaries_are_those_of_the_target_only(tmp_path):
    target = tmp_path / "corpus"
    killed = tmp_path / ".tmp-abc123corpus"
    killed.mkdir()
    (tmp_path / ".tmp-abc123other").mkdir()
    (tmp_path / "corpus.lock").write_text("")
    assert leftover_temporaries(str(target)) == [str(killed)]


def test_a_directory_given_for_an_input_file_is_named_as_one(tmp_path):
    """Was "file not found" / "does not exist", which sends the user looking for a typo."""
    from megatron.data.checks import DataError, check_writable_prefix
    from megatron.data.tokenizer import TokenizerError, load_tokenizer
    from megatron.schedules.schedule_file import read_schedule

    assert missing_file(str(tmp_path)) == "a directory, not a file"
    assert missing_file(str(tmp_path / "none")) == "file not found"
    (tmp_path / "link").symlink_to(tmp_path / "none")
    assert missing_file(str(tmp_path / "link")) == "a broken symbolic link"
    with pytest.raises(ValueError, match="': a directory, not a file$"):
        read_schedule(str(tmp_path))
    with pytest.raises(TokenizerError, match="': a directory, not a file .*HuggingFaceTokenizer"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError, match=f"directory '{tmp_path / 'file'}' is a file$"):
        check_writable_prefix(str(tmp_path / "file" / "out"))
