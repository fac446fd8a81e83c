"""What every benchmark shares: latency percentiles, the median run of several, a corpus server
process on 127.0.0.1 ephemeral ports, the budget-policy arms of the A/B benches, and the ending:
the whole result as JSON and one ``SUMMARY {...}`` line that runs are compared by
(``parse_summary`` reads it back)."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from ngram_common.gc_heap import freeze_startup_heap

REPO = Path(__file__).resolve().parent.parent
SUMMARY_PREFIX = "SUMMARY "
ADMIN_TOKEN = "bench-admin-token-0123456789"  # the admin token of persistent_server's servers
_ADMIN_TOKEN = object()  # CorpusServer.http's default: the server's own admin token

# Arms of bench/modes.py and bench/closed_batch.py that differ from the defaults in BudgetPolicy
# fields alone: spec_explore2, the losing mode explored at most 2x explore_every apart (before
# explore_factor's larger factors); spec_explore8, a clear lead re-checked at most 8x apart (the
# default before explore_scale 4); spec_bands, each node rank calibrated by its band.
POLICY_ARMS = {"spec_explore2": {"explore_max": 2, "explore_scale": 1},
               "spec_explore8": {"explore_max": 8, "explore_scale": 1},
               "spec_bands": {"rank_bands": True}}


def set_policy_arm(policy, arm: str) -> None:
    """An arm's BudgetPolicy fields (POLICY_ARMS; other arms leave the policy as it is)."""
    for name, value in POLICY_ARMS.get(arm, {}).items():
        setattr(policy, name, value)


# ---------------------------------------------------------------------------------- statistics

def parse_overrides(pairs: Iterable[str]) -> dict:
    """``FIELD=VALUE`` strings (the benchmarks' ``--set``) as CorpusConfig keyword arguments: a value
    that looks like JSON (a number, true / false, a list, an object) is parsed as JSON, a list becomes a
    tuple, anything else stays a string. SystemExit naming an item without "="."""
    out = {}
    for kv in pairs:
        k, sep, v = kv.partition("=")
        if not sep:
            raise SystemExit(f"--set: expected FIELD=VALUE, got {kv!r}")
        out[k] = json.loads(v) if v[:1] in "[{0123456789-.tf" else v
        if isinstance(out[k], list):
            out[k] = tuple(out[k])
    return out


def quantile_key(q: float, unit: str) -> str:
    """``p50_us``, ``p99_ms``, ``p999_ms`` (99.9): the key a percentile is stored under."""
    return "p" + f"{q:g}".replace(".", "") + f"_{unit}"


def percentiles(values: Iterable[float], unit: str = "us", scale: float = 1.0,
                qs: Sequence[float] = (50, 99), digits: int | None = 1) -> dict[str, float]:
    """``{"n", "p<q>_<unit>" per q, "mean_<unit>", "max_<unit>"}`` of ``values * scale`` (numpy's
    linear interpolation between samples); ``{"n": 0}`` for no values, so a run whose operation
    never happened still reports, and says so. ``digits``: rounding (None keeps full precision)."""
    if not unit or not unit.isidentifier():
        raise ValueError(f"percentiles: unit must be a short name such as 'us' or 'ms', got {unit!r}")
    if not qs or any(not 0 <= q <= 100 for q in qs):
        raise ValueError(f"percentiles: each quantile must be in [0, 100], got {list(qs)}")
    keys = [quantile_key(q, unit) for q in qs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"percentiles: quantiles {list(qs)} give the same key twice ({keys})")
    a = np.asarray(list(values), dtype=np.float64) * scale
    if a.ndim != 1:
        raise ValueError(f"percentiles: expected a flat sequence of numbers, got shape {a.shape}")
    if a.size == 0:
        return {"n": 0}
    if not np.isfinite(a).all():
        raise ValueError(f"percentiles: {int((~np.isfinite(a)).sum())} of {a.size} values are not finite")

    def r(x: float) -> float:
        return float(x) if digits is None else round(float(x), digits)

    out: dict[str, float] = {"n": int(a.size)}
    out.update({k: r(v) for k, v in zip(keys, np.percentile(a, list(qs)))})
    out[f"mean_{unit}"] = r(a.mean())
    out[f"max_{unit}"] = r(a.max())
    return out


