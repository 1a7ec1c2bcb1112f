"""A failure on a nearly full disk says so (torch.save reports it as "unexpected pos", not ENOSPC)."""

from __future__ import annotations

import shutil
from collections import namedtuple

from bench.run import worker

Usage = namedtuple("Usage", "total used free")


def test_a_nearly_full_disk_is_named_in_the_failure(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 * 2**30, 10 * 2**30 - 5 * 2**20, 5 * 2**20))
    assert worker.low_disk_hint(str(tmp_path)) == f" [the disk holding {tmp_path} has 5 MiB free: probably full]"


def test_a_disk_with_room_adds_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 * 2**30, 2**30, 9 * 2**30))
    assert worker.low_disk_hint(str(tmp_path)) == ""


def test_a_path_that_cannot_be_asked_adds_nothing(monkeypatch, tmp_path):
    def gone(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(shutil, "disk_usage", gone)
    assert worker.low_disk_hint(str(tmp_path / "gone")) == ""
