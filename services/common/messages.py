"""Every message that crosses a process boundary, and its wire encoding.

A message is a list of frames (a ZeroMQ multipart on ipc:// and tcp://):
``[kind byte, msgpack header, *tensor frames]``.
The kind byte lets the receiver pick a typed decoder without looking at the
payload; tensor bytes never sit inside the header: they are either extra frames
(small tensors, or when processes cannot share memory; a TensorRef's ``frame`` counts
from the first frame after the header) or references into a shared-memory segment
owned by the sender (see services/common/shm.py).

No pickle anywhere: headers are msgspec Structs encoded as msgpack arrays.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import msgspec

from services.common.messages_direct import (
    ChainStep,
    DirectEpoch,
    DirectStats,
    EnsembleStats,
    EpochSet,
    FlushStats,
    GetPending,
    Goodbye,
    Pending,
    Route,
)
from services.common.messages_direct import DirectRecord as DirectRecord
from services.common.messages_direct import EnsembleRecord as EnsembleRecord
from services.common.messages_ext import (
    ForgetRegions,
    GetLogSettings,
    GetMetrics,
    LogSettings,
    LogSettingsChanged,
    MetricFamilyRecord,
    MetricsText,
    SetLogSettings,
    ShmRegions,
    ShmRegister,
    ShmStatus,
    ShmUnregister,
    TraceLevels,
    TraceRecord,
    TraceSettings,
    TraceSettingsRequest,
)
from services.common.messages_ext import LogConfig as LogConfig
from services.common.messages_ext import MetricSeries as MetricSeries
from services.common.messages_ext import TraceUpdate as TraceUpdate
from services.common.messages_hosts import HOST_HEARTBEAT_S as HOST_HEARTBEAT_S
from services.common.messages_hosts import HOST_TIMEOUT_S as HOST_TIMEOUT_S
from services.common.messages_hosts import HostHeartbeat, HostHello, SpawnWorker, StopWorker, WorkerExited
from services.common.messages_stats import BatchStat as BatchStat
from services.common.messages_stats import Duration as Duration
from services.common.messages_stats import GetStats, Stats
from services.common.messages_stats import ModelStat as ModelStat
from services.common.msgbase import ErrorRecord
from services.common.msgbase import Msg as _Msg
from services.common.states import ModelState


class Kind(enum.IntEnum):
    # frontend -> scheduler
    FRONTEND_HELLO = 1
    INFER_REQUEST = 2
    RELEASE_BLOCKS = 3
    GET_MODEL_INFO = 4
    GET_INDEX = 5
    LOAD_MODEL_REQUEST = 6
    UNLOAD_MODEL_REQUEST = 7
    GET_STATS = 8
    INFER_REQUESTS = 9
    CHECK_READY = 17               # (numbered after the scheduler -> frontend range)
    CANCEL = 18                    # (also scheduler -> worker, on its cancel connection,
                                   # and frontend -> worker on a direct connection)
    SHM_REGISTER = 50              # (client shared memory: numbered after the host range)
    SHM_UNREGISTER = 51
    SHM_STATUS = 52
    # scheduler -> frontend (INFER_RESULT also worker -> frontend)
    INFER_RESULT = 10
    MODEL_INFO = 11
    INDEX = 12
    CONTROL_DONE = 13
    REPOSITORY_CHANGED = 14
    STATS = 15
    INFER_RESULTS = 16
    SHM_REGIONS = 53
    # scheduler -> worker
    LOAD_MODEL = 20
    EXECUTE_BATCH = 21
    SHUTDOWN = 22
    PROBE_READY = 23
    FORGET_REGIONS = 24
    DIRECT_EPOCH = 25
    FLUSH_STATS = 26
    # worker -> scheduler
    WORKER_READY = 30
    MODEL_LOADED = 31
    BATCH_DONE = 32
    PROBE_RESULT = 33
    RELAY = 34                     # worker -> scheduler -> frontend: results sent the long way
    STREAMS_DONE = 35
    EPOCH_SET = 36
    DIRECT_STATS = 37
    # worker -> frontend, on a direct connection (INFER_RESULT too)
    GOODBYE = 19
    # scheduler <-> frontend, for a metrics scrape (the direct path's pending requests)
    GET_PENDING = 82
    PENDING = 83
    ENSEMBLE_STATS = 84            # frontend -> scheduler: ensembles it ran over routes
    CACHE_INSERT = 85              # frontend -> scheduler: a response cache miss's answer
    CACHE_HIT = 86                 # frontend -> scheduler: a hit it answered from its own copy
    CACHE_EVICTED = 87             # scheduler -> frontends: entries the local cache evicted
    # worker host <-> scheduler (on the worker socket)
    HOST_HELLO = 40
    HOST_HEARTBEAT = 41
    SPAWN_WORKER = 42
    STOP_WORKER = 43
    WORKER_EXITED = 44
    # Triton's logging extension (numbered after the client shared-memory range)
    GET_LOG_SETTINGS = 60          # frontend -> scheduler
    SET_LOG_SETTINGS = 61          # frontend -> scheduler
    LOG_SETTINGS = 62              # scheduler -> frontend: the answer to both
    LOG_SETTINGS_CHANGED = 63      # scheduler -> frontends, workers, worker hosts
    # Triton's trace extension (services/scheduler/trace_settings.py)
    TRACE_SETTINGS_REQUEST = 70    # frontend -> scheduler
    TRACE_SETTINGS = 71            # scheduler -> frontend: its answer
    TRACE_LEVELS = 72              # scheduler -> frontends: which models may be traced
    TRACE_RECORD = 73              # frontend -> scheduler: a sampled request's trace

    GET_METRICS = 80               # frontend -> scheduler
    METRICS_TEXT = 81              # scheduler -> frontend: its answer


class TensorRef(_Msg):
    """Where a tensor's bytes are: an extra frame of this message (``frame`` >= 0) or a
    block of the sender's shared-memory arena (``segment``, ``offset``)."""
    name: str
    datatype: str
    shape: list[int]
    nbytes: int
    frame: int = -1
    segment: str = ""
    offset: int = 0
    # Client shared memory: ``region`` is the client's region name as the frontend got it
    # (``offset`` then counts from the region's start); the scheduler resolves it into the
    # object's ``key`` (``offset`` then counts from the object's start) and clears it.
    region: str = ""
    key: str = ""


