"""plumbing/gc_pause.py: the collector is off only while imports or a load run, then as before."""

from __future__ import annotations

import gc

import pytest

from plumbing.gc_pause import gc_paused


def test_the_collector_is_off_inside_and_back_on_after_even_on_an_error():
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        assert not gc.isenabled()
        raise ValueError("boom")
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off():
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_freeze_moves_what_is_alive_to_the_permanent_generation():
    before = gc.get_freeze_count()
    try:
        with gc_paused(freeze=True):
            kept = [[i] for i in range(1000)]
        assert gc.get_freeze_count() >= before + len(kept)
    finally:
        gc.unfreeze()
        gc.freeze()  # the worker's collection-time freeze (tests/conftest.py), restored


def test_loading_a_model_and_tokenizer_leaves_the_collector_on(tiny_model_dir):
    from training.backend.model_io import load_model, load_tokenizer

    load_tokenizer(tiny_model_dir)
    load_model(tiny_model_dir)
    assert gc.isenabled()
    with pytest.raises(Exception, match="no such directory"):
        load_model(tiny_model_dir / "missing")
    assert gc.isenabled()


@pytest.mark.parametrize("first_out", ["worker", "main"])
def test_overlapping_pauses_on_two_threads_end_with_the_collector_on(first_out):
    """An engine's `_load` on a worker thread while the main thread loads a lazy export: either
    pause may end first, and whichever order they end in, the collector is on afterwards."""
    import threading

    entered, release = threading.Event(), threading.Event()

    def worker():
        with gc_paused():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=worker)
    thread.start()
    assert entered.wait(10)
    with gc_paused():  # entered while the worker's pause holds
        if first_out == "worker":
            release.set()
            thread.join(10)
    release.set()
    thread.join(10)
    assert gc.isenabled()
