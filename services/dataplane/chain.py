"""Ensembles a data plane runs itself (owned by DataPlane, client.py): an ensemble the
scheduler publishes as a chain (ModelInfo.chain: steps that can only run one after
another, no max_inflight_requests) goes step by step over its steps' routes, when every
step's version has one, without the scheduler:

    frontend ─step 1─▶ worker A ─▶ frontend ─step 2─▶ worker B ─▶ frontend ─▶ the answer

Four messages where the scheduler's ensemble queue takes six, and no scheduler wake-up.
Each step is a direct request (direct.py) of its own id, so what a direct request gets, a
step gets: a stale epoch or a Goodbye sends it through the scheduler to its model's queue
(only that step: the steps before it are not run again), a worker's death fails it with
that instance's error. The ensemble's semantics are the scheduler's (ensemble.py), kept
here in the same words: a step's outputs become ensemble tensors (output_map), the next
step's inputs are read from them (input_map); tensors in a worker's shared memory go on as
the same reference; only the steps leading to the requested outputs run; a failing step
fails the request "in ensemble '<e>', <its error>" with its code; an output a step left out,
or an optional input the request left out, is absent (ensemble_tensors.ABSENT): a step it
feeds is sent without it, the answer leaves it out, as Triton's; a
cancelled request's step is cancelled and the request answered CANCELLED once that step
has answered (its worker may be reading the inputs until then).

The ensemble's own statistics go to the scheduler in EnsembleStats, at most
ENSEMBLE_STATS_S apart while traffic lasts and at once when it asks (FlushStats); its
steps count in their models' statistics as direct requests.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from services.common import messages as m
from services.common.ensemble_tensors import (
    Tensors,
    answer_outputs,
    deadlock_text,
    request_tensors,
    sequence_echo,
    step_inputs,
    take_outputs,
)
from services.common.errors import CANCELLED_TEXT, Code
from services.common.states import ModelState
from services.dataplane.direct import DirectPath, Route
from services.dataplane.metadata import ModelCache

ENSEMBLE_STATS_S = 0.5

Plan = list[tuple[m.ChainStep, m.ModelInfo, int]]   # each step, its model's info, its version


class Run:
    __slots__ = ("blocks", "cancelled", "k", "model", "msg", "started", "step_id", "steps",
                 "tensors", "version", "wanted")

    def __init__(self, msg: m.InferRequest, model: str, version: int, steps: Plan,
                 wanted: list[str]) -> None:
        self.msg = msg                  # the ensemble request, as the caller sent it
        self.model, self.version = model, version
        self.steps = steps
        self.wanted = wanted            # the outputs to answer with
        self.k = 0                      # the step running
        self.step_id = 0                # its request id
        self.tensors: Tensors = {}
        self.blocks: set[tuple[str, int]] = set()   # step outputs in workers' shared memory
        self.cancelled = False
        self.started = time.monotonic_ns()


class Chains:
    def __init__(self, direct: DirectPath, models: ModelCache, next_id: Callable[[], int],
                 via_scheduler: Callable[[m.InferRequest, list[Any]], None],
                 cancel_scheduled: Callable[[int, str, int], None],
                 deliver: Callable[[m.InferResult, list[Any]], None],
                 release: Callable[[list[tuple[str, int]]], None],
                 send: Callable[[Any], None]) -> None:
        self._direct = direct
        self._models = models             # the data plane's ModelInfo cache
        self._next_id = next_id
        self._via_scheduler = via_scheduler
        self._cancel_scheduled = cancel_scheduled
        self._deliver = deliver           # the ensemble request's answer
        self._release = release           # output blocks back to their workers
        self._send = send                 # to the scheduler
        self.by_step: dict[int, Run] = {}
        self._by_req: dict[int, Run] = {}
        self._records: list[m.EnsembleRecord] = []
        self._sent_at = time.monotonic()

    def plan(self, info: m.ModelInfo) -> Plan | None:
        """``info``'s steps with their models' infos and versions, when each version has a
        route; None: the scheduler runs the request (a step model's info is fetched for
        the requests after it)."""
        plan: Plan = []
        for step in info.chain:
            step_info = self._models.get(step.model)
            if step_info is None:
                self._models.want(step.model)
                return None
            if step_info.error is not None or not step_info.routes:
                return None
            version = step.version or max(
                (v for v, s in step_info.versions.items() if s == ModelState.READY), default=0)
            if not any(r.version == version for r in step_info.routes):
                return None
            plan.append((step, step_info, version))
        return plan

    def start(self, msg: m.InferRequest, frames: list[Any], plan: Plan, route: Route,
              info: m.ModelInfo, version: int) -> None:
        """Run ``msg`` (to ensemble ``info``) along ``plan``, its first step on ``route``."""
        wanted = msg.outputs or [o.name for o in info.outputs]
        run = Run(msg, info.name, version, _needed(plan, wanted), wanted)
        run.tensors = request_tensors(msg.inputs, frames,
                                      [i.name for i in info.inputs if i.optional])
        self._by_req[msg.req_id] = run
        self._advance(run, route)

    def _advance(self, run: Run, route: Route | None = None) -> None:
        """The next step, when its inputs are all there; else the answer."""
        if run.k < len(run.steps) and all(n in run.tensors
                                          for n in run.steps[run.k][0].inputs.values()):
            self._step(run, route)
        else:
            self._complete(run)

    def _step(self, run: Run, route: Route | None = None) -> None:
        step, step_info, version = run.steps[run.k]
        inputs, frames = step_inputs(step.inputs, run.tensors)
        r = run.msg
        run.step_id = self._next_id()
        step_msg = m.InferRequest(run.step_id, r.reply_to, step.model, version, inputs,
                                  list(step.outputs), r.parameters, r.batch_size, r.request_id)
        self.by_step[run.step_id] = run
        if route is None:
            route = self._direct.pick(step_info, version)
        if route is not None:
            self._direct.send(route, step_msg, frames)
        else:   # (its routes went away meanwhile: its model's queue decides)
            self._via_scheduler(step_msg, frames)

    def answered(self, result: m.InferResult, frames: list[Any]) -> bool:
        """A step's answer (its model is not decoupled: one, final); False: not a step's."""
        run = self.by_step.pop(result.req_id, None)
        if run is None:
            return False
        step = run.steps[run.k][0]
        if run.cancelled or result.error is not None:
            self._release([(o.segment, o.offset) for o in result.outputs if o.segment])
            if run.cancelled:
                self._fail(run, Code.CANCELLED, CANCELLED_TEXT, "CANCELED")
            else:
                assert result.error is not None
                self._fail(run, result.error.code,
                           f"in ensemble '{run.model}', {result.error.message}", "OTHER")
            return True
        take_outputs(result, frames, step.outputs, run.tensors, run.blocks, self._release)
        run.k += 1
        self._advance(run)
        return True

    def cancel(self, req_id: int) -> None:
        """The caller of ensemble request ``req_id`` went away: its running step is
        cancelled; it is answered CANCELLED when that step answers."""
        run = self._by_req.get(req_id)
        if run is not None and not run.cancelled:
            run.cancelled = True
            step, _, version = run.steps[run.k]
            self._direct.cancel(run.step_id, step.model, version)
            self._cancel_scheduled(run.step_id, step.model, version)

    def forget(self) -> None:
        """The scheduler connection broke: every caller was answered (UNAVAILABLE)."""
        self.by_step.clear()
        self._by_req.clear()

    # ------------------------------------------------------------------ answers
    def _complete(self, run: Run) -> None:
        """No step is left to run: the answer, without the wanted outputs that are ABSENT
        (a step left them out: Triton answers without them), or, when a wanted tensor never
        came, Triton's error."""
        if not all(n in run.tensors for n in run.wanted):
            self._fail(run, Code.INVALID_ARG, deadlock_text(run.msg.request_id), "OTHER")
            return
        outputs, frames, sent = answer_outputs(run.wanted, run.tensors)
        echo = sequence_echo(run.msg.parameters, outputs)
        self._end(run, run.blocks - sent, "")
        self._deliver(m.InferResult(run.msg.req_id, run.version, outputs, parameters=echo),
                      frames)

    def _fail(self, run: Run, code: int, text: str, reason: str) -> None:
        self._end(run, run.blocks, reason)
        self._deliver(m.InferResult(run.msg.req_id, error=m.ErrorRecord(int(code), text)), [])

    def _end(self, run: Run, unused: set[tuple[str, int]], reason: str) -> None:
        del self._by_req[run.msg.req_id]
        if unused:
            self._release(sorted(unused))
        self._records.append(m.EnsembleRecord(run.model, run.version, run.msg.batch_size,
                                              time.monotonic_ns() - run.started, reason))
        if time.monotonic() - self._sent_at >= ENSEMBLE_STATS_S:
            self.send_stats()

    # ------------------------------------------------------------------ statistics
    def send_stats(self, flush_id: int = 0) -> None:
        records, self._records = self._records, []
        self._sent_at = time.monotonic()
        if records or flush_id:
            self._send(m.EnsembleStats(records, flush_id))


def _needed(plan: Plan, wanted: list[str]) -> Plan:
    """The steps that lead to ``wanted`` (Triton runs no other): in a chain, the first
    ones, up to the last that writes a wanted tensor or one a needed step reads."""
    tensors = set(wanted)
    last = 0
    for k in range(len(plan) - 1, -1, -1):
        step = plan[k][0]
        if tensors & set(step.outputs.values()):
            last = max(last, k + 1)
            tensors |= set(step.inputs.values())
    return plan[:last]