class OutputRegion(_Msg):
    """A requested output the client wants written into its shared memory; resolved by
    the scheduler like a TensorRef's region (``key`` set, ``offset`` into the object)."""
    region: str
    offset: int
    nbytes: int
    key: str = ""


# ---------------------------------------------------------------- frontend -> scheduler
class FrontendHello(_Msg):
    """First message of a frontend, so the scheduler can broadcast repository changes."""
    pid: int
    shm_domain: str = ""           # shm.domain(): workers that report the same one share memory
    result_addr: str = ""          # where its results go: relayed results are routed by it


class InferRequest(_Msg):
    req_id: int                    # unique within the sending frontend
    reply_to: str                  # the frontend's result socket (workers PUSH there)
    model: str
    version: int                   # 0: the model's default (latest ready) version
    inputs: list[TensorRef]
    outputs: list[str] = []        # requested outputs; empty: all of them
    parameters: dict[str, Any] = {}
    batch_size: int = 1
    request_id: str = ""           # the client's "id" (a Python model reads it)
    out_regions: dict[str, OutputRegion] = {}   # output name -> client shared memory
    trace: int = 0                 # 1: the frontend traces it if the scheduler samples it
    # Direct (sent to a worker on a Route): the route's epoch, and whether the frontend can
    # map that worker's segments (the scheduler decides it for the requests it dispatches).
    epoch: int = 0
    shm: bool = False
    # The response cache's key (its model enables the cache): the scheduler looks it up
    # before queueing (scheduler/response_cache.py); b"": not looked up.
    cache_key: bytes = b""


