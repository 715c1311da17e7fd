"""Ensembles: the queue of a model with `platform: "ensemble"`. A request runs the steps
of `ensemble_scheduling` as their inputs become available, each step an internal request
to its composing model's own queue, whose results come back to the scheduler:

    request ─▶ Run (ensemble tensors by name) ─▶ every step whose inputs are all there
        ─▶ step request (reply_to: the scheduler's step socket) ─▶ composing model's queue
        ◀─ step result: its outputs become ensemble tensors (output_map) ─▶ next steps
        ─▶ all ensemble outputs there: one response to the frontend

Tensors stay where they are: a step's output in its worker's shared memory goes to the next
worker as the same reference (it maps the producer's segment), and to the frontend too;
inline ones travel as the received frames. The scheduler copies no tensor byte. A block is
handed back to its worker once no later step needs it and it is not part of the response
(the frontend releases those, as for any response). A failing step fails the request:
"in ensemble '<e>', <the step's error>" (Triton's text), with the step's code.
"""
from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from services.common import messages as m
from services.common.ensemble_tensors import (
    ABSENT,
    Tensors,
    answer_outputs,
    deadlock_text,
    request_tensors,
    sequence_echo,
    step_inputs,
    take_outputs,
)
from services.common.errors import CANCELLED_TEXT, Code
from services.scheduler.dispatch import Instance

log = logging.getLogger("trireme.ensemble")

_step_ids = itertools.count(1 << 61)   # internal request ids: never a frontend's (pid << 40)


@dataclass(eq=False)
class Branch:
    """One line of a request's tensors. A request starts with one; each response of a
    decoupled step opens a new one (its tensors so far, plus that response's outputs), as
    Triton keeps tensors per response ("iteration")."""
    tensors: Tensors
    started: set[int]                              # steps run (or not needed) on this line
    answered: bool = False


@dataclass(eq=False)
class Run:
    p: Any                                        # the ensemble request's Pending
    branches: list[Branch] = field(default_factory=list)
    inflight: int = 0                             # steps running, over every branch
    done: bool = False
    answered: bool = False                        # a response went out
    blocks: set[tuple[str, int]] = field(default_factory=set)   # step outputs in shared memory