def median_run(runs: Sequence[dict], key: str) -> dict:
    """The median of several runs of one configuration by ``runs[i][key]``: a run that happened
    (the lower of the two middle ones for an even count), not an average of runs."""
    if not runs:
        raise ValueError(f"median_run: no runs to choose from (key {key!r})")
    missing = [i for i, r in enumerate(runs) if key not in r]
    if missing:
        raise ValueError(f"median_run: runs {missing} have no {key!r}")
    return sorted(runs, key=lambda r: r[key])[(len(runs) - 1) // 2]


# ---------------------------------------------------------------------------------- the ending

def write_report(out: str | Path, res: dict, summary: dict) -> None:
    """The whole result as JSON at ``out`` (folders made as needed), then the one summary line."""
    if not isinstance(summary, dict) or not summary:
        raise ValueError(f"write_report: the summary must be a non-empty dict, got {summary!r}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(SUMMARY_PREFIX + json.dumps(summary, default=str), flush=True)


def parse_summary(text: str) -> dict:
    """The summary a benchmark printed (its output ``text``): exactly one ``SUMMARY {...}`` line."""
    lines = [ln[len(SUMMARY_PREFIX):] for ln in text.splitlines() if ln.startswith(SUMMARY_PREFIX)]
    if len(lines) != 1:
        raise ValueError(f"expected one {SUMMARY_PREFIX.strip()} line, found {len(lines)}")
    summary = json.loads(lines[0])
    if not isinstance(summary, dict):
        raise ValueError(f"the {SUMMARY_PREFIX.strip()} line holds {type(summary).__name__}, not an object")
    return summary


class GcWatch:
    """Python's collections of its oldest generation while a timed run is inside the ``with``: how many
    and how long they held the interpreter (one over an engine process's unfrozen heap took 50-150 ms
    on the 2-core host, 2026-12-06; ngram_common/gc_heap.py). ``freeze``: on entry, what earlier runs
    left to the collector (a dropped engine's graphs and device memory) is freed and what lives is
    frozen out of its scans, as the servers do once started; on exit the heap is unfrozen."""

    def __init__(self, freeze: bool = False) -> None:
        self.full, self.seconds, self._t, self.freeze = 0, 0.0, None, freeze
        self.young_seconds = 0.0  # collections of generations 0 and 1 (a step log's per-step figure)

    def _seen(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            dt, self._t = time.perf_counter() - self._t, None
            if info.get("generation") == 2:
                self.full, self.seconds = self.full + 1, self.seconds + dt
            else:
                self.young_seconds += dt

    def __enter__(self) -> GcWatch:
        if self.freeze:
            freeze_startup_heap()
        gc.callbacks.append(self._seen)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._seen)
        if self.freeze:
            gc.unfreeze()

    def as_dict(self) -> dict:
        return {"gc_full": self.full, "gc_full_s": round(self.seconds, 4)}


def load_average() -> list[float]:
    """The host's 1/5/15-minute load, recorded before and after a run: a busy host explains noise."""
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------------------------- servers

class CorpusServer:
    """``python -m corpus_service serve`` on 127.0.0.1 with ephemeral ports, read back from its
    ports file in ``workdir`` (its log is there too).

    ``persist``: ``--data-dir workdir`` (snapshots, uploads; else ``--data-dir ''``, nothing kept, not
    the user's default data directory); ``admin``: the REST admin on an
    ephemeral port (off otherwise); ``admin_token``: the admin token (None: a loopback server
    without one); ``log_level``: None keeps the server's default; ``args``: any other serve flags."""

    def __init__(self, workdir: str | Path, *args: str, persist: bool = False, admin: bool = False,
                 admin_token: str | None = None, log_level: str | None = "WARNING", env: dict | None = None) -> None:
        self.data_dir = Path(workdir)
        self.args = list(args)
        self.persist, self.admin = persist, admin
        self.admin_token = admin_token
        self.log_level = log_level
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.grpc_port = self.admin_port = 0
        self.log_path = self.data_dir / "server.log"
        self._log = None

    def command(self, grpc_port: int = 0, admin_port: int | None = None) -> list[str]:
        admin_port = (0 if self.admin else -1) if admin_port is None else admin_port
        return [sys.executable, "-m", "corpus_service", "serve", "--host", "127.0.0.1",
                "--grpc-port", str(grpc_port), "--admin-port", str(admin_port),
                "--ports-file", str(self.data_dir / "ports.json"),
                "--data-dir", str(self.data_dir) if self.persist else "",  # "": explicitly nothing persists
                *(("--admin-token", self.admin_token) if self.admin_token else ()),
                *(("--log-level", self.log_level) if self.log_level else ()), *self.args]

    def start(self, grpc_port: int = 0, admin_port: int | None = None, timeout: float = 60.0) -> "CorpusServer":
        """Starts the process and waits for its ports (``RuntimeError`` with the log's tail if it
        exits, ``TimeoutError`` if it takes longer than ``timeout``)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports = self.data_dir / "ports.json"
        ports.unlink(missing_ok=True)
        self.log_path = self.data_dir / f"server-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(self.command(grpc_port, admin_port), cwd=REPO, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not ports.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the corpus server exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"the corpus server did not start within {timeout}s:\n{self.log()}")
            time.sleep(0.02)
        p = json.loads(ports.read_text())
        self.grpc_port, self.admin_port = p["grpc_port"], p.get("admin_port") or 0  # 0: no admin API
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def http(self, token: str | None | object = _ADMIN_TOKEN):
        """An ``httpx.Client`` on the admin API with ``token`` (default: the server's admin token;
        None: no token)."""
        import httpx  # only the benchmarks that use the admin API need it

        token = self.admin_token if token is _ADMIN_TOKEN else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.admin_url, headers=headers, timeout=30.0)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM: drain (and snapshot, when persistent); kill -9 after ``timeout``."""
        if self.proc is None:
            raise RuntimeError("the corpus server was never started")
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(10)
        self._close_log()
        return rc

    def kill(self) -> None:
        """kill -9: no drain, no snapshot."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> "CorpusServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        if self.alive():
            self.stop()
        else:
            self.kill()


def persistent_server(data_dir: str | Path, *args: str) -> CorpusServer:
    """A server with what the load, fuzz and crash benchmarks exercise: a data folder (snapshots,
    uploads), the REST admin with ``ADMIN_TOKEN``, a 1 s drain, the server's own log level."""
    return CorpusServer(data_dir, "--drain-timeout-s", "1", *args, persist=True, admin=True,
                        admin_token=ADMIN_TOKEN, log_level=None)