class CacheInsert(_Msg):
    """Frontend -> scheduler: the final answer of a request the response cache missed:
    its outputs in the frames (``ok``), or ok=False for an error (not kept)."""
    req_id: int
    key: bytes
    outputs: list[TensorRef] = []
    ok: bool = True


class CacheHit(_Msg):
    """Frontend -> scheduler, after the answer: a request it answered from its copy of an
    entry the scheduler's cache holds (dataplane/response_cache.py): counted, and the
    entry used."""
    model: str
    version: int
    key: bytes
    lookup_ns: int


class CacheEvicted(_Msg):
    """Scheduler -> every frontend: local cache entries evicted; their copies go too."""
    keys: list[bytes]


class InferRequests(_Msg):
    """Requests a frontend queued in one event-loop turn, sent as one message; their
    TensorRef frame indexes count over the shared frames."""
    requests: list[InferRequest]


class ReleaseBlocks(_Msg):
    """The consumer is done with these output blocks; the scheduler forwards to the owner."""
    owner_pid: int
    blocks: list[tuple[str, int]]  # (segment, offset)


class Cancel(_Msg):
    """Requests whose callers went away before their final response (a cancelled gRPC call
    or stream, a client timeout, a closed connection). Sent only when that happens, one
    message per model version per event-loop turn. The scheduler answers those still
    queued with CANCELLED and forwards the rest, as is, to the version's instances that
    can stop early (on their CANCEL_CHANNEL connection)."""
    reply_to: str                  # the frontend's result socket: with req_id, the key workers see
    model: str
    version: int
    req_ids: list[int]


class GetModelInfo(_Msg):
    ctl_id: int
    model: str
    load: bool = False             # for an inference request: load the model on demand


class GetIndex(_Msg):
    ctl_id: int
    ready_only: bool = False


class LoadModelRequest(_Msg):
    ctl_id: int
    model: str
    config_json: str = ""          # "config" load parameter (JSON ModelConfig override)
    files: dict[str, bytes] = {}   # "file:<version>/<name>" load parameters


class UnloadModelRequest(_Msg):
    ctl_id: int
    model: str
    unload_dependents: bool = False


class CheckReady(_Msg):
    """Model readiness for a model whose instances answer it themselves (a Python model's
    is_ready()); the answer is a ControlDone, with an error when not ready."""
    ctl_id: int
    model: str
    version: int = 0


# ---------------------------------------------------------------- scheduler -> frontend
class InferResult(_Msg):
    req_id: int
    model_version: int = 0
    outputs: list[TensorRef] = []
    error: ErrorRecord | None = None
    parameters: dict[str, Any] = {}
    # preserve_ordering: the frontend hands results of one stream to callers in ``order``
    # (1, 2, ...); 0 means unordered. Copied from the BatchItem by the worker.
    stream: int = 0
    order: int = 0
    # Decoupled models answer a request with any number of results; the last has final
    # set. ``empty``: a final flag sent without a response (no tensors, no error).
    final: bool = True
    empty: bool = False
    # A sampled request's trace so far (services/common/trace.py TRACE_HEAD): its id,
    # level and QUEUE_START, then the worker's COMPUTE_* times; empty when not traced.
    trace: list[int] = []
    # A direct request the worker refused unrun (a revoked or stale epoch): the frontend
    # sends it through the scheduler.
    stale: bool = False
    # Answered from the response cache (no CacheInsert follows).
    cached: bool = False


class InferResults(_Msg):
    """Several results for one frontend from one batch, sharing one list of frames."""
    results: list[InferResult]


class IOSpec(_Msg):
    name: str
    datatype: str
    shape: list[int]               # full shape: [-1] + dims when the model batches
    optional: bool = False


