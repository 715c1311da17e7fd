"""Request cancellation in the worker, without processes: the worker's cancel flags and
pb_utils.is_cancelled()."""

from __future__ import annotations

from services.workers.python import pb_utils
from services.workers.python.cancel import EARLY_MAX, Cancels


# ------------------------------------------------------------------------- worker flags
def test_flags_follow_running_requests():
    c = Cancels()
    a, b = c.track(("r", 1)), c.track(("r", 2))
    c.cancel([("r", 1), ("other", 2)])
    assert (a.cancelled, b.cancelled) == (True, False)
    c.done(("r", 2))
    c.cancel([("r", 2)])                           # done: no longer followed
    assert not b.cancelled


def test_a_cancel_that_overtakes_its_request_applies_when_it_arrives():
    c = Cancels()
    c.cancel([("r", 7)])
    assert c.track(("r", 7)).cancelled
    assert not c.track(("r", 8)).cancelled


def test_remembered_cancels_are_bounded():
    c = Cancels()
    c.cancel([("r", i) for i in range(EARLY_MAX + 10)])
    assert not c.track(("r", 0)).cancelled         # the oldest were forgotten
    assert c.track(("r", EARLY_MAX + 9)).cancelled


def test_is_cancelled_reads_the_shared_flag():
    c = Cancels()
    req = pb_utils.InferenceRequest("m")
    assert not req.is_cancelled()                  # a BLS request of the model's own
    req._flag = c.track(("r", 1))
    sender = pb_utils.InferenceResponseSender(lambda resp, final: None, req._flag)
    assert not req.is_cancelled() and not sender.is_cancelled()
    c.cancel([("r", 1)])
    assert req.is_cancelled() and sender.is_cancelled()
