"""The Python stacks a flight-recorder dump holds (csrc/python_stacks.cpp), read while other
threads enter and leave Python: a thread's first entry links its state into the interpreter
without the GIL, and a read that walked the list then met a half-made state and crashed the
process (CI: SIGSEGV in test_trace and test_timeouts)."""

import threading

import pytest

import torus_testing


@pytest.fixture(scope="module")
def testing():
    return torus_testing.module()


def _frames_of_this_test(testing, reads, threads):
    """A frame every read must find: the one that asked."""
    return testing.python_stacks_beside_new_threads(reads, threads)


def _busy_python(stop):
    def deeper(n):
        return deeper(n - 1) if n else sum(range(50))

    while not stop.is_set():
        deeper(30)


@pytest.mark.parametrize("threads", [1, 4])
def test_stacks_beside_threads_entering_python(testing, threads):
    stop = threading.Event()
    busy = threading.Thread(target=_busy_python, args=(stop,), name="busy-python")
    busy.start()
    try:
        holding, without = _frames_of_this_test(testing, 300, threads)
    finally:
        stop.set()
        busy.join()
    assert len(holding) == len(without) == 300
    for text in holding + without:
        assert "_frames_of_this_test" in text, text
        assert "(most recent call first):" in text, text
    # Read under the GIL by this very thread: it is the current one there.
    assert all("Current thread 0x" in text for text in holding), holding[0]


def test_reader_without_gil_gives_up_while_gil_is_kept(testing):
    """A thread that keeps the GIL in native code (3 s here) does not hold up a dump: the reader
    says, after its 1 s wait, why it has no stacks; had it waited for the GIL it would hold them."""
    text = testing.python_stacks_while_gil_kept(3000)
    assert text.startswith("Python stacks not read: the thread taking the GIL for them did not answer "
                           "within 1000 ms"), text