class ModelInfo(_Msg):
    """What a frontend caches to answer metadata/config and to validate requests."""
    ctl_id: int
    name: str
    error: ErrorRecord | None = None
    platform: str = ""
    backend: str = ""
    versions: dict[int, ModelState] = {}   # version -> its state
    max_batch_size: int = 0
    inputs: list[IOSpec] = []
    outputs: list[IOSpec] = []
    config_json: str = ""          # ModelConfig as Triton's JSON, pre-rendered once
    decoupled: bool = False
    probe_ready: bool = False      # readiness asks the instances (CheckReady)
    shm: bool = True               # every instance can map the asking frontend's segments
    labels: dict[str, list[str]] = {}   # output name -> its label_filename's lines (classification)
    routes: list[Route] = []       # where requests may go without the scheduler (direct path)
    chain: list[ChainStep] = []    # an ensemble a frontend may run over its steps' routes
    cache: bool = False            # requests are looked up in the response cache (their key)
    split: dict[int, int] = {}     # version -> weight for requests naming none (canary.py)
    sticky: str = ""               # the request parameter whose value keeps a request's version
    loadable: bool = False         # not loaded; an inference request loads it (on demand)
    cache_bytes: int = 0           # the frontend may keep copies of cache hits up to this many


class IndexEntry(_Msg):
    name: str
    version: str = ""
    state: str = ""                # a ModelState; "" for a model with none (never loaded)
    reason: str = ""


class Index(_Msg):
    ctl_id: int
    entries: list[IndexEntry]


class ControlDone(_Msg):
    ctl_id: int
    error: ErrorRecord | None = None


class RepositoryChanged(_Msg):
    models: list[str]              # names whose state or config changed; empty: all
    server_ready: bool = False     # the scheduler's readiness (initial load done, strict rules)
    dead_pids: list[int] = []      # workers that exited: unmap their segments
    # direct route address -> the error of the requests its worker held (killed or exited;
    # a frontend sees only the connection close)
    exits: dict[str, ErrorRecord] = {}


# ---------------------------------------------------------------- scheduler <-> worker
class LoadModel(_Msg):
    model: str
    version: int
    model_dir: str
    config: bytes                  # serialized inference.ModelConfig
    instance_name: str
    kind: str = "KIND_CPU"
    device_id: int = 0
    autocomplete: bool = True
    frontend_addr: str = ""        # the scheduler's frontend socket: BLS requests enter there
    step_addr: str = ""            # the scheduler's step socket: results for it go in BatchDone


class BatchItem(_Msg):
    reply_to: str
    req_id: int
    inputs: list[TensorRef]
    outputs: list[str] = []
    parameters: dict[str, Any] = {}
    batch_size: int = 1
    stream: int = 0                # preserve_ordering, see InferResult
    order: int = 0
    request_id: str = ""
    shm: bool = True               # the frontend can map this worker's segments (outputs)
    out_regions: dict[str, OutputRegion] = {}   # resolved: written there, not sent
    trace: list[int] = []          # sampled: [trace id, level, QUEUE_START] (see InferResult)


class ExecuteBatch(_Msg):
    batch_id: int
    items: list[BatchItem]
    traced: bool = False           # some item has a trace: the worker adds its times


class ReleaseOutputs(_Msg):
    blocks: list[tuple[str, int]]


class Shutdown(_Msg):
    reason: str = ""


class WorkerReady(_Msg):
    worker_id: str
    pid: int
    shm_domain: str = ""
    direct_addr: str = ""          # its direct listener (messages_direct.py); "": none


class Relay(_Msg):
    """Results a worker could not send to a frontend's result socket directly (it is not
    reachable from the worker's host): the scheduler forwards the message that follows as
    frames, untouched, to the frontend that announced ``reply_to``."""
    reply_to: str


class ModelLoaded(_Msg):
    worker_id: str
    error: ErrorRecord | None = None
    config: bytes = b""            # the completed ModelConfig (auto-complete runs in the worker)
    probe: bool = False            # the backend answers ProbeReady with a check of its own
    metrics: list[MetricFamilyRecord] | None = None
    cancellable: bool = False      # the worker reads Cancel on its CANCEL_CHANNEL
    resident_bytes: int = 0        # the worker's proportional set size after load and warmup


