"""``ngram-verifier generate`` (``python -m verifier generate``): offline rollouts from a JSONL of
prompts into a JSONL of completions, one line per sample, written as each sample ends:

    {"id": "3-5", "prompt_index": 3, "sample": 5, "prompt_key": "...", "policy_version": 2, "seed": 29,
     "output_ids": [...], "text": "...", "logprobs": [...], "cumulative_logprob": -41.2,
     "finish_reason": "stop", "accepted_draft_tokens": 80, "verify_steps": 61}

The last line on stderr (and ``--summary`` as JSON) gives the batch's makespan, tokens/s and MAT.

Every prompt is read and checked (``prompts.py``: UTF-8, JSON, the HTTP API's chat rules, the fit in
``--max-len``) before the engine starts, and ``--out`` is written to a temporary file beside it that
replaces it only once the run ends: a bad input or a failed run leaves an existing ``--out`` as it was.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass

from ..config import flag
from .llm import MAX_SAMPLES_PER_PROMPT


@dataclass(frozen=True, slots=True)
class GenerateConfig:
    prompts: str = flag("", "the JSONL of prompts: one object per line with \"prompt\" (text), \"prompt_ids\" "
                        "(token ids) or chat \"messages\"", "a file (required)")
    out: str = flag("", "where the completions go: one JSON object per sample", "a file (required; '-' = stdout)")
    n: int = flag(1, "samples per prompt", f"an int 1..{MAX_SAMPLES_PER_PROMPT}", short="-n")
    temperature: float = flag(1.0, "sampling temperature", "a number 0..100; 0 = greedy")
    top_p: float = flag(1.0, "nucleus sampling mass", "a number in (0, 1]")
    top_k: int = flag(0, "sample among the k most likely tokens", "an int >= 0; 0 = off")
    seed: int = flag(0, "sample s of prompt p draws from seed + p * n + s", "an int 0..2^63-1; -1 = random")
    max_new: int = flag(256, "new tokens per sample at most", "an int >= 1")
    logprobs: bool = flag(True, "write each output token's logprob", "true/false")
    prompt_key_field: str = flag("", "the prompts' field naming each prompt's key in the corpus' prompt history",
                                 "a field name; '' = the corpus' default key (a hash of the prompt ids)")
    policy_version: int = flag(-1, "the policy version sampling these rollouts (the RL step)",
                               "an int 0..2^62-1; -1 = the corpus namespace's current")
    summary: str = flag("", "write the run's summary (makespan, tokens/s, MAT) as JSON to this file",
                        "a file; '' = only the stderr line")
    progress: bool = flag(True, "show a progress bar on stderr", "true/false")
    model: str = flag("smollm2", "the target model", "a .gguf file, a HF safetensors directory, or 'smollm2'")
    corpus: str = flag("local", "where drafts come from", "'local' (in process), HOST:PORT of a corpus service, "
                       "or 'none' (no speculation)")
    corpus_namespace: str = flag("", "the corpus service's namespace", "'' = the model's (as serve)")
    corpus_token: str = flag("", "bearer token for the corpus service", "a token; '' = none", repr=False)
    device: str = flag("cpu", "where the model runs", "cpu, cuda")
    dtype: str = flag("float32", "the model's weights and activations", "float32, bfloat16, float16")
    max_batch: int = flag(32, "samples decoded together (KV cache slots)", "an int 1..4096")
    max_len: int = flag(0, "longest prompt + output per sample, in tokens",
                        "0 = the longest prompt + --max-new + the tree's room, or an int 16..1048576")
    budget: str = flag("auto", "draft nodes per sample and step", "'auto' or an int 0..--max-budget")
    max_budget: int = flag(15, "the most draft nodes per sample and step", "an int 1..63")
    tail_requests: int = flag(-1, "a batch's tail: steps with no sample waiting and at most this many running "
                              "draft --tail-budget nodes", "-1 = max_batch // 8 (at least 1), 0 = off, or an int")
    tail_budget: int = flag(0, "draft nodes per sample in the tail", "0 (= --max-budget) or 1..--max-budget")
    longest_first: bool = flag(False, "start the samples whose prompt history is longest first (no gain measured "
                               "on the dev rollout traces: docs/rollout_frontend.md)", "true/false")
    critical_path: bool = flag(False, "judge drafting by the sample expected to end last, not the batch's mean "
                               "(docs/rollout_frontend.md)", "true/false")
    gpu_share: int = flag(1, "busy verifier processes sharing this GPU (several generators or replicas on it): "
                          "a tree's extra forward time counts this many times", "1..64")
    weight_noise_sigma: float = flag(0.0, "perturb the decoder's linear weights (an RL policy change; as serve)",
                                     "a number 0..1")
    weight_noise_seed: int = flag(0, "the perturbation's seed", "an int 0..2^63-1")
    cost_probe_s: float = flag(10.0, "--budget auto: start-up time allowed for measuring step costs", "seconds > 0")

    def __post_init__(self) -> None:
        if not self.prompts or not self.out:
            raise ValueError("--prompts and --out are required")
        if not -1 <= self.seed < 2**63:
            raise ValueError(f"seed: expected -1 (random) or an int in [0, 2^63), got {self.seed}")
        if not -1 <= self.policy_version < 2**62:
            raise ValueError(f"policy_version: expected -1 or an int in [0, 2^62), got {self.policy_version}")
        if self.max_len and not 16 <= self.max_len <= 1 << 20:
            raise ValueError(f"max_len: expected 0 or 16..2^20, got {self.max_len}")
        for name, lo in (("top_k", 0), ("max_new", 1)):  # the engine's tensors and C++ hold them as int32/int64
            if not lo <= getattr(self, name) < 2**31:
                raise ValueError(f"{name}: expected an int in [{lo}, 2^31), got {getattr(self, name)}")
        if self.tail_requests < -1:
            raise ValueError(f"tail_requests: expected -1, 0 or more, got {self.tail_requests}")

    def verifier_fields(self) -> dict:
        """The LLM's (VerifierConfig's) keywords; max_len is set once the prompts are read."""
        names = ("corpus_namespace", "corpus_token", "device", "dtype", "max_batch", "budget", "max_budget",
                 "tail_budget", "longest_first", "critical_path", "gpu_share", "weight_noise_sigma",
                 "weight_noise_seed", "cost_probe_s")
        out = {k: getattr(self, k) for k in names}
        out["tail_requests"] = max(1, self.max_batch // 8) if self.tail_requests < 0 else self.tail_requests
        out["log_level"] = "WARNING"
        return out


def run_generate(cfg: GenerateConfig) -> int:
    import logging

    from corpus_service import default_prompt_key

    from ..config import VerifierConfig
    from ..model import load_model
    from .llm import LLM, SamplingParams
    from .prompts import check_lengths, read_prompts

    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    params = SamplingParams(n=cfg.n, max_tokens=cfg.max_new, temperature=cfg.temperature, top_p=cfg.top_p,
                            top_k=cfg.top_k, seed=None if cfg.seed < 0 else cfg.seed,
                            logprobs=0 if cfg.logprobs else None)
    kwargs = cfg.verifier_fields()
    VerifierConfig(model=cfg.model, corpus=cfg.corpus, max_len=cfg.max_len or 2048, **kwargs)  # flags checked first
    # The tokenizer reads the prompts before the engine exists: the KV cache is sized to the longest.
    lm = load_model(cfg.model, cfg.device, cfg.dtype, cfg.weight_noise_sigma, cfg.weight_noise_seed)
    prompts = read_prompts(cfg.prompts, lm.codec, lm.model.config.vocab_size, cfg.prompt_key_field)
    longest = max(len(p.prompt_ids) for p in prompts)
    kwargs["max_len"] = cfg.max_len or max(16, longest + cfg.max_new + cfg.max_budget + 2)
    check_lengths(prompts, kwargs["max_len"], cfg.max_new)
    out_dir = os.path.dirname(os.path.abspath(cfg.out))
    if cfg.out != "-" and not os.path.isdir(out_dir):
        raise ValueError(f"out: the directory {out_dir} does not exist")
    llm = LLM(cfg.model, cfg.corpus, loaded=lm, **kwargs)
    if cfg.out == "-":
        out, tmp = sys.stdout, None
    else:  # beside --out (same file system), renamed over it once the run ends
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(cfg.out) + ".", suffix=".tmp", dir=out_dir)
        out = os.fdopen(fd, "w", encoding="utf-8")
    version = None if cfg.policy_version < 0 else cfg.policy_version
    outs_keys = [p.prompt_key or default_prompt_key(p.prompt_ids) for p in prompts]

    def write(i: int, c) -> None:
        key = outs_keys[i]
        rec = {"id": f"{i}-{c.index}", "prompt_index": i, "sample": c.index, "prompt_key": key,
               "policy_version": version, "seed": c.seed, "output_ids": c.token_ids, "text": c.text,
               "logprobs": c.logprobs, "cumulative_logprob": c.cumulative_logprob, "finish_reason": c.finish_reason,
               "accepted_draft_tokens": c.accepted_draft_tokens, "verify_steps": c.verify_steps}
        out.write(json.dumps(rec) + "\n")

    done = False
    try:
        llm.generate([p.prompt_ids for p in prompts], params, prompt_keys=[p.prompt_key for p in prompts],
                     policy_version=version, use_tqdm=cfg.progress, on_done=write)
        done = True
    finally:
        if tmp is not None:
            out.close()
            if done:
                os.chmod(tmp, 0o644 & ~_umask())  # mkstemp makes it 0600; --out gets a plain file's mode
                os.replace(tmp, cfg.out)
            else:
                os.unlink(tmp)
        llm.close()
    s = llm.last_run.as_dict()
    s.update(model=cfg.model, corpus=cfg.corpus, n=cfg.n, temperature=cfg.temperature, max_new=cfg.max_new)
    print(f"generate: {s['completions']} samples of {s['prompts']} prompts, {s['output_tokens']} tokens, makespan "
          f"{s['makespan_s']:.2f} s, {s['tokens_per_s']:.1f} tok/s, MAT {s['mean_accepted_tokens']:.3f}, "
          f"{s['errors']} errors", file=sys.stderr)
    if cfg.summary:
        with open(cfg.summary, "w", encoding="utf-8") as f:
            json.dump(s, f, indent=1)
    return 1 if s["errors"] else 0


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