class EnsembleQueue:
    """A SchedulingQueue (queues.py) with no instances of its own: its requests run as
    steps on their models' queues."""

    def __init__(self, model: str, version: int, cfg: Any, order: list[int],
                 submit: Callable[..., None], respond: Callable[[Any, m.InferResult, list], None],
                 fail: Callable[[Any, int, str, str], None],
                 release: Callable[[list[tuple[str, int]]], None], stats: Any = None) -> None:
        self.model, self.version = model, version
        self.steps = [cfg.ensemble_scheduling.step[i] for i in order]
        self.outputs = [o.name for o in cfg.output]
        self.optional = [i.name for i in cfg.input if i.optional]
        self.max_inflight = cfg.ensemble_scheduling.max_inflight_requests or 0
        self.submit, self.respond, self.fail, self.release = submit, respond, fail, release
        # (never one: lifecycle.py starts no instance for an ensemble)
        self.instances: Mapping[str, Instance] = MappingProxyType({})
        self.runs: dict[int, tuple[Run, Branch, Any]] = {}   # step request id -> where it runs
        self.decoupled = cfg.model_transaction_policy.decoupled
        self._streaming: set[str] = set()         # step models seen answering more than once
        self.active: list[Run] = []
        # max_inflight_requests (Triton's ensemble backpressure): at most this many requests
        # in flight at each step, over all of the ensemble's requests; the rest wait here.
        self.step_inflight = [0] * len(self.steps)
        self.deferred: list[collections.deque[tuple[Run, Branch]]] = [
            collections.deque() for _ in self.steps]
        self._needed_steps: dict[tuple[str, ...], frozenset[int]] = {}
        self.stats = stats
        if stats is not None:   # pending: the step requests max_inflight_requests holds back
            stats.batcher = _Deferred(self.deferred)

    # ------------------------------------------------------------------ SchedulingQueue
    @property
    def busy(self) -> bool:
        return bool(self.active)

    def enqueue(self, p: Any) -> None:
        self._start(p)

    def cancel(self, frontend: bytes, req_ids: list[int]) -> tuple[list[Any], list[int]]:
        wanted = set(req_ids)
        for run in [r for r in self.active if r.p.frontend == frontend and r.p.req.req_id in wanted]:
            self._finish(run, error=(Code.CANCELLED, CANCELLED_TEXT), reason="CANCELED")
        return [], req_ids

    def fail_queued(self, code: int, message: str) -> None:
        for run in list(self.active):
            self._finish(run, error=(code, message))

    def add_instance(self, inst: Instance) -> None:
        raise TypeError(f"ensemble '{self.model}' runs on its steps' instances, not on "
                        f"{inst.name}")

    def worker_died(self, inst: Instance, why: str, code: int = Code.INTERNAL) -> None:
        """Nothing to fail: no worker holds a request of this queue (a step's worker holds
        the step, whose error comes back to step_result)."""

    def batch_done(self, inst: Instance, batch_id: int) -> None:
        """Nothing to free: no batch of this queue runs on a worker (a step's batch is its
        model's queue's)."""

    # ------------------------------------------------------------------ steps
    def _needed(self, outputs: list[str]) -> frozenset[int]:
        """The steps that lead to ``outputs`` (Triton runs no other): from the last step
        back, one is needed when it writes a tensor that is needed."""
        key = tuple(outputs)
        steps = self._needed_steps.get(key)
        if steps is None:
            tensors, chosen = set(outputs), set()
            for i in range(len(self.steps) - 1, -1, -1):
                if tensors & set(self.steps[i].output_map.values()):
                    chosen.add(i)
                    tensors |= set(self.steps[i].input_map.values())
            steps = self._needed_steps[key] = frozenset(chosen)
        return steps

    def _start(self, p: Any) -> None:
        run = Run(p)
        skip = set(range(len(self.steps))) - self._needed(p.req.outputs or self.outputs)
        branch = Branch(request_tensors(p.req.inputs, p.frames, self.optional), skip)
        run.branches.append(branch)
        self.active.append(run)
        self._advance(run, branch)

    def _advance(self, run: Run, branch: Branch) -> None:
        for i, step in enumerate(self.steps):
            if i in branch.started or not all(n in branch.tensors for n in step.input_map.values()):
                continue
            branch.started.add(i)
            run.inflight += 1
            if self.max_inflight and self.step_inflight[i] >= self.max_inflight:
                self.deferred[i].append((run, branch))
            else:
                self._dispatch(run, branch, i)
        self._respond_if_complete(run, branch)
        if not run.inflight and not run.done:    # nothing runs and nothing more can start
            self._end(run)

    def _dispatch(self, run: Run, branch: Branch, i: int) -> None:
        """Send step ``i`` of ``branch`` to its model's queue (run.inflight counts it)."""
        step = self.steps[i]
        self.step_inflight[i] += 1
        req_id = next(_step_ids)
        inputs, frames = step_inputs(step.input_map, branch.tensors)
        r = run.p.req
        # An ensemble output the client wants in its shared memory is written there by the
        # step that makes it (later steps read it from there, by reference too).
        regions = {out: r.out_regions[name] for out, name in step.output_map.items()
                   if name in r.out_regions} if r.out_regions else {}
        step_req = m.InferRequest(req_id, "", step.model_name, max(int(step.model_version), 0),
                                  inputs, list(step.output_map), r.parameters, r.batch_size,
                                  r.request_id, regions)
        self.runs[req_id] = (run, branch, i)
        self.submit(self, step_req, frames, run.p.shm_domain)

    def _step_freed(self, i: int) -> None:
        """A request left step ``i``: the next one waiting for it goes."""
        self.step_inflight[i] -= 1
        waiting = self.deferred[i]
        while waiting and self.step_inflight[i] < (self.max_inflight or len(waiting) + 1):
            run, branch = waiting.popleft()
            if run.done:
                run.inflight -= 1
                self._maybe_drop(run)
            else:
                self._dispatch(run, branch, i)

    def step_result(self, result: m.InferResult, frames: list[Any]) -> None:
        """A step's answer (or error), from its worker or from the scheduler. A decoupled
        step answers any number of times, the last with ``final`` set."""
        entry = self.runs.get(result.req_id)
        if entry is None:
            return
        run, branch, i = entry
        step = self.steps[i]
        if result.final:
            del self.runs[result.req_id]
            run.inflight -= 1
            self._step_freed(i)
        step_blocks = [(o.segment, o.offset) for o in result.outputs if o.segment]
        if run.done:                       # failed or cancelled meanwhile: nothing waits for it
            self.release(step_blocks)
            self._maybe_drop(run)
            return
        if result.error is not None:
            self.release(step_blocks)
            self._finish(run, error=(result.error.code, result.error.message))
            return
        if not result.empty:
            # A response of a decoupled step opens its own branch; a plain step's single
            # answer continues the branch it ran on.
            target = branch
            if not result.final or step.model_name in self._streaming:
                self._streaming.add(step.model_name)
                target = Branch(dict(branch.tensors), set(branch.started))
                run.branches.append(target)
            take_outputs(result, frames, step.output_map, target.tensors, run.blocks,
                         self.release)
            self._advance(run, target)
        elif not run.inflight and not run.done:
            self._end(run)

    def _respond_if_complete(self, run: Run, branch: Branch) -> None:
        """A branch with every requested output answers: final when no step of the request
        is running any more (a plain ensemble's only answer; a decoupled one's last), else
        not final (a decoupled ensemble's answers before it)."""
        if branch.answered or run.done:
            return
        if all(o in branch.tensors for o in run.p.req.outputs or self.outputs):
            branch.answered = True
            if self.decoupled and run.inflight:
                self._answer(run, branch, final=False)
            else:   # nothing else runs: this answer is the last (Triton flags it final)
                self._finish(run, branch)

    def _end(self, run: Run) -> None:
        """No step runs and none can start: the request is over. (An output a step left
        out is ABSENT, there for the answer, which leaves it out: a plain ensemble ends here
        only when a wanted tensor never came, as when a decoupled step sent no response.)"""
        if self.decoupled:
            self._finish(run)
        else:
            self._finish(run, error=(Code.INVALID_ARG, deadlock_text(run.p.req.request_id)))

    def _answer(self, run: Run, branch: Branch, final: bool) -> set[tuple[str, int]]:
        """Send the requested outputs of ``branch``; returns the blocks that went out (the
        frontend releases those)."""
        p = run.p
        wanted = p.req.outputs or self.outputs
        for name in wanted:
            if branch.tensors.get(name, ABSENT)[0] is None:
                log.debug("Composing models did not output tensor %s", name)
        outputs, frames, sent = answer_outputs(wanted, branch.tensors)
        echo = sequence_echo(p.req.parameters, outputs)
        run.answered = True
        run.blocks -= sent
        self.respond(p, m.InferResult(p.req.req_id, self.version, outputs, parameters=echo,
                                      final=final), frames)
        return sent

    def _finish(self, run: Run, branch: Branch | None = None,
                error: tuple[int, str] | None = None, reason: str = "OTHER") -> None:
        """The request's last word: an error, the answer of ``branch``, or (a decoupled
        ensemble) the bare final flag."""
        if run.done:
            return
        run.done = True
        p = run.p
        if error is not None:
            code, text = error
            if reason != "CANCELED":
                text = f"in ensemble '{self.model}', {text}"
            self.fail(p, code, text, reason)
        else:
            if self.stats is not None:
                self.stats.completed(p.req.batch_size, time.monotonic_ns() - p.arrival_ns)
            if branch is not None:
                self._answer(run, branch, final=True)
            else:
                self.respond(p, m.InferResult(p.req.req_id, self.version, final=True,
                                              empty=True), [])
        self.release(sorted(run.blocks))
        run.blocks.clear()
        self._maybe_drop(run)

    def _maybe_drop(self, run: Run) -> None:
        if run.done and not run.inflight and run in self.active:
            self.active.remove(run)


class _Deferred:
    """What nv_inference_pending_request_count counts for an ensemble (stats.batcher)."""

    def __init__(self, deferred: list[collections.deque]) -> None:
        self.deferred = deferred

    def __len__(self) -> int:
        return sum(len(d) for d in self.deferred)
