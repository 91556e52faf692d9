"""The spend log: every branch of a run keeps its own releases, and a lineage's total is their sum."""

from __future__ import annotations

import pickle
import warnings

import pytest

from lit_zodp.privacy import SpendLog, SubsampledGaussian
from lit_zodp.privacy.spend_log import SPEND_DIR_ENV, default_spend_dir, new_id

A, B = SubsampledGaussian(1.0, 0.1), SubsampledGaussian(2.0, 0.05)


def test_a_lineage_released_the_sum_of_its_branches_own_releases(tmp_path):
    log = SpendLog(tmp_path)
    lineage, other = new_id(), new_id()
    log.open_branch(lineage, "first")
    for step in range(1, 13):
        log.write({A: step})  # rewritten in place: the last count stands
    log.open_branch(lineage, "second")
    log.write({A: 3, B: 2})
    log.open_branch(other, "elsewhere")
    log.write({A: 100})
    log.close()
    assert log.released(lineage) == {A: 15, B: 2}
    assert log.released(other) == {A: 100}
    assert log.released(new_id()) == {}


def test_a_record_rewritten_shorter_still_parses(tmp_path):
    log = SpendLog(tmp_path)
    log.open_branch("run", "branch")
    log.write({A: 5, B: 7})
    log.write({A: 6})  # a shorter text over a longer one
    log.close()
    assert SpendLog(tmp_path).released("run") == {A: 6}


def test_an_unreadable_record_warns_and_counts_nothing(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "torn.json").write_text('{"releases": [[{"kind"')
    log = SpendLog(tmp_path)
    log.open_branch("run", "good")
    log.write({A: 4})
    with pytest.warns(UserWarning, match="unreadable spend record"):
        assert log.released("run") == {A: 4}


def test_an_unwritable_directory_warns_once_and_never_raises(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    log = SpendLog(blocker / "spend")  # a directory below a file cannot be made
    log.open_branch("run", "branch")
    with pytest.warns(UserWarning, match=f"Cannot write the spend log.*{SPEND_DIR_ENV}"):
        log.write({A: 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log.write({A: 2})  # no second warning


def test_a_copy_for_another_process_opens_its_own_file(tmp_path):
    log = SpendLog(tmp_path)
    log.open_branch("run", "branch")
    log.write({A: 1})
    copy = pickle.loads(pickle.dumps(log))
    assert copy._fd is None
    copy.write({A: 2})
    log.close(), copy.close()
    assert SpendLog(tmp_path).released("run") == {A: 2}


def test_the_directory_comes_from_the_environment_or_the_xdg_state_home(monkeypatch, tmp_path):
    monkeypatch.setenv(SPEND_DIR_ENV, str(tmp_path / "mine"))
    assert default_spend_dir() == tmp_path / "mine"
    monkeypatch.delenv(SPEND_DIR_ENV)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert default_spend_dir() == tmp_path / "state" / "lit_zodp" / "spend"
