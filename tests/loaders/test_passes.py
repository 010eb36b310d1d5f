"""One pass over a loader: close() ends it for every backend (the loader contract runs it end to end in
test_base_*.py); here the wrapping itself and the pass token."""

from dali_fast.loaders.passes import CLOSED, Pass, close_ends_the_pass, end_pass


def test_a_backend_close_is_wrapped_once_and_runs_as_written_without_a_pass():
    class Backend:
        def close(self):
            self.closed_by_backend = True

    close_ends_the_pass(Backend)
    wrapped = Backend.close
    close_ends_the_pass(Backend)  # a subclass of a wrapped class is not wrapped twice
    assert Backend.close is wrapped and Backend.close.__name__ == "close"
    b = Backend()
    b.close()
    assert b.closed_by_backend


def test_end_pass_marks_the_token_closed_and_closes_its_run():
    import weakref

    def run():
        try:
            yield 1
            yield 2
        finally:
            released.append(True)

    released = []
    gen = run()
    next(gen)  # suspended at its first yield, as a pass between two batches

    class Loader:
        pass

    token = Pass()
    token.run = weakref.ref(gen)
    loader = Loader()
    loader._current_pass, loader._active, loader._epoch_bs = token, None, 8
    end_pass(loader)
    assert token.closed and loader._current_pass is None and loader._epoch_bs is None and released == [True]
    assert "close()" in CLOSED


def test_a_wrapped_close_ends_the_pass_in_progress_before_the_backend_s_close_runs(caplog):
    """A backend's own close(), wrapped, first ends the pass in progress: its run is closed (what it holds is
    released), the token says closed, then the backend's close() runs; the debug log says so."""
    import logging
    import weakref

    events = []

    class Backend:
        def close(self):
            events.append(("backend close", token.closed))

    def run():
        try:
            yield 1
            yield 2
        finally:
            events.append(("run released", token.closed))

    close_ends_the_pass(Backend)
    gen = run()
    next(gen)
    token = Pass()
    token.run = weakref.ref(gen)
    b = Backend()
    b._current_pass, b._active, b._epoch_bs = token, None, 8
    with caplog.at_level(logging.DEBUG, logger="dali_fast.loaders.passes"):
        b.close()
    assert events == [("run released", True), ("backend close", True)]
    assert b._current_pass is None and b._epoch_bs is None
    assert [r.getMessage() for r in caplog.records] == ["close() ended the pass in progress"]
