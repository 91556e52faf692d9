"""The spend log: what every branch of a private run released, so a rollback or a fork stays counted.

A checkpoint's ledger counts the releases that led to it, and nothing after. Resuming an older
checkpoint after the run went further, or continuing one checkpoint twice, releases again on top
of releases the resumed ledger does not know: two branches of 8 steps after a shared 8 each report
epsilon 4.0, and together spend 5.23. So every private run has a *lineage* (a random id drawn at its
first fit, kept in its checkpoints), every fit of it is a *branch* (a random id per fit), and each
branch keeps the count of its own steps in ``<directory>/<lineage>/<branch>.json``, rewritten in
place after every step (a memory-mapped field: no system call). A fit that continues a lineage
sums the branches' own releases: that is every release the lineage ever made, and what the
checkpoint's ledger lacks is added to this fit's ledger (its epsilon and budget) with a warning.

The directory is ``$LIT_ZODP_SPEND_DIR``, else ``$XDG_STATE_HOME/lit_zodp/spend`` (default
``~/.local/state``): one per machine, so branches are found whatever directory each fit logs to.
Only this machine's branches are found (a checkpoint copied elsewhere takes its ledger, not the
others' releases), and two branches running at the same time each see the other only at the next
fit of the lineage.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import warnings
from pathlib import Path
from typing import Mapping, NamedTuple, Optional, Sequence

from lit_zodp.errors import LitZodpWarning
from lit_zodp.privacy.mechanisms import Mechanism, mechanism_from_dict, mechanism_to_dict

SPEND_DIR_ENV = "LIT_ZODP_SPEND_DIR"
STEPS_WIDTH = 20  # digits of a branch's step count (JSON allows the spaces that pad it)

Counts = dict[Mechanism, int]

#: What makes a branch's steps no guarantee, which its releases do not show: ``noiseless`` (sigma = 0: it releases
#: the clipped sums themselves, and records no mechanism), ``poisson_assumed`` (shuffled batches accounted as
#: Poisson), ``test_seeded`` (noise a ``noise_seed`` reproduces). A fit counting the branch takes its marks.
MARKS = ("noiseless", "poisson_assumed", "test_seeded")


class Branch(NamedTuple):
    """One branch's record: what one of its steps releases, its steps, and its :data:`MARKS`."""

    per_step: Counts
    steps: int
    marks: tuple = ()


def default_spend_dir() -> Path:
    """``$LIT_ZODP_SPEND_DIR``, else ``$XDG_STATE_HOME/lit_zodp/spend`` (``~/.local/state/...``)."""
    configured = os.environ.get(SPEND_DIR_ENV)
    if configured:
        return Path(configured)
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "lit_zodp" / "spend"


def new_id() -> str:
    """A random 128-bit id (lineages and branches: unique, not secret)."""
    return os.urandom(16).hex()


