"""Shared by the fuzzers: no exception may escape a background thread of this process.

``MINICOMM_FUZZ_EXAMPLES`` sets the examples per hypothesis test (default: CI-sized)."""
import sys
import threading

import pytest

sys.path.insert(0, __file__.rsplit("/", 2)[0])     # tests/: leaks.py


@pytest.fixture(autouse=True)
def no_uncaught_thread_exceptions():
    caught = []
    old = threading.excepthook
    threading.excepthook = lambda args: caught.append(
        f"{args.thread.name if args.thread else '?'}: {args.exc_type.__name__}: {args.exc_value}")
    try:
        yield caught
    finally:
        threading.excepthook = old
    assert not caught, f"uncaught exceptions in background threads: {caught}"
