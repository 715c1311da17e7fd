"""services.scheduler.ensemble.EnsembleQueue with recording callbacks: which steps run with
which inputs, when the answer goes, which shared-memory blocks go back to their workers
(and which the frontend keeps), max_inflight_requests, decoupled steps."""
from __future__ import annotations

from google.protobuf import text_format

from protos import model_config_pb2 as mc
from services.common import messages as m
from services.common.errors import CANCELLED_TEXT, Code
from services.scheduler.dispatch import Pending
from services.scheduler.ensemble import EnsembleQueue
from services.scheduler.ensemble_config import step_order
from services.scheduler.stats import VersionStats

CHAIN = '''
name: "e" platform: "ensemble" max_batch_size: 8
input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "SIDE" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "first" model_version: -1 input_map { key: "X" value: "A" }
    output_map { key: "Y" value: "mid" } },
  { model_name: "second" model_version: -1 input_map { key: "X" value: "mid" }
    output_map { key: "Y" value: "OUT" } },
  { model_name: "side" model_version: -1 input_map { key: "X" value: "A" }
    output_map { key: "Y" value: "SIDE" } } ] }
'''


class Harness:
    def __init__(self, text: str = CHAIN, **fields) -> None:
        cfg = text_format.Parse(text, mc.ModelConfig())
        for k, v in fields.items():
            if k == "decoupled":
                cfg.model_transaction_policy.decoupled = v
            else:
                setattr(cfg.ensemble_scheduling, k, v)
        self.submitted: list[m.InferRequest] = []
        self.answers: list[tuple[Pending, m.InferResult]] = []
        self.failed: list[tuple[Pending, int, str]] = []
        self.released: list[tuple[str, int]] = []
        self.q = EnsembleQueue("e", 1, cfg, step_order(cfg), self.submit, self.respond,
                               self.fail, self.released.extend, VersionStats())
        self.n = 0

    def submit(self, queue, req, frames, domain) -> None:
        assert queue is self.q
        self.submitted.append(req)

    def respond(self, p, result, frames) -> None:
        self.answers.append((p, result))

    def fail(self, p, code, text, reason) -> None:
        self.failed.append((p, code, text))

    def request(self, outputs: list[str] | None = None) -> Pending:
        self.n += 1
        req = m.InferRequest(self.n, "r", "e", 1, [m.TensorRef("A", "FP32", [1, 4], 16, frame=0)],
                             outputs or [])
        p = Pending(b"f", req, [b"\0" * 16], arrival_ns=0)
        self.q.enqueue(p)
        return p

    def step(self, model: str) -> m.InferRequest:
        return next(r for r in reversed(self.submitted) if r.model == model)

    def answer(self, req: m.InferRequest, block: tuple[str, int] | None = None, **kw) -> None:
        out = m.TensorRef("Y", "FP32", [1, 4], 16, frame=-1 if block else 0,
                          segment=block[0] if block else "", offset=block[1] if block else 0)
        self.q.step_result(m.InferResult(req.req_id, outputs=[out], **kw), [] if block else [b"y" * 16])


def test_steps_run_when_their_inputs_exist_and_blocks_go_back_when_done():
    h = Harness()
    h.request()
    assert [r.model for r in h.submitted] == ["first", "side"]           # both take A
    assert h.step("first").inputs[0].name == "X" and h.step("first").inputs[0].frame == 0
    h.answer(h.step("first"), ("trireme-7-out-0", 64))                 # mid in shared memory
    second = h.step("second")
    assert second.inputs[0].segment == "trireme-7-out-0"                # passed on by reference
    h.answer(second, ("trireme-8-out-0", 0))
    assert h.answers == []                                               # SIDE still missing
    h.answer(h.step("side"))
    (p, result), = h.answers
    assert [o.name for o in result.outputs] == ["OUT", "SIDE"] and result.final
    assert result.outputs[0].segment == "trireme-8-out-0"                # the frontend releases it
    assert h.released == [("trireme-7-out-0", 64)]                       # mid: no longer needed
    assert h.q.stats.success[0] == 1 and not h.q.busy


