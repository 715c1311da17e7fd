"""ModelManager with --model-namespacing: keys, name resolution, loads and unloads by name,
an ensemble step's target, and the metrics' namespace label. Fake workers, real
repositories on disk, real VersionQueues; no process, no socket, no sleep."""
from __future__ import annotations

import asyncio

import pytest

from protos import model_config_pb2 as mc
from services.common.errors import Code, TriremeError
from services.scheduler.batcher import BatcherConfig
from services.scheduler.dispatch import VersionQueue
from services.scheduler.lifecycle import ModelManager
from services.scheduler.metrics import Metrics
from services.scheduler.stats import StatsRegistry

PLAIN = '''backend: "python"
max_batch_size: 0
input [{ name: "X", data_type: TYPE_FP32, dims: [2] }]
output [{ name: "Y", data_type: TYPE_FP32, dims: [2] }]
instance_group [{ kind: KIND_CPU, count: 1 }]
'''
ENSEMBLE = '''platform: "ensemble"
max_batch_size: 0
input [{ name: "X", data_type: TYPE_FP32, dims: [2] }]
output [{ name: "Y", data_type: TYPE_FP32, dims: [2] }]
ensemble_scheduling { step [{ model_name: "shared", model_version: -1,
  input_map { key: "X", value: "X" }, output_map { key: "Y", value: "Y" } }] }
'''
AMBIGUOUS = ("There are 2 identifiers of model 'shared' in global map, model namespace must "
             "be provided to resolve ambiguity.")


def model(root, name: str, config: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text("")
    (root / name / "config.pbtxt").write_text(config)


class Fixture:
    def __init__(self, tmp_path) -> None:
        self.a, self.b = tmp_path / "a", tmp_path / "b"
        for repo in (self.a, self.b):
            model(repo, "shared", PLAIN)
        model(self.a, "ens_a", ENSEMBLE)
        self.spawned: list[tuple[str, str]] = []   # (instance's model key, model dir)
        self.changes: list[list[str]] = []
        self.mm = ModelManager([self.a, self.b], spawn_instance=self._spawn,
                               stop_instance=self._stop, make_queue=self._queue,
                               changed=self.changes.append, restart_backoff_s=0,
                               namespacing=True)

    async def _spawn(self, inst, blob, model_dir, autocomplete):
        inst.loaded = True
        self.spawned.append((inst.model, model_dir))
        return mc.ModelConfig.FromString(blob)

    async def _stop(self, inst) -> None:
        pass

    def _queue(self, model, version, cfg):
        return VersionQueue(model, version, BatcherConfig.from_model_config(cfg),
                            lambda *a: None, lambda *a: None, lambda *a: None)

    def key(self, repo, name: str) -> str:
        return f"{repo}::{name}"


def test_load_by_name_loads_every_repository_and_the_name_is_ambiguous(tmp_path):
    f = Fixture(tmp_path)

    async def go():
        f.mm.scan()
        assert f.mm.resolve("nope") is None
        assert f.mm.resolve("shared") is None   # never loaded: unknown (INVALID_ARG, as Triton)
        info = f.mm.info("shared")
        assert (info.error.code, info.error.message) == (
            int(Code.INVALID_ARG), "Request for unknown model: 'shared' is not found")
        await f.mm.load("shared")
        assert sorted(f.spawned) == [(f.key(f.a, "shared"), str(f.a / "shared")),
                                     (f.key(f.b, "shared"), str(f.b / "shared"))]
        with pytest.raises(TriremeError) as e:
            f.mm.resolve("shared")
        assert (e.value.code, e.value.message) == (Code.INVALID_ARG, AMBIGUOUS)
        assert f.mm.info("shared").error.message == AMBIGUOUS
        assert f.mm.lookup("shared") is None
        assert [(x.name, x.state) for x in f.mm.index(False) if x.name == "shared"] == \
            [("shared", "READY")] * 2
        # frontends hear names, never keys
        assert all("::" not in n for names in f.changes for n in names)
        # one unloaded: the other is the one the name means
        await f.mm.unload(f.key(f.a, "shared"))
        assert f.mm.resolve("shared").namespace == str(f.b)
        await f.mm.unload("shared")   # by name: every repository's
        assert [(x.state, x.reason) for x in f.mm.index(False) if x.name == "shared"] == \
            [("UNAVAILABLE", "unloaded")] * 2
        await f.mm.shutdown()
    asyncio.run(go())


def test_ensemble_prefers_its_own_repository(tmp_path):
    f = Fixture(tmp_path)

    async def go():
        f.mm.scan()
        await f.mm.load("ens_a")
        ens = f.mm.models[f.key(f.a, "ens_a")]
        assert ens.composing == [f.key(f.a, "shared")]
        step, = ens.config.ensemble_scheduling.step
        assert (step.model_name, step.model_namespace) == ("shared", str(f.a))
        # Triton polls the step's name in every repository: b's shared loads too
        assert {k for k, _ in f.spawned} == {f.key(f.a, "shared"), f.key(f.b, "shared")}
        assert f.mm.step_entry(ens.key, "shared").namespace == str(f.a)
        # its own gone: the only ready one of that name
        await f.mm.unload(f.key(f.a, "shared"))
        assert f.mm.step_entry(ens.key, "shared").namespace == str(f.b)
        await f.mm.shutdown()
    asyncio.run(go())


def test_split_key_and_metrics_namespace_label(tmp_path):
    f = Fixture(tmp_path)
    key = f.key(f.a, "shared")
    assert f.mm.split_key(key) == ("shared", str(f.a))
    assert f.mm.split_key("plain") == ("plain", "")
    reg = StatsRegistry()
    reg.fresh(key, 1)
    text = Metrics(reg, lambda: [(key, 1)], split=f.mm.split_key).render(0)
    assert f'nv_inference_request_success{{model="shared",namespace="{f.a}",version="1"}} 0' in text