# A worker whose model can stop early (a Python model asking is_cancelled()) opens a second
# connection to the scheduler, with its worker id + this suffix as identity, read by a
# thread of its own: a cancel reaches the model while its execute() holds the main thread.
CANCEL_CHANNEL = b"/cancel"


class ProbeReady(_Msg):
    probe_id: int


class ProbeResult(_Msg):
    probe_id: int
    worker_id: str
    ready: bool
    reason: str = ""


class BatchDone(_Msg):
    batch_id: int
    worker_id: str
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0
    failed: int = 0                # requests of the batch that got an error
    metrics: list[MetricFamilyRecord] | None = None   # the model's custom metrics, if changed
    # (reply_to, req_id) of the requests whose response sender is still open (a decoupled
    # model answering from its own threads): should the worker die before their final
    # response, the scheduler answers them (StreamsDone says when it need not any more).
    streaming: list[tuple[str, int]] = []
    # The batch's results for ensemble steps (those with reply_to = LoadModel.step_addr), with
    # their frames after this message: one message, not two, per step and batch.
    results: list[InferResult] = []
    # Only when requests were answered through their response senders (else []): for each
    # item, in ExecuteBatch order, the ns from its first response to this message; -1 none
    # sent yet (StreamsDone.first tells) or none at all, -2 answered with the batch. The
    # scheduler times the first-response histogram by it (worker clocks are its own).
    first: list[int] = []


class StreamsDone(_Msg):
    """Final responses sent for requests a BatchDone listed as streaming."""
    worker_id: str
    keys: list[tuple[str, int]]
    # For each key, the ns from its first response to this message when that came after
    # the BatchDone; -1 when the BatchDone told it (or none was sent).
    first: list[int] = []


# ---------------------------------------------------------------- encoding
_KIND_OF: dict[type[_Msg], Kind] = {
    FrontendHello: Kind.FRONTEND_HELLO,
    InferRequest: Kind.INFER_REQUEST,
    InferRequests: Kind.INFER_REQUESTS,
    ReleaseBlocks: Kind.RELEASE_BLOCKS,
    GetModelInfo: Kind.GET_MODEL_INFO,
    GetIndex: Kind.GET_INDEX,
    LoadModelRequest: Kind.LOAD_MODEL_REQUEST,
    UnloadModelRequest: Kind.UNLOAD_MODEL_REQUEST,
    GetStats: Kind.GET_STATS,
    CheckReady: Kind.CHECK_READY,
    Cancel: Kind.CANCEL,
    ShmRegister: Kind.SHM_REGISTER,
    ShmUnregister: Kind.SHM_UNREGISTER,
    ShmStatus: Kind.SHM_STATUS,
    ShmRegions: Kind.SHM_REGIONS,
    ForgetRegions: Kind.FORGET_REGIONS,
    InferResult: Kind.INFER_RESULT,
    InferResults: Kind.INFER_RESULTS,
    ModelInfo: Kind.MODEL_INFO,
    Index: Kind.INDEX,
    ControlDone: Kind.CONTROL_DONE,
    RepositoryChanged: Kind.REPOSITORY_CHANGED,
    Stats: Kind.STATS,
    LoadModel: Kind.LOAD_MODEL,
    ExecuteBatch: Kind.EXECUTE_BATCH,
    Shutdown: Kind.SHUTDOWN,
    ProbeReady: Kind.PROBE_READY,
    WorkerReady: Kind.WORKER_READY,
    ModelLoaded: Kind.MODEL_LOADED,
    BatchDone: Kind.BATCH_DONE,
    ProbeResult: Kind.PROBE_RESULT,
    Relay: Kind.RELAY,
    StreamsDone: Kind.STREAMS_DONE,
    HostHello: Kind.HOST_HELLO,
    HostHeartbeat: Kind.HOST_HEARTBEAT,
    SpawnWorker: Kind.SPAWN_WORKER,
    StopWorker: Kind.STOP_WORKER,
    WorkerExited: Kind.WORKER_EXITED,
    GetLogSettings: Kind.GET_LOG_SETTINGS,
    SetLogSettings: Kind.SET_LOG_SETTINGS,
    LogSettings: Kind.LOG_SETTINGS,
    LogSettingsChanged: Kind.LOG_SETTINGS_CHANGED,
    TraceSettingsRequest: Kind.TRACE_SETTINGS_REQUEST,
    TraceSettings: Kind.TRACE_SETTINGS,
    TraceLevels: Kind.TRACE_LEVELS,
    TraceRecord: Kind.TRACE_RECORD,
    GetMetrics: Kind.GET_METRICS,
    MetricsText: Kind.METRICS_TEXT,
    DirectEpoch: Kind.DIRECT_EPOCH,
    FlushStats: Kind.FLUSH_STATS,
    EpochSet: Kind.EPOCH_SET,
    DirectStats: Kind.DIRECT_STATS,
    Goodbye: Kind.GOODBYE,
    GetPending: Kind.GET_PENDING,
    Pending: Kind.PENDING,
    EnsembleStats: Kind.ENSEMBLE_STATS,
    CacheInsert: Kind.CACHE_INSERT,
    CacheHit: Kind.CACHE_HIT,
    CacheEvicted: Kind.CACHE_EVICTED,
}
# ReleaseOutputs shares the RELEASE_BLOCKS kind byte on the scheduler -> worker leg.
_KIND_BYTES = {cls: bytes([k]) for cls, k in _KIND_OF.items()}
_KIND_BYTES[ReleaseOutputs] = bytes([Kind.RELEASE_BLOCKS])

