"""GPU: TP groups whose ranks are separate processes (jax.distributed), their mailboxes shared
through exported handles. On one GPU every process runs on it (CUDA_VISIBLE_DEVICES=0, one
JAX device each); with several GPUs, one process per GPU. tests/processes_peer.py is the
process; this file starts them and compares what they report."""

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / "tests" / "processes_peer.py"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_count():
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    return len([line for line in out.stdout.splitlines() if line.startswith("GPU ")])


def run_processes(n, *flags, one_gpu=True, timeout=540):
    """Start `n` peer processes (all on GPU 0, or process i on GPU i) and return each one's
    return code, report (the last JSON line it printed) and the end of its stderr. Output
    goes to files: a pipe nobody reads could stall a process that its peers wait for."""
    port = _free_port()
    procs, logs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for i in range(n):
                env = dict(os.environ, CUDA_VISIBLE_DEVICES="0" if one_gpu else str(i),
                           XLA_PYTHON_CLIENT_PREALLOCATE="false", JAX_PLATFORMS="cuda")
                env.pop("XLA_FLAGS", None)
                out, err = (open(Path(tmp) / f"{i}.{s}", "w+") for s in ("out", "err"))
                logs.append((out, err))
                procs.append(subprocess.Popen(
                    [sys.executable, str(PEER), "--coordinator", f"127.0.0.1:{port}",
                     "--processes", str(n), "--process-id", str(i), *flags], env=env,
                    stdout=out, stderr=err, text=True, cwd=ROOT))
            for p in procs:
                p.wait(timeout=timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results = []
        for p, (out, err) in zip(procs, logs):
            out.seek(0), err.seek(0)
            lines = [line for line in out.read().splitlines() if line.startswith("{")]
            results.append((p.returncode, json.loads(lines[-1]) if lines else None,
                            err.read()[-3000:]))
            out.close(), err.close()
    return results


def _same_across_ranks(reports, key):
    """Every group's ranks reported the same digest per call: {(call, group): {digests}}."""
    seen = {}
    for report in reports:
        for where, value in report[key].items():
            call, idx = where.split("/")  # "call/g.r": group g, rank r (a 1-D mesh: "call/r")
            group = tuple(idx.split(".")[:-1])
            seen.setdefault((call, group), set()).add(value)
    return seen


@pytest.mark.parametrize("n,dp", [(2, 1), (4, 2)], ids=["tp2", "dp2_tp2"])
def test_processes_share_a_mailbox(n, dp):
    """Every process's ranks match the float64 model (checked inside each process), the ranks
    of a group agree bit for bit across processes, the call counters advance together, and
    arm() (collective) restarts them."""
    one_gpu = gpu_count() < n
    results = run_processes(n, "--dp", str(dp), one_gpu=one_gpu)
    for rc, report, err in results:
        assert rc == 0 and report is not None, err
    reports = [r for _, r, _ in results]
    assert sorted(r["process"] for r in reports) == list(range(n))
    for key in ("all_reduce", "tail"):
        groups = _same_across_ranks(reports, key)
        assert len(groups) == 2 * dp, groups  # two calls per group
        for where, digests in groups.items():
            assert len(digests) == 1, f"{key} {where}: ranks differ {digests}"
    for report in reports:
        # Each group's ranks did 4 all-reduces (2 alone, 2 inside the tail), then arm().
        assert all(c == [4, 4] for c in report["calls"].values()), report["calls"]
        assert report["unarmed"] == 0 and report["live_mailbox_refused"]
        assert all(c == [0, 0] for c in report["calls_after_arm"].values())


def test_killed_peer_process_is_a_loud_timeout():
    """A peer process killed between calls: the survivor's next all-reduce returns NaN rows
    within the mailbox's timeout, and Mailbox.check names the missing rank, not a hang and
    not stale rows."""
    results = run_processes(2, "--scenario", "killed", "--timeout-ms", "3000",
                            one_gpu=gpu_count() < 2)
    (rc0, survivor, err0), (rc1, killed, _) = results
    print(json.dumps(survivor))  # for the record (pytest -rP shows it)
    assert rc0 == 0 and survivor is not None, err0
    assert rc1 == -9 and killed["killed"] and killed["first_ok"]
    assert survivor["first_ok"] and survivor["second_all_nan"], survivor
    assert survivor["timeout"] and "waiting for rows of rank(s) [1]" in survivor["timeout"], \
        survivor["timeout"]
