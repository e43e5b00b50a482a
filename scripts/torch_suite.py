#!/usr/bin/env python3
"""Run PyTorch's own distributed test suite on rsccl and on gloo, and compare.

The suite is the one torch ships in its wheel:
torch/testing/_internal/distributed/distributed_test.py, class
``DistributedTest._DistTestBase`` run through ``TestDistBackend`` (a MultiProcessTestCase:
one process per rank, started with spawn), exactly as pytorch's
test/distributed/test_distributed_spawn.py drives it, with BACKEND, WORLD_SIZE, TEMP_DIR
and INIT_METHOD (file://) set. The same test list runs on every backend of one call; the
result is the list of tests gloo passes and rsccl does not. Exit status 1 if there is any.

    python scripts/torch_suite.py                       # everything, 2 and 3 ranks (~40 min on 2 cores)
    python scripts/torch_suite.py --fast                # the subset CI runs (FAST below)
    python scripts/torch_suite.py -k all_reduce -k send --world-sizes 2
    python scripts/torch_suite.py --list-gates          # what this script changes in the suite

Not a copy of the suite: the module is read from the installed torch, and the gates below
are applied to its text (each must match, so a torch that renamed one is noticed). Tests
that need GPUs skip here as they do for gloo; on a machine with one GPU per rank they run
on CUDA tensors (see docs/torch_suite.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types
import unittest

# -- what this script changes in torch's suite, and why ------------------------------------
# Gates that name "gloo" literally, for features rsccl has on CPU tensors too. Each is
# (regex on the suite's source, replacement, why). Every regex must match at least once.
WIDENED_GATES = [
    (
        r'BACKEND != "gloo"',
        'BACKEND not in ("gloo", "rsccl")',
        (
            "CPU-tensor tests gated on the name gloo: barrier timeouts, sparse all_reduce, CPU batch_isend_irecv, "
            "DDP no_sync/get_future, CUDA-tensor variants (those need GPUs)"
        ),
    ),
    (
        r'BACKEND == "gloo"',
        'BACKEND in ("gloo", "rsccl")',
        "_test_accumulate_gradients_no_sync builds its CPU model only for gloo/mpi",
    ),
    (
        r'@require_backend_is_available\(\{"gloo"\}\)\n(\s+def test_(?!monitored_barrier))',
        r'@require_backend_is_available({"gloo", "rsccl"})\n\1',
        (
            "all_reduce_coalesced, scatter_object_list, grads_same_across_ranks_with_no_sync: plain collectives "
            "(the monitored_barrier tests: MONITORED_BARRIER_GATE)"
        ),
    ),
]
# torch >= 2.15 sends dist.monitored_barrier to any group that serves CPU tensors (2.11: to
# gloo's only), and rsccl implements it (python/rsccl/_monitored.py): there its tests are
# widened to rsccl too, whatever other decorators stand between the gate and the test.
MONITORED_BARRIER_GATE = (
    r'(?s)@require_backend_is_available\(\{"gloo"\}\)((?:(?!\bdef ).)*?def test_monitored_barrier)',
    r'@require_backend_is_available({"gloo", "rsccl"})\1',
    "monitored_barrier (torch >= 2.15 only: 2.11's dist.monitored_barrier refuses every backend but gloo)",
)


def torch_sends_monitored_barrier() -> bool:
    import torch

    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 15)


# torch's sets of backends per feature (common_distributed.DistTestCases): rsccl joins them
# because it takes CPU and CUDA tensors, DDP and subgroups, and is a plugin (not built in).
FEATURE_SETS = ["gpu", "cuda", "ddp", "subgroup", "plugin"]
# The suite's allowlists of backends whose profiler events it checks: rsccl records
# "rsccl:<collective>" events as gloo records "gloo:<collective>" (shapes, async timing).
PROFILING_LISTS = ["PROFILING_SUPPORTED_BACKENDS", "CUDA_PROFILING_SUPPORTED_BACKENDS", "SEND_RECV_PROFILING_SUPPORTED_BACKENDS"]

# Tests gloo passes that rsccl is not expected to pass, with why. Only what torch itself
# restricts to gloo belongs here (`gloo_only()`: on torch >= 2.15, nothing).
GLOO_ONLY_BEFORE_2_15 = {
    "test_monitored_barrier_gloo": "torch < 2.15: dist.monitored_barrier refuses every backend but gloo (rsccl's groups have the method)",
    "test_monitored_barrier_gloo_subgroup": "same: monitored_barrier",
    "test_monitored_barrier_gloo_rank_0_timeout": "same: monitored_barrier",
    "test_monitored_barrier_failure_order": "same: monitored_barrier",
    "test_monitored_barrier_wait_all_ranks": "same: monitored_barrier",
}


def gloo_only() -> dict[str, str]:
    return {} if torch_sends_monitored_barrier() else GLOO_ONLY_BEFORE_2_15


def gates() -> list[tuple[str, str, str]]:
    return WIDENED_GATES + ([MONITORED_BARRIER_GATE] if torch_sends_monitored_barrier() else [])


# The subset CI runs (--fast): every fix this suite asked of rsccl (recv from any source,
# timeout wording, sparse all_reduce, profiler events) and one test per area (collectives,
# p2p, async, objects, coalescing, DDP, futures), kept short: each test starts one process
# per rank. (test_accumulate_gradients_no_sync_allreduce_hook fails on gloo too when run by
# this script on torch 2.11: "bucket annotation should be dist.GradBucket"; not in FAST.)
FAST = [
    "test_send_recv_any_source",
    "test_send_recv_any_source_autograd_profiler",
    "test_isend_autograd_profiler",
    "test_barrier_timeout_global",
    "test_barrier_timeout_full_group",
    "test_sparse_all_reduce_sum",
    "test_all_reduce_sum",
    "test_all_reduce_coalesced_group_sum",
    "test_scatter_object_list",
    "test_accumulate_gradients_no_sync",
    "test_get_future",
    "test_DistributedDataParallelCPU",
]

SUITE = "torch.testing._internal.distributed.distributed_test"
CHILD_ENV = "RSCCL_TORCH_SUITE_CHILD"


def _load_suite() -> types.ModuleType:
    """torch's suite module with the gates above applied, registered under its own name (so
    that objects pickled between ranks resolve to it)."""
    from torch.testing._internal import common_distributed

    backend = os.environ["BACKEND"]
    if backend == "rsccl":
        import rsccl  # noqa: F401 - on torch < 2.15 the backend is registered by the import

        for feature in FEATURE_SETS:
            common_distributed.DistTestCases.backend_feature[feature].add("rsccl")
    spec = importlib.util.find_spec(SUITE)
    assert spec is not None and spec.origin is not None
    with open(spec.origin) as f:
        src = f.read()
    for pattern, repl, _ in gates():
        src, n = re.subn(pattern, repl, src)
        if n == 0:
            raise RuntimeError(f"torch_suite: gate {pattern!r} not found in {spec.origin}: update WIDENED_GATES")
    mod = types.ModuleType(SUITE)
    mod.__file__ = spec.origin
    sys.modules[SUITE] = mod
    exec(compile(src, spec.origin, "exec"), mod.__dict__)  # noqa: S102 - torch's own suite, gates widened
    for name in PROFILING_LISTS:
        getattr(mod, name).append("rsccl")
    return mod


if os.environ.get(CHILD_ENV):
    # In the child that runs the tests and in every rank it spawns (spawn re-imports this
    # file as __mp_main__), the test class must be defined at module level.
    _suite = _load_suite()

    class TestDistBackendWithSpawn(_suite.TestDistBackend, _suite.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()


class _Recorder(unittest.TextTestResult):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.outcomes: dict[str, list[str]] = {}

    def _put(self, test, outcome, detail=""):
        self.outcomes[test._testMethodName] = [outcome, detail[-4000:]]

    def addSuccess(self, test):
        super().addSuccess(test)
        self._put(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._put(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._put(test, "failed", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._put(test, "skipped", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._put(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._put(test, "failed", "unexpected success")


def _all_tests() -> list[str]:
    return sorted(n for n in dir(TestDistBackendWithSpawn) if n.startswith("test_"))


def _child(out_path: str, names: list[str]) -> int:
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    runner = unittest.TextTestRunner(resultclass=_Recorder, verbosity=2, stream=sys.stderr)
    result = runner.run(suite)
    with open(out_path, "w") as f:
        json.dump(result.outcomes, f)
    return 0


def _selected(all_names: list[str], args: argparse.Namespace) -> list[str]:
    names = all_names
    if args.fast:
        missing = [n for n in FAST if n not in all_names]
        if missing:
            raise SystemExit(f"torch_suite: FAST names tests this torch does not have: {missing}")
        names = list(FAST)
    if args.k:
        names = [n for n in names if any(k in n for k in args.k)]
    return names


def _run_config(backend: str, world_size: int, names: list[str], log_dir: str, verbose: bool) -> dict:
    tmp = tempfile.mkdtemp(prefix=f"torch_suite_{backend}_{world_size}_")
    for d in ("barrier", "test_dir", "init_dir"):
        os.mkdir(os.path.join(tmp, d))
    env = dict(
        os.environ,
        BACKEND=backend,
        WORLD_SIZE=str(world_size),
        TEMP_DIR=tmp,
        INIT_METHOD=f"file://{tmp}/init_dir/shared_init_file",
        **{CHILD_ENV: "1"},
    )
    out = os.path.join(tmp, "outcomes.json")
    log = os.path.join(log_dir, f"{backend}_w{world_size}.log")
    t0 = time.monotonic()
    with open(log, "w") as lf:
        rc = subprocess.call(
            [sys.executable, os.path.abspath(__file__), "--child", out, *names],
            env=env,
            stdout=None if verbose else lf,
            stderr=subprocess.STDOUT if not verbose else None,
        )
    secs = time.monotonic() - t0
    if not os.path.exists(out):
        raise SystemExit(f"torch_suite: the {backend} run at {world_size} ranks ended with status {rc} and no results; see {log}")
    with open(out) as f:
        outcomes = json.load(f)
    counts = {k: sum(1 for v in outcomes.values() if v[0] == k) for k in ("passed", "failed", "skipped")}
    print(
        f"{backend:6s} {world_size} ranks: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped ({secs:.0f} s; log {log})",
        flush=True,
    )
    return outcomes


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return _child(sys.argv[2], sys.argv[3:])
    if len(sys.argv) > 1 and sys.argv[1] == "--child-list":
        print("\n".join(_all_tests()))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", default="2,3", help="comma-separated (default 2,3)")
    p.add_argument("--backends", default="gloo,rsccl", help="comma-separated; the comparison needs gloo and rsccl")
    p.add_argument("--fast", action="store_true", help="only the FAST subset (what CI runs)")
    p.add_argument("-k", action="append", help="only tests whose name contains this (repeatable)")
    p.add_argument("--log-dir", default=None, help="where per-run logs go (default: a temporary folder)")
    p.add_argument("--verbose", action="store_true", help="stream the test output instead of logging it")
    p.add_argument("--list-gates", action="store_true", help="print what this script changes in the suite, and exit")
    args = p.parse_args()
    if args.list_gates:
        for pattern, repl, why in gates():
            print(f"widened: {pattern!r} -> {repl!r}\n    {why}")
        print(f"rsccl added to DistTestCases.backend_feature[{', '.join(FEATURE_SETS)}] and to {', '.join(PROFILING_LISTS)}")
        for name, why in gloo_only().items():
            print(f"gloo only: {name}: {why}")
        return 0

    import torch

    # The test names, from a child that loads the suite (this process does not).
    listing = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child-list"],
        env=dict(os.environ, BACKEND="gloo", WORLD_SIZE="2", TEMP_DIR=tempfile.gettempdir(), **{CHILD_ENV: "1"}),
        capture_output=True,
        text=True,
        check=False,
    )
    if listing.returncode != 0:
        raise SystemExit(f"torch_suite: could not load torch's suite:\n{listing.stderr[-3000:]}")
    names = _selected(listing.stdout.split(), args)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="torch_suite_logs_")
    os.makedirs(log_dir, exist_ok=True)
    backends = args.backends.split(",")
    print(f"torch {torch.__version__}; {len(names)} tests; backends {backends}; logs in {log_dir}", flush=True)
    bad = 0
    for ws in [int(w) for w in args.world_sizes.split(",")]:
        results = {b: _run_config(b, ws, names, log_dir, args.verbose) for b in backends}
        if "gloo" in results and "rsccl" in results:
            gloo, rs = results["gloo"], results["rsccl"]
            gap = sorted(n for n, v in gloo.items() if v[0] == "passed" and rs.get(n, ["missing"])[0] != "passed")
            expected = [n for n in gap if n in gloo_only()]
            missing = [n for n in gap if n not in gloo_only()]
            for n in expected:
                print(f"  gloo only (torch restricts it): {n}")
            for n in missing:
                bad += 1
                outcome, detail = rs.get(n, ["missing", ""])
                print(f"  PASSES ON GLOO, NOT ON RSCCL ({outcome}): {n}\n    " + detail.strip().replace("\n", "\n    ")[-1500:])
            print(f"  {ws} ranks: {len(missing)} tests pass on gloo and not on rsccl", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
