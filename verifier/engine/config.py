"""The engine's configuration (``EngineConfig``, validated here; ``verifier/config.py`` mirrors it
as flags) and its running counters (``EngineStats``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import kernels
from ..budget.makespan import MakespanConfig
from ..budget.policy import BudgetStats


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_batch: int = 8  # KV-cache slots = requests decoded together
    max_len: int = 2048  # tokens per request (prompt + output + draft nodes)
    budget: int | None = None  # draft nodes per request; None = adaptive (cost model + acceptance)
    max_budget: int = 15
    # Verifier processes sharing this GPU (MPS or time-sliced; verifier/budget/policy.py, gpu_share).
    gpu_share: int = 1
    cost_probe_s: float = 10.0  # start-up time allowed for measuring the cost model
    cuda_graphs: bool = True  # replay captured graphs for decode/verify steps (CUDA only)
    compile: bool = True  # torch.compile the layers' elementwise ops into fused kernels (CUDA only)
    capture_at_start: bool = True  # capture the greedy-step and forward graphs of every bucket at start-up (CUDA graphs)
    prefill_tokens: int = 8192  # prompt tokens (padding included) per batched prefill forward
    emulate_graphs: bool = False  # tests: the graph path (padded buckets, one-graph greedy step) run eagerly on any device
    # Steps through kernels.norm_linear (norms and SwiGLU fused into the matmuls), where every step
    # fits it (max_batch * (max_budget + 1) <= kernels.NORM_LINEAR_MAX_ROWS): "auto" = whichever
    # replays a decode step faster, timed at start-up (CUDA graphs; it wins on a small model, whose
    # steps are bound by kernel count, and can lose to cuBLAS on a large one); "on"; "off".
    native_linear: str = "auto"
    # Waiting requests join a running batch once this many slots are free (or all fit), or after
    # scheduler.MAX_REFILL_WAIT_STEPS steps: fewer prefill forwards (verifier/engine/scheduler.py).
    # 0 = max_batch // 8 (at least 1: every refill at once up to batch 15).
    refill_group: int = 0
    # Plain decoding (no drafter) launches each step before committing the previous one's tokens:
    # the next step's input tokens come from the previous step's predictions on the device, so the
    # host's per-step work (commits, stops, streaming) overlaps the GPU's instead of adding to it.
    # Applies to greedy steps replayed as graphs (no penalties, grammars or logprobs). Measured on
    # the H200 (SmolLM2, docs/history/2026-12.md): plain decoding 895 -> 1,024 tok/s at batch 1, 8% faster
    # at batch 8 and 64; outputs are identical (tests/verifier/engine/test_overlap_plain.py).
    overlap_plain: bool = True
    # The same for a speculative engine's plain steps (the budget policy drafts nothing that step:
    # large batches, or drafting that does not pay); a drafting step first commits the step in
    # flight, and its tokens count as plain decoding's in the policy. Measured on the H200
    # (docs/history/2026-12.md): plain steps of a speculative engine at batch 1 delivered 943 tok/s
    # instead of 858, speculation at batch 8 with 64 new tokens 1.04x -> 1.15x plain.
    overlap_spec_plain: bool = True
    # Batches that end together (RL rollouts): deeper drafts in the batch's tail, longest expected
    # requests admitted first, from the corpus' prompt history (verifier/budget/makespan.py). Off by default.
    makespan: MakespanConfig = MakespanConfig()
    # Within a drafting step, no drafts for a request whose own measured acceptance does not pay for
    # a drafting step's cost (penalties, grammars: verifier/budget/request_gate.py); adaptive budget only.
    # Off: on the H100 (2026-12-06, bench/modes.py) every mode measured ran as fast or faster without
    # it (sampled at batch 1 1.21x plain against 1.10x, mixed 1.08x against 1.00x, penalties 0.99x
    # against 0.96x): a held request's plain steps cost the engine about what its drafts did.
    request_gate: bool = False

    @property
    def refill_slots(self) -> int:
        return self.refill_group or max(1, self.max_batch // 8)

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch <= 4096:
            raise ValueError(f"max_batch: expected 1..4096, got {self.max_batch}")
        if not 16 <= self.max_len <= 1 << 20:
            raise ValueError(f"max_len: expected 16..2^20, got {self.max_len}")
        if not 1 <= self.max_budget <= kernels.MAX_NODES - 1:
            raise ValueError(f"max_budget: expected 1..{kernels.MAX_NODES - 1}, got {self.max_budget}")
        if isinstance(self.gpu_share, bool) or not isinstance(self.gpu_share, int) or not 1 <= self.gpu_share <= 64:
            raise ValueError(f"gpu_share: expected an int 1..64, got {self.gpu_share!r}")
        if not 1 <= self.prefill_tokens <= 1 << 20:
            raise ValueError(f"prefill_tokens: expected 1..2^20, got {self.prefill_tokens}")
        if not 0 <= self.refill_group <= self.max_batch:
            raise ValueError(f"refill_group: expected 0 (auto) or 1..max_batch ({self.max_batch}), got {self.refill_group}")
        if self.native_linear not in ("auto", "on", "off"):
            raise ValueError(f"native_linear: expected 'auto', 'on' or 'off', got {self.native_linear!r}")
        if not isinstance(self.makespan, MakespanConfig):
            raise ValueError(f"makespan: expected a MakespanConfig, got {type(self.makespan).__name__}")
        if self.makespan.tail_budget > self.max_budget:
            raise ValueError(f"tail_budget: expected 0..max_budget ({self.max_budget}), got {self.makespan.tail_budget}")
        if self.budget is not None and not 0 <= self.budget <= self.max_budget:
            raise ValueError(f"budget: expected 0..max_budget ({self.max_budget}) or None (adaptive), got {self.budget}")


@dataclass
class EngineStats:
    steps: int = 0
    step_seconds: float = 0.0  # wall time of step(), prefills included
    prefills: int = 0  # prefill forwards (a batch of prompts admitted together is one)
    prefill_seconds: float = 0.0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    draft_tokens: int = 0  # draft nodes verified
    accepted_tokens: int = 0
    spec_steps: int = 0  # request-steps that verified at least one draft node
    # Host time of the engine thread in drafter calls (drafts, commits, hand-offs to a remote
    # client): what the corpus costs a step beyond the GPU's work.
    corpus_seconds: float = 0.0
    # Verify steps' phases on the host (bench/e2e.py reports them): choosing, pruning and packing
    # the drafts (drafting included), the forward call (launch, the corpus hand-off while the GPU
    # runs, the wait for its results), and committing the accepted tokens.
    pack_seconds: float = 0.0
    forward_seconds: float = 0.0
    commit_seconds: float = 0.0
    # The adaptive budget's switches to plain decoding by reason, and its cost model's refreshes
    # (verifier/budget/policy.py): the policy's own counters, shared.
    budget: BudgetStats = field(default_factory=BudgetStats)