_encoder = msgspec.msgpack.Encoder()
_DECODERS: dict[int, msgspec.msgpack.Decoder[_Msg]] = {
    k: msgspec.msgpack.Decoder(cls) for cls, k in _KIND_OF.items()}
_WORKER_DECODERS = dict(_DECODERS)
_WORKER_DECODERS[Kind.RELEASE_BLOCKS] = msgspec.msgpack.Decoder(ReleaseOutputs)


class DecodeError(Exception):
    pass


def encode(msg: _Msg, frames: Sequence[Any] = ()) -> list[Any]:
    """The multipart for ``msg`` followed by its tensor frames. Raises one of
    ENCODE_ERRORS when a field holds what msgpack cannot write."""
    return [_KIND_BYTES[type(msg)], _encoder.encode(msg), *frames]


ENCODE_ERRORS = (OverflowError, TypeError, ValueError, RecursionError)
"""What encode() raises for a header it cannot write: an integer outside
[-2**63, 2**64 - 1] (OverflowError), a type msgpack has no form for, text that is not
UTF-8 (UnicodeEncodeError), nesting deeper than the encoder goes."""


def unencodable(value: Any) -> Exception | None:
    """Why ``value`` cannot be part of a message header, or None when it can: finds which
    field of a message that failed to encode is at fault."""
    try:
        _encoder.encode(value)
    except ENCODE_ERRORS as e:
        return e
    return None


def decode(parts: Sequence[Any], *, for_worker: bool = False) -> tuple[_Msg, list[Any]]:
    """(message, tensor frames) from a received multipart (bytes or memoryview parts)."""
    if len(parts) < 2:
        raise DecodeError(f"multipart of {len(parts)} part(s) is not a message")
    kind_b, header = parts[0], parts[1]
    decoders = _WORKER_DECODERS if for_worker else _DECODERS
    dec = decoders.get(kind_b[0]) if len(kind_b) == 1 else None
    if dec is None:
        raise DecodeError(f"unknown message kind {bytes(kind_b)!r}")
    try:
        return dec.decode(header), list(parts[2:])
    except msgspec.DecodeError as e:
        raise DecodeError(f"malformed {Kind(kind_b[0]).name}: {e}") from e
