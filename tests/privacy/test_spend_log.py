"""The spend log: every branch of a run keeps its own releases, and a lineage's total is their sum."""

from __future__ import annotations

import json
import pickle
import warnings

import pytest

from lit_zodp.privacy import SpendLog, SubsampledGaussian
from lit_zodp.privacy.spend_log import SPEND_DIR_ENV, STEPS_WIDTH, default_spend_dir, new_id

A, B = SubsampledGaussian(1.0, 0.1), SubsampledGaussian(2.0, 0.05)


def steps(log: SpendLog, count: int) -> None:
    for _ in range(count):
        log.count_step()


def test_a_lineage_released_the_sum_of_its_branches_own_releases(tmp_path):
    log = SpendLog(tmp_path)
    lineage, other = new_id(), new_id()
    log.open_branch(lineage, "first", {A: 1})
    steps(log, 12)
    log.open_branch(lineage, "second", {A: 1, B: 2})  # a step that releases two kinds (one and two of them)
    steps(log, 3)
    SpendLog(tmp_path).open_branch(other, "elsewhere", {A: 1})  # another run; a branch that made no step
    log.open_branch(other, "later", {A: 1})
    steps(log, 100)
    assert log.released(lineage) == {A: 15, B: 6}
    assert log.released(other) == {A: 100}  # read while its branch is still open
    log.close()
    assert log.released(new_id()) == {}


def test_a_record_is_json_with_the_steps_padded_in_place(tmp_path):
    log = SpendLog(tmp_path)
    log.open_branch("run", "branch", {A: 1})
    steps(log, 10 ** 4)
    log.close()
    text = (tmp_path / "run" / "branch.json").read_text()
    assert json.loads(text)["steps"] == 10 ** 4 and text.endswith(f"{10 ** 4:{STEPS_WIDTH}d}}}\n")


def test_a_record_keeps_its_branchs_marks_and_one_without_them_reads_as_unmarked(tmp_path):
    """Review 31: what makes a branch's steps no guarantee (no noise, shuffled batches, a test noise seed) is in its
    record, for the other branches that count it; a record from before has none."""
    log = SpendLog(tmp_path)
    log.open_branch("run", "noiseless", {}, ["noiseless"])
    steps(log, 3)
    log.open_branch("run", "seeded", {A: 1}, ["poisson_assumed", "test_seeded"])
    steps(log, 2)
    log.close()
    (tmp_path / "run" / "old.json").write_text('{"per_step": [[{"kind": "subsampled_gaussian", "noise_multiplier": '
                                               '1.0, "sample_rate": 0.1}, 1]], "steps": 5}')
    branches = SpendLog(tmp_path).branches("run")
    assert branches["noiseless"] == ({}, 3, ("noiseless",))
    assert branches["seeded"] == ({A: 1}, 2, ("poisson_assumed", "test_seeded"))
    assert branches["old"] == ({A: 1}, 5, ()) and SpendLog(tmp_path).released("run") == {A: 7}


@pytest.mark.parametrize("missing", ["unsupported", "absent"])
def test_a_file_system_without_fallocate_still_keeps_the_record(tmp_path, monkeypatch, missing):
    import errno

    from lit_zodp.privacy import spend_log

    def refuse(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    if missing == "absent":  # (macOS)
        monkeypatch.delattr(spend_log.os, "posix_fallocate", raising=False)
    else:
        monkeypatch.setattr(spend_log.os, "posix_fallocate", refuse)
    log = SpendLog(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log.open_branch("run", "branch", {A: 1})
    steps(log, 7)
    assert log.released("run") == {A: 7}


def test_a_full_disk_warns_instead_of_writing_a_record(tmp_path, monkeypatch):
    import errno

    from lit_zodp.privacy import spend_log

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spend_log.os, "posix_fallocate", full)
    log = SpendLog(tmp_path)
    with pytest.warns(UserWarning, match="No space left"):
        log.open_branch("run", "branch", {A: 1})
    steps(log, 2)  # counts nothing, raises nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert log.released("run") == {}  # no empty record left behind to warn about as torn


def test_an_unreadable_record_warns_and_counts_nothing(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "torn.json").write_text('{"per_step": [[{"kind"')
    log = SpendLog(tmp_path)
    log.open_branch("run", "good", {A: 1})
    steps(log, 4)
    with pytest.warns(UserWarning, match="unreadable spend record"):
        assert log.released("run") == {A: 4}


def test_an_unwritable_directory_warns_once_and_never_raises(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    log = SpendLog(blocker / "spend")  # a directory below a file cannot be made
    with pytest.warns(UserWarning, match=f"Cannot write the spend log.*{SPEND_DIR_ENV}"):
        log.open_branch("run", "branch", {A: 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        steps(log, 2)  # no second warning, no error


def test_a_copy_does_not_write_the_branch_record(tmp_path):
    log = SpendLog(tmp_path)
    log.open_branch("run", "branch", {A: 1})
    steps(log, 2)
    copy = pickle.loads(pickle.dumps(log))
    steps(copy, 5)
    steps(log, 1)
    log.close()
    assert SpendLog(tmp_path).released("run") == {A: 3}


def test_the_directory_comes_from_the_environment_or_the_xdg_state_home(monkeypatch, tmp_path):
    monkeypatch.setenv(SPEND_DIR_ENV, str(tmp_path / "mine"))
    assert default_spend_dir() == tmp_path / "mine"
    monkeypatch.delenv(SPEND_DIR_ENV)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert default_spend_dir() == tmp_path / "state" / "lit_zodp" / "spend"
