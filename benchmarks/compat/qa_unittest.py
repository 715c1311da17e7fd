"""Run one of Triton's QA test modules, unmodified, and write a JSON verdict per test case.

    python qa_unittest.py --out RESULT.json --module ensemble_test [Class.test_name ...]

Started by triton_qa.py with the QA test's own folder as the working directory (the tests
do `sys.path.append("../common")` and write ./test_results.txt), and the shims folder on
PYTHONPATH. The module is imported as unittest's loader does (its `if __name__ ==
"__main__"` block does not run: it only calls unittest.main()), the named cases (all, when
none are named) run under a TextTestRunner, and every case gets one record:

    {"id": "ensemble_test.EnsembleTest.test_ensemble_add_sub",
     "result": "pass" | "fail" | "error" | "skip", "message": "AssertionError: ...",
     "seconds": 1.2}

The file is rewritten after every case, the cases not run yet as "unfinished": when the
runner kills a test that runs past its time, the cases it finished keep their verdicts.

A case with subtests takes the worst of them (error > fail > pass); the message is that of
its first failing subtest, prefixed with the subtest's parameters. A module that cannot be
imported gives one "error" record for the module.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
import unittest

_RANK = {"pass": 0, "skip": 0, "fail": 1, "error": 2}


def first_line(err) -> str:
    """`Type: first line of the message` of an exc_info triple."""
    etype, value, _ = err
    text = str(value).strip().splitlines()
    return f"{etype.__name__}: {text[0]}" if text else etype.__name__


class Recorder(unittest.TextTestResult):
    """A TextTestResult that also keeps one verdict per test id, in run order."""

    planned: list[str] = []   # the ids the suite holds, in order (set before the run)
    out: str = ""               # dumped after every case: a killed run keeps what it had

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records: dict[str, dict] = {}
        self._started: dict[str, float] = {}

    def all_records(self) -> list[dict]:
        """Every planned case, those not run yet as 'unfinished', then any others."""
        recs = [self.records.get(t) or {"id": t, "result": "unfinished", "message": "",
                                        "seconds": 0.0} for t in self.planned]
        return recs + [r for t, r in self.records.items() if t not in self.planned]

    def dump(self) -> None:
        if self.out:
            _write(self.out, self.all_records())

    def _set(self, test, result: str, message: str = "") -> None:
        tid = test.id()
        rec = self.records.setdefault(tid, {"id": tid, "result": "pass", "message": "",
                                            "seconds": 0.0})
        if _RANK[result] > _RANK[rec["result"]] or (result == "skip" and rec["result"] == "pass"):
            rec["result"] = result
            if not rec["message"]:
                rec["message"] = message
        elif result != "pass" and not rec["message"]:
            rec["message"] = message

    def startTest(self, test):
        self._started[test.id()] = time.monotonic()
        super().startTest(test)

    def stopTest(self, test):
        super().stopTest(test)
        tid = test.id()
        if tid in self.records and tid in self._started:
            self.records[tid]["seconds"] = round(time.monotonic() - self._started[tid], 2)
        self.dump()

    def addSuccess(self, test):
        super().addSuccess(test)
        self._set(test, "pass")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._set(test, "fail", first_line(err))

    def addError(self, test, err):
        super().addError(test, err)
        # setUpClass / tearDownClass errors come as a _ErrorHolder, not a TestCase
        self._set(test, "error", first_line(err))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._set(test, "skip", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._set(test, "pass")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._set(test, "fail", "unexpected success")

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is None:
            return
        params = subtest._subDescription()   # "(limit='max_inflight_requests=4')"
        kind = "fail" if issubclass(err[0], test.failureException) else "error"
        self._set(test, kind, f"{params} {first_line(err)}".strip())


def _write(path: str, records: list[dict]) -> None:
    """Whole or not at all: the runner may kill this process at any moment."""
    with open(path + ".tmp", "w") as f:
        json.dump(records, f, indent=1)
    os.replace(path + ".tmp", path)


def _flatten(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from _flatten(t)
        else:
            yield t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--module", required=True)
    p.add_argument("names", nargs="*")
    args = p.parse_args(argv)

    sys.path.insert(0, os.getcwd())
    records: list[dict] = []
    try:
        module = importlib.import_module(args.module)
    except Exception:  # noqa: BLE001  (any import failure is the verdict itself)
        traceback.print_exc()
        records.append({"id": args.module, "result": "error", "seconds": 0.0,
                        "message": f"import failed: {first_line(sys.exc_info())}"})
    else:
        loader = unittest.TestLoader()
        suite = (loader.loadTestsFromNames(args.names, module) if args.names
                 else loader.loadTestsFromModule(module))
        Recorder.planned = [t.id() for t in _flatten(suite)]
        Recorder.out = args.out
        Recorder(sys.stderr, True, 0).dump()   # every case 'unfinished' until it ends
        runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=Recorder)
        result = runner.run(suite)
        records = result.all_records()   # type: ignore[attr-defined]
    _write(args.out, records)
    return 0 if all(r["result"] in ("pass", "skip") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
