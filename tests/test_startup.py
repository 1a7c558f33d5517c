"""The commands' pause of the cyclic garbage collector during start-up (rvllm.startup)."""

from __future__ import annotations

import gc

from rvllm import startup


def test_pause_then_resume_freezes_what_start_up_made() -> None:
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    startup.pause_collector()
    try:
        assert not gc.isenabled()
        objects = [[i] for i in range(1000)]  # start-up's long-lived objects
        startup.resume_collector()
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(objects)
    finally:
        gc.unfreeze()  # leave this test process as it was
        gc.enable()


def test_resume_leaves_a_collector_it_did_not_pause_alone() -> None:
    gc.disable()  # e.g. a library caller's own setting
    try:
        startup.resume_collector()
        assert not gc.isenabled()
    finally:
        gc.enable()
    startup.resume_collector()  # nothing paused: nothing to do
    assert gc.isenabled()


def test_an_early_end_resumes_without_freezing() -> None:
    frozen = gc.get_freeze_count()
    startup.pause_collector()
    startup.resume_collector(freeze=False)
    assert gc.isenabled() and gc.get_freeze_count() == frozen
