"""The verify step: each step's draft budget, drafting and packing the trees (``_plan``), one
forward over them, greedy verification (one graph where it can) and committing the accepted
paths. Sampled verification lives in ``sampled.py``."""

from __future__ import annotations

import time

import numpy as np
import torch

from .. import kernels
from ..budget.makespan import critical_acceptance
from ..step import _native
from ..step.cuda_graphs import GreedyStepResult, StepInput, forward_part, greedy_tail, keep_accepted
from ..step.grammar import mask_logits
from ..step.numerics import nonfinite_rows
from ..step.penalties import greedy_targets, process_logits
from ..step.tree_batch import PackedTrees
from .request import Request


class Verify:
    """The verify step (mixed into ``Engine``, whose state it uses)."""

    # This step's requests that get no drafts (the budget decision's RequestGate.select).
    _gate_held: frozenset[str] = frozenset()
    # The drafting step's node ranks for the calibration (_observe_acceptance): the corpus rows'
    # column sums (the j-th best nodes' estimates over the batch), the nodes kept per row, and
    # whether the rows were best-first (a kept node's position in its tree is then its rank).
    _plan_ranks: tuple[list[float], int, bool] | None = None

    def _step_budget(self, running: list[Request]) -> int:
        """The step's draft budget: the one _overlaps decided for this batch size, or the policy's."""
        decided, self._budget_now = self._budget_now, None
        if decided is not None and decided[0] == len(running):
            return decided[1]
        return self._decide_budget(running) if self.drafter is not None else 0

    def _decide_budget(self, running: list[Request]) -> int:
        """The policy's budget for this step, raised in a batch's tail (EngineConfig.makespan)."""
        bs = len(running)
        critical = None
        if self.config.makespan.critical_path and self.policy.fixed is None:
            critical = critical_acceptance(running, self.policy.acceptance(bs, True))
        budget = self.policy.draft_budget(bs, critical=critical)
        tail = self.config.makespan.tail_requests
        if tail and bs <= tail and not self.scheduler.waiting and self.config.budget != 0:
            # The batch's tail: a step costs about the same whatever its tree size (verifier/budget/makespan.py).
            budget = max(budget, self.config.makespan.tail_budget or self.config.max_budget)
        self._gate_held = frozenset()
        gate = self.policy.request_gate
        if budget > 0 and self.config.request_gate and gate.enabled:
            # Requests whose acceptance does not pay for the step's cost get no drafts; none left
            # to draft: a plain step (overlapped where it can be).
            ids = [r.req_id for r in running]
            drafts = gate.select(ids, self.policy.step_cost_ratio(bs), [r.params for r in running])
            if not any(drafts):
                return 0
            if not all(drafts):
                self._gate_held = frozenset(i for i, d in zip(ids, drafts) if not d)
        return budget

    @staticmethod
    def _greedy_only(running: list[Request]) -> bool:
        """Whether the step is the forward part and the greedy tail alone: greedy requests whose
        logits need no processing (penalties, min_tokens, grammar masks)."""
        return all(r.plain_greedy and len(r.output_ids) >= r.params.min_tokens for r in running)

    def _fast_greedy(self, running: list[Request]) -> bool:
        """Whether the whole step can replay as one graph (GraphRunner.greedy_step)."""
        return self.graphs is not None and self._greedy_only(running)

    def _verify_step(self, running: list[Request], plain: frozenset[str] = frozenset()) -> None:
        """One verify step of ``running`` (drafting, unless the policy says not to)."""
        t0 = time.perf_counter()  # the step's wall time, drafting included, feeds the budget policy
        captures = self.graphs.captures if self.graphs is not None else 0
        slots = [r.slot for r in running]
        max_prefix = max(r.cache_len for r in running)
        fast = self._fast_greedy(running)
        packed, inp = self._plan(running, plain, slots, max_prefix, fast)
        bs, K = packed.bs, packed.K
        if fast:
            if self.device.type != "cuda":  # a CPU forward is synchronous: hand over the corpus calls first
                self._dispatch(hold=True)
            t1 = time.perf_counter()
            launch = self.graphs.launch_input(inp, bs)
            self._dispatch(hold=True)  # while the GPU runs the step
            r = self.graphs.collect(launch, idle=self._await_remote if self.drafter is not None and self.drafter.pipelined_remote else None)
        else:
            t1 = time.perf_counter()
            r = self._verify_general(running, packed, inp, max_prefix)
        tokens, num_nodes, predicted = packed.tokens, packed.num_nodes, packed.predicted
        t2 = time.perf_counter()
        self.stats.pack_seconds += t1 - t0
        self.stats.forward_seconds += t2 - t1
        accept_index, num, predicts, bad, logits = r.accept_index, r.accept_token_num, r.predicts, r.bad, r.logits
        captured = self.graphs is not None and self.graphs.captures != captures  # a capture is not a step's cost
        if not captured:
            # The forward phase (launch to results) refreshes the cost model; the whole step, the
            # host overhead the model does not see.
            self._told.append((self.policy.observe_step, (K > 1, time.perf_counter() - t0, bs * K, t2 - t1)))
        bad_any = bad.any(-1).tolist()
        # A draft node's NaN K/V reaches every row of its request (masked columns get weight 0, and
        # 0 * NaN = NaN), so such a request verifies the step again without drafts, as plain decoding would.
        retry = frozenset(r.req_id for b, r in enumerate(running) if num_nodes[b] > 1 and bad_any[b])
        if retry:
            for r in running:
                if r.req_id in retry:
                    self.cache.clear(r.slot, r.cache_len)
            return self._verify_step(running, plain | retry)
        accepted_total = 0
        generated = self.stats.generated_tokens
        # Each request's committed run (its accepted path's tokens, then the bonus) gathered for the
        # whole batch at once: accept_index holds the path's node indices into the flat [bs * K]
        # trees (-1 past the path), and the bonus is the target's prediction after the last one.
        rows = np.arange(bs)
        path = np.maximum(accept_index, 0)
        runs = np.empty((bs, K), dtype=np.int64)  # n <= K - 1 accepted, so n + 1 <= K tokens
        runs[:, :K - 1] = tokens.reshape(-1)[path[:, 1:]]
        runs[rows, num] = predicts[path[rows, num]]
        # Python lists: indexing them is several times cheaper than numpy scalars, per request per step.
        num, runs = num.tolist(), runs.tolist()
        slow = None  # the general commit's inputs, made once if a request needs them
        gate = self.policy.request_gate
        for b, req in enumerate(running):
            n = num[b]
            req.cache_len += 1 + n
            req.verify_steps += 1
            nb = num_nodes[b]
            req.draft_tokens += nb - 1
            if nb > 1:
                req.spec_steps += 1
                self.stats.spec_steps += 1
                gate.observe(req.req_id, n)
            accepted_total += n
            # Usage counts accepted tokens that were committed (a stop can cut the path short).
            if not bad_any[b] and req.as_run:
                req.accepted_tokens += min(n, self._commit_run(req, runs[b][:n + 1]))
                continue
            if slow is None:
                slow = accept_index.tolist(), bad.tolist()
            nodes = [i - b * K for i in slow[0][b][1:1 + n]]
            path_b = [0] + nodes  # emitted token j was chosen from the logits of path node j
            req.accepted_tokens += min(n, self._commit_path(req, runs[b][:n + 1], logits[b] if req.params.logprobs is not None else None,
                                                             path_b, [slow[1][b][i] for i in path_b]))
            if bad_any[b]:  # NaN K/V in masked rows would still reach attention (0 * NaN)
                self.cache.clear(req.slot, 0 if req.finish_reason == "error" else req.cache_len)
        t3 = time.perf_counter()  # (the extends and the policy's observations: Commits._settle)
        self.stats.commit_seconds += t3 - t2
        # The step's wall time, commits included, and the tokens it really committed: an accepted
        # path that a stop or max_tokens cuts short delivers only its committed part (near the end
        # of short outputs counting accepted tokens made drafting look better than it was).
        if not captured and self.drafter is not None:
            self._told.append((self.policy.observe_delivered, (bs, self._drafted, t3 - t0, self.stats.generated_tokens - generated)))
        self.stats.draft_tokens += sum(num_nodes) - bs
        self.stats.accepted_tokens += accepted_total
        if K > 1:
            self._told.append((self._observe_acceptance, (predicted, accepted_total, accept_index, r.accept_token_num, K,
                                                          self._plan_ranks)))

    def _observe_acceptance(self, predicted: float, accepted: int, accept_index: np.ndarray, accept_num: np.ndarray,
                            K: int, ranks: tuple[list[float], int, bool] | None) -> None:
        """A verify step's acceptance for the policy's calibration (``BudgetPolicy.observe``), per
        band of node ranks where the plan's rows were best-first: an accepted node's position in its
        packed tree is then its rank (``pack_plan`` keeps a best-first row's first k nodes in order);
        otherwise the step's accepted tokens are spread over the bands as they were predicted. Runs
        after the next launch (``Commits._settle``): numpy over the batch's paths."""
        bands = None
        if ranks is not None:
            sums, k, best_first = ranks
            ranked = None
            if best_first:
                path = accept_index[:, 1:]  # each row's accepted nodes first (accept_num of them)
                on_path = np.arange(K - 1)[None, :] < accept_num[:, None]
                ranked = (path - K * np.arange(len(path))[:, None])[on_path]  # their ranks, 1..K-1
            bands = self.policy.bands_of(sums, k, ranked, accepted)
        self.policy.observe(predicted, accepted, bands)

    def _plan(self, running: list[Request], plain: frozenset[str], slots: list[int], max_prefix: int,
              fast: bool) -> tuple[PackedTrees, StepInput | None]:
        """Every step's drafting and plan: the corpus' padded rows (pruned to what each request's
        grammar accepts) summarized for the node choice, then pruned and packed in one native
        pass each (``verifier/step/csrc/step_rows.h``; ``verifier.step.tree_batch`` holds the numpy
        form, whose ~25 calls cost more than the work at batch 1). With graphs the plan is written
        straight into the pinned input of the step's graph (a greedy step's where ``fast``, else a
        forward graph's) at its buckets; without, at the step's exact shape (no padding to add
        compute on the CPU). Requests in ``plain`` verify no draft (a retry after non-finite logits)."""
        bs = len(running)
        budget = self._step_budget(running)
        held = self._gate_held  # (set by the budget decision: RequestGate)
        spec = [i for i, r in enumerate(running) if r.params.speculate and r.req_id not in plain and r.req_id not in held]
        self._drafted = budget > 0 and bool(spec)
        room = self.config.max_len - max_prefix
        k = nodes = 0
        best_first = True
        self._plan_ranks = None
        if budget > 0 and spec:
            self._flush_extends()  # the last step's commits, which the drafts continue
            batch = self._corpus_call(self.drafter.draft, [running[i].req_id for i in spec], budget)
            tokens, parents, probs, counts = batch.tokens, batch.parents, batch.probs, batch.counts
            grammar = [i for i in spec if running[i].grammar is not None]
            if len(spec) < bs or grammar:  # rows of their own: empty ones for requests that do not speculate
                W = tokens.shape[1]
                tokens, parents = np.zeros((bs, W), np.int32), np.full((bs, W), -1, np.int32)
                probs, counts = np.zeros((bs, W), np.float32), np.zeros(bs, np.int32)
                tokens[spec], parents[spec], probs[spec], counts[spec] = batch.tokens, batch.parents, batch.probs, batch.counts
                for i in grammar:  # structured output: nodes the grammar rejects cost nothing
                    n = int(counts[i])
                    t, p, q = running[i].grammar.prune_draft(tokens[i, :n], parents[i, :n], probs[i, :n])
                    m = len(t)
                    tokens[i, :m], parents[i, :m], probs[i, :m], counts[i] = t, p, q, m
                    tokens[i, m:], parents[i, m:], probs[i, m:] = 0, -1, 0.0
            nodes, best_first, sums = _native.summarize_rows(probs, counts)
            k = self.policy.choose_nodes_summary(bs, nodes, sums)
            k = max(0, min(k, room - 1))  # rows prefix .. prefix + K - 1
            self._plan_ranks = (sums, min(k, nodes), best_first)
        else:
            tokens = parents = np.zeros((bs, 0), np.int32)
            probs, counts = np.zeros((bs, 0), np.float32), np.zeros(bs, np.int32)
        inp = None
        if self.graphs is None:
            K, rows, scratch, out = 1, 0, 0, None
        else:
            K = self.graphs.nodes_bucket(1 + min(nodes, k), room)
            inp = self.graphs.step_input(bs, K, max_prefix + K, forward_only=not fast)
            rows, scratch, out = inp.B, self.graphs.scratch, inp.host
        host, K, num_nodes, predicted = _native.pack_plan(
            [r.last_token for r in running], tokens, parents, probs, counts, k, best_first,
            [r.cache_len for r in running], slots, K, rows=rows, scratch=scratch, out=out)
        return PackedTrees(host, bs, K, num_nodes, predicted, rows=rows), inp

    def _verify_general(self, running: list[Request], packed: PackedTrees, inp: StepInput | None, max_prefix: int):
        """A step that is not one greedy-step graph: the forward part replayed as a forward graph
        where there are graphs (``inp``), else run eagerly at the step's shape; then either the
        greedy tail (greedy requests without logit processing, no graphs), or tree rejection
        sampling straight from the logits (``_raw_targets``: no processing; top-k / top-p as a
        floor per row), or the logits processed on the way (penalties, grammar masks, logprobs)
        and verified greedily, from the processed logits as from raw ones where they stay finite,
        or by tree rejection sampling of their distribution (grammars, min_tokens), eagerly.
        Returns the results on the host as greedy_step does."""
        bs, K = packed.bs, packed.K
        if self.device.type != "cuda":  # a CPU forward is synchronous: hand over the corpus calls first
            self._dispatch(hold=True)
        greedy_only = inp is None and self._greedy_only(running)
        raw = not greedy_only and self._raw_targets(running)
        if inp is not None:  # (a forward graph's logits are in the model's dtype)
            f = self.graphs.launch_forward(inp, bs)
        else:
            slots = packed.slots.tolist()
            consecutive = slots == list(range(slots[0], slots[0] + bs))
            # Logits in the model's dtype for the greedy tail and the raw sampling (as a graph gives them).
            f = forward_part(self.model, self.cache, torch.from_numpy(packed.host).to(self.device), bs, K,
                             max_prefix + K, float_logits=not (greedy_only or raw),
                             slot_range=(slots[0], bs) if consecutive else None)
        self._dispatch(hold=True)  # while the GPU runs the forward
        if greedy_only:
            return GreedyStepResult.unpack(greedy_tail(self.cache, f).cpu().numpy(), bs, K, bs, f.logits)
        if raw:
            res, bad = self._verify_raw(running, f)
            logits = f.logits
        elif all(r.params.greedy and r.grammar is None and r.params.logprobs is None for r in running):
            # Greedy, processed (penalties, min_tokens): only the rows that need it in float32.
            logits = f.logits
            bad = nonfinite_rows(logits)  # before penalties: min_tokens puts -inf in on purpose
            idx = f.idx
            target = greedy_targets(logits, running, f.tokens, f.tree_mask, self.eos_ids, self.penalty_counts)
            res = kernels.verify_tree_greedy(f.tokens, idx.retrive_index, idx.retrive_next_token,
                                             idx.retrive_next_sibling, target, K)
        else:
            # Processing writes into the logits: a float32 copy of a graph's 16-bit buffer.
            logits = f.logits if f.logits.dtype == torch.float32 else f.logits.float()
            bad = nonfinite_rows(logits)  # before penalties: min_tokens puts -inf in on purpose
            process_logits(logits, running, f.tokens, f.tree_mask, self.eos_ids, self.penalty_counts)
            if any(r.grammar is not None for r in running):  # structured output: each node's grammar mask
                n, tok, par = packed.num_nodes, packed.tokens, packed.parents
                mask_logits(running, [(tok[b, 1:n[b]], par[b, 1:n[b]] - 1) for b in range(bs)], logits)
            idx = f.idx
            if all(r.params.greedy for r in running):
                res = kernels.verify_tree_greedy(f.tokens, idx.retrive_index, idx.retrive_next_token,
                                                 idx.retrive_next_sibling, logits.argmax(-1), K)
            elif self._finite_after_processing(running):  # penalties / logprobs: no sort, no [bs, K, V] q
                res, _ = self._verify_raw(running, f, logits)
            else:
                res = self._verify_sampled(running, f, logits)
        keep_accepted(self.cache, f, res)
        # One device-to-host copy (each copy is a sync).
        flat = GreedyStepResult.pack(res.accept_index, res.accept_token_num, res.predicts, bad).cpu().numpy()
        return GreedyStepResult.unpack(flat, bs, K, bs, logits)