def test_only_the_steps_leading_to_the_requested_outputs_run():
    h = Harness()
    h.request(["SIDE"])
    assert [r.model for r in h.submitted] == ["side"]
    h.answer(h.step("side"))
    assert [o.name for o in h.answers[0][1].outputs] == ["SIDE"]


def test_a_failing_step_fails_the_request_once_and_late_answers_are_released():
    h = Harness()
    p = h.request()
    h.q.step_result(m.InferResult(h.step("first").req_id, error=m.ErrorRecord(13, "boom")), [])
    assert h.failed == [(p, 13, "in ensemble 'e', boom")]
    h.answer(h.step("side"), ("trireme-9-out-0", 128))                  # still running then
    assert h.failed == [(p, 13, "in ensemble 'e', boom")] and h.answers == []
    assert ("trireme-9-out-0", 128) in h.released and not h.q.busy


def test_max_inflight_requests_limits_each_step_over_all_requests():
    """Triton's ensemble backpressure: at most N requests in flight at each step."""
    h = Harness(max_inflight_requests=1)
    h.request()
    h.request()
    assert [r.model for r in h.submitted] == ["first", "side"]          # the second waits
    assert len(h.q.stats.batcher) == 2                                    # (both of its steps)
    h.answer(h.submitted[0])                                              # 1st's "first" done
    assert [r.model for r in h.submitted[2:]] == ["first", "second"]     # 2nd's first, its next
    h.answer(h.submitted[1])                                              # 1st's "side" done
    assert h.submitted[-1].model == "side" and len(h.q.stats.batcher) == 0


def test_cancel_answers_a_running_request_cancelled():
    h = Harness()
    p = h.request()
    removed, rest = h.q.cancel(b"f", [p.req.req_id])
    assert removed == [] and rest == [p.req.req_id]
    assert h.failed == [(p, Code.CANCELLED, CANCELLED_TEXT)]   # not "in ensemble ..."
    h.answer(h.step("first"), ("trireme-7-out-0", 64))         # arrives late: handed back
    assert h.released == [("trireme-7-out-0", 64)] and h.submitted[-1].model == "side"


DECOUPLED = '''
name: "e" platform: "ensemble" max_batch_size: 0
input [ { name: "A" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "repeat" model_version: -1 input_map { key: "X" value: "A" }
    output_map { key: "Y" value: "one" } },
  { model_name: "double" model_version: -1 input_map { key: "X" value: "one" }
    output_map { key: "Y" value: "OUT" } } ] }
'''


def test_each_response_of_a_decoupled_step_runs_the_rest_and_answers():
    h = Harness(DECOUPLED, decoupled=True)
    h.request()
    repeat = h.step("repeat")
    for _ in range(3):
        h.answer(repeat, final=False)
    assert [r.model for r in h.submitted] == ["repeat", "double", "double", "double"]
    for req in h.submitted[1:]:
        h.answer(req)
    assert len(h.answers) == 3 and not any(r.final for _, r in h.answers)
    h.q.step_result(m.InferResult(repeat.req_id, final=True, empty=True), [])
    last = h.answers[-1][1]
    assert last.final and last.empty and not h.q.busy


def test_the_last_answer_is_final_when_nothing_else_runs():
    """Triton's FinishEnsemble: an answer sent when no step is in flight carries the final
    flag; no bare flag follows."""
    h = Harness(DECOUPLED, decoupled=True)
    h.request()
    repeat = h.step("repeat")
    h.answer(repeat, final=False)
    h.answer(repeat, final=False)
    h.q.step_result(m.InferResult(repeat.req_id, final=True, empty=True), [])
    first, second = h.submitted[1:]
    h.answer(first)
    h.answer(second)
    assert [(r.final, r.empty) for _, r in h.answers] == [(False, False), (True, False)]
    assert not h.q.busy
