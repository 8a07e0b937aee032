"""The transfer engine's bookkeeping of in-flight work (no GPU needed: events and submissions are stubs).
What it holds must stay alive until the work that uses it is over: for a copy, until its event has completed;
for a background submission, until the submitting thread has finished *and* its last events have completed."""

import pytest

from kvtier.transfer import TransferEngine


class Event:
    def __init__(self, done=False):
        self.done = done
        self.synced = 0

    def query(self):
        return self.done

    def synchronize(self):
        self.synced += 1
        self.done = True


class Submission:
    def __init__(self, finished=False, error=None):
        self._finished = finished
        self.error = error
        self.joined = 0

    def finished(self):
        return self._finished

    def join(self):
        self.joined += 1
        self._finished = True
        if self.error:
            raise RuntimeError(self.error)


def held(engine):
    return engine.inflight.held()


def test_refs_go_only_when_their_event_has_completed_and_in_order():
    eng = TransferEngine()
    a, b = Event(), Event()
    eng.inflight.hold(("a",), a)
    eng.inflight.hold(("b",), b)
    assert held(eng) == [("a",), ("b",)]
    b.done = True  # the later one finished first: the earlier still holds the line
    eng.inflight.hold(("c",), Event(done=True))
    assert ("a",) in held(eng)
    a.done = True
    eng.inflight.hold(("d",), Event())
    assert held(eng) == [("d",)]


def test_a_background_submission_holds_until_finished_and_all_its_last_events_completed():
    eng = TransferEngine()
    sub = Submission()
    lanes = [Event(done=True), Event(done=False)]
    eng.inflight.hold(("load",), lanes, sub)
    eng.inflight.hold(("next",), Event(done=True))
    assert ("load",) in held(eng), "released while the submitting thread was still running"
    sub._finished = True
    eng.inflight.hold(("next2",), Event(done=True))
    assert ("load",) in held(eng), "released while one lane's last event was pending"
    lanes[1].done = True
    eng.inflight.hold(("next3",), Event(done=True))
    assert held(eng) == []


def test_synchronize_joins_submissions_even_failed_ones_and_waits_for_every_event():
    eng = TransferEngine()
    ok, failed = Submission(), Submission(error="cuMemcpyBatchAsync failed")
    ev1, ev2, ev3 = Event(), Event(), Event()
    eng.inflight.hold(("x",), [ev1, ev2], ok)
    eng.inflight.hold(("y",), ev3, failed)
    eng.synchronize()
    assert ok.joined == 1 and failed.joined == 1
    assert ev1.synced == ev2.synced == ev3.synced == 1
    assert held(eng) == []


@pytest.mark.parametrize("rows, lanes, blocks, want", [((1536, 1024), 2, 16, [10, 6]), ((1024, 1024), 2, 16, [8, 8]),
                                                        ((1536, 1024), 1, 16, [16, 16]), ((48, 32), 2, 1, [1, 1])])
def test_concurrent_launches_share_the_block_budget(rows, lanes, blocks, want):
    eng = TransferEngine()
    eng.blocks = blocks
    assert eng._split_blocks(list(rows), lanes) == want
