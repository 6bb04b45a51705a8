"""Shared by the fuzzers: no exception may escape a background thread of this process.

``MINICOMM_FUZZ_EXAMPLES`` sets the examples per hypothesis test (default: CI-sized)."""
import sys

import pytest

sys.path.insert(0, __file__.rsplit("/", 2)[0])     # tests/: leaks.py


@pytest.fixture(autouse=True)
def no_uncaught_thread_exceptions():
    from leaks import thread_exceptions
    with thread_exceptions() as caught:
        yield caught
    assert not caught, f"uncaught exceptions in background threads: {caught}"