class SpendLog:
    """One directory of branch records; :meth:`released` sums a lineage's branches.

    A branch's record is the JSON ``{"per_step": [[mechanism, count], ...], "marks": [...], "steps": N}``: what one
    step releases (fixed within a fit), its :data:`MARKS` and the steps this fit made. ``N`` is a fixed-width field of
    the memory-mapped file, rewritten after every step (about a microsecond, no system call; a
    killed process leaves it in the page cache, which the kernel writes out).

    Args:
        directory: where records live (default :func:`default_spend_dir`).
    """

    def __init__(self, directory: Optional[os.PathLike | str] = None) -> None:
        self.directory = Path(directory) if directory is not None else default_spend_dir()
        self.path: Optional[Path] = None  # this fit's branch record
        self._map: Optional[mmap.mmap] = None
        self._steps = 0
        self._at = 0

    def released(self, lineage: str) -> Counts:
        """Every release of ``lineage``: the sum over its branches of each one's own releases."""
        return summed(self.branches(lineage))

    def branches(self, lineage: str) -> dict[str, Branch]:
        """``{branch: Branch}`` of every readable record of ``lineage``."""
        found = {}
        for path in sorted((self.directory / lineage).glob("*.json")):
            record = _read_branch(path)
            if record is not None:
                found[path.stem] = record
        return found

    def open_branch(self, lineage: str, branch: str, per_step: Mapping[Mechanism, int],
                    marks: Sequence[str] = ()) -> None:
        """Start this fit's record at 0 steps (never raises: warns where it cannot be written)."""
        self.close()
        self.path = self.directory / lineage / f"{branch}.json"
        head = f'{{"per_step": {json.dumps(encode_counts(per_step))}, "marks": {json.dumps(list(marks))}, "steps": '
        self._at, self._steps = len(head.encode()), 0
        record = f"{head}{0:{STEPS_WIDTH}d}}}\n".encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._map = _mapped_file(self.path, len(record))
            self._map[:] = record
        except OSError as error:
            warnings.warn(f"Cannot write the spend log {self.path} ({error}): a later rollback or fork of this "
                          f"run will not be counted. Set {SPEND_DIR_ENV} to a writable directory.",
                          LitZodpWarning, stacklevel=2)

    def count_step(self, steps: int = 1) -> None:
        """``steps`` more steps of this branch."""
        if self._map is not None:
            self._steps += steps
            self._map[self._at:self._at + STEPS_WIDTH] = b"%*d" % (STEPS_WIDTH, self._steps)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
        self._map = None

    def __getstate__(self) -> dict:  # a copy (pickled, deep-copied) does not write this fit's record
        return {**self.__dict__, "_map": None}


#: posix_fallocate's answers for a file system that cannot allocate ahead (then the record is written once).
_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _mapped_file(path: Path, size: int) -> mmap.mmap:
    """A new file of ``size`` bytes, its blocks allocated (a full disk fails here, not at a later store) and
    mapped, with nothing written through ``write()``. On this project's test VM (Linux 6.18, ext4) a page
    first written by ``write()`` took a page fault at every later store through the map (4 us of a 1.4 ms
    quickstart step); one allocated by ``posix_fallocate`` and written only through the map does not."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except (AttributeError, OSError) as error:  # macOS has none; a file system may not support it
            if isinstance(error, OSError) and error.errno not in _NO_FALLOCATE:
                raise  # a full disk, a quota: the caller warns
            os.write(fd, bytes(size))
        return mmap.mmap(fd, size)
    except OSError:
        os.unlink(path)  # no empty record left for the next fit to read as torn
        raise
    finally:
        os.close(fd)


def encode_counts(counts: Mapping[Mechanism, int]) -> list:
    """``[[mechanism dict, count], ...]``: plain data (JSON, and broadcasts between DDP ranks)."""
    return [[mechanism_to_dict(m), int(c)] for m, c in counts.items()]


def decode_counts(entries: list) -> Counts:
    counts: Counts = {}
    for state, count in entries:
        mechanism = mechanism_from_dict(state)
        counts[mechanism] = counts.get(mechanism, 0) + int(count)
    return counts


def summed(branches: Mapping[str, Branch]) -> Counts:
    """The releases of ``{branch: Branch}`` over all its branches."""
    total: Counts = {}
    for branch in branches.values():
        for mechanism, count in branch.per_step.items():
            total[mechanism] = total.get(mechanism, 0) + count * branch.steps
    return total


def _read_branch(path: Path) -> Optional[Branch]:
    """One branch's record (a record from before review 31 has no marks); an unreadable one warns and counts
    nothing."""
    try:
        record = json.loads(path.read_text())
        return Branch(decode_counts(record["per_step"]), int(record["steps"]), tuple(record.get("marks", ())))
    except (OSError, ValueError, KeyError, TypeError) as error:
        warnings.warn(f"Skipping the unreadable spend record {path} ({error}): its releases are not counted",
                      LitZodpWarning, stacklevel=3)
        return None


__all__ = ["Branch", "MARKS", "SPEND_DIR_ENV", "STEPS_WIDTH", "SpendLog", "decode_counts", "default_spend_dir", "encode_counts",
           "new_id", "summed"]
