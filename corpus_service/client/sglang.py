"""RemoteNgramCorpus: SGLang's ``NgramCorpus`` interface over the network (a drop-in for its ngram
worker). Same arguments and returns as ``corpus_service.NgramCorpus``' SGLang API; ``batch_put``
is asynchronous as in SGLang (its errors surface at the next ``synchronize``).

How it drafts is the server's namespace's: its ``mode`` is ``score`` unless the namespace spec sets
one, whatever ``match_type`` the worker passes here. SGLang's orderings are a namespace setting:
``ngram-corpus serve --namespace NAME:mode=bfs`` (or ``mode=prob``).

Prompt history: SGLang's ``batch_get`` carries no prompt, only each request's last window, so as
SGLang's worker calls it, no request has a prompt key (nor a policy version): they draft from the
learned corpus, not from a prompt's history. A caller that knows them passes ``prompt_keys`` (and
``policy_versions``) to ``batch_get`` (an extension of SGLang's signature), read when a request is
first seen; ``erase_match_state`` then adds its output to its key's history."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Sequence

import grpc
import numpy as np

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service.client.request_log import history_args, req_id, token_array
from corpus_service.client.sync import CorpusClient
from corpus_service.protocol import arrays
from corpus_service.protocol.status import from_rpc_error

log = logging.getLogger(__name__)


# SGLang's NgramCorpus constructor arguments: accepted so the worker's call works unchanged, unused
# (the server's namespace holds the corpus and its settings).
_SGLANG_ARGS = ("max_trie_depth", "min_bfs_breadth", "max_bfs_breadth", "capacity", "external_sam_budget",
                "external_corpus_max_tokens")


class RemoteNgramCorpus:
    def __init__(self, target: str, namespace: str = "default", *, draft_token_num: int = 8,
                 match_type: str | None = None, sglang_ordering: bool = False,
                 client_id: str | None = None, timeout: float = 2.0, **client_kwargs) -> None:
        if isinstance(draft_token_num, bool) or not isinstance(draft_token_num, int) or draft_token_num < 2:
            raise ValueError(f"draft_token_num: expected an int >= 2, got {draft_token_num!r}")
        if match_type is not None and str(match_type).upper() not in ("BFS", "PROB"):
            raise ValueError(f"match_type: expected 'BFS' or 'PROB', got {match_type!r}")
        if not isinstance(sglang_ordering, bool):
            raise ValueError(f"sglang_ordering: expected a bool, got {sglang_ordering!r}")
        if sglang_ordering:
            # The ordering is the namespace's on the server; a client-side switch would only pretend.
            raise ValueError(f"sglang_ordering: a remote corpus drafts in its namespace's mode; start the server "
                             f"with --namespace {namespace}:mode={str(match_type or 'BFS').lower()} instead")
        if match_type is not None:
            log.info("match_type=%r is accepted for SGLang compatibility; namespace '%s' drafts in the mode "
                     "its server gives it (score unless its spec sets mode=bfs or mode=prob)", match_type, namespace)
        for name in _SGLANG_ARGS:
            client_kwargs.pop(name, None)
        self.draft_token_num = draft_token_num
        self.client_id = client_id or uuid.uuid4().hex  # scopes this worker's request state on the server
        self._client = CorpusClient(target, namespace, timeout=timeout, **client_kwargs)
        self.namespace = namespace
        self._puts: list[grpc.Future] = []

    def batch_get(self, req_ids: Sequence[object], batch_tokens: Sequence[Sequence[int]],
                  total_lens: Sequence[int], *, prompt_keys: Sequence[str | None] | None = None,
                  policy_versions: Sequence[int | None] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """SGLang's ``batch_get``; ``prompt_keys``/``policy_versions`` (one per request or None)
        give new requests their prompt key and policy version (see the module's docstring)."""
        if not (len(req_ids) == len(batch_tokens) == len(total_lens)):
            raise ValueError(f"batch_get: req_ids, batch_tokens and total_lens must have one entry per request, got "
                             f"{len(req_ids)}, {len(batch_tokens)}, {len(total_lens)}")
        ids = [req_id(r) for r in req_ids]
        windows = [token_array(w, f"batch_tokens[{i}]") for i, w in enumerate(batch_tokens)]
        request = pb.BatchGetRequest(namespace=self.namespace, client_id=self.client_id,
                                     total_lens=arrays.pack(total_lens, arrays.I64), draft_token_num=self.draft_token_num)
        arrays.pack_runs(request.windows, ids, windows)
        if prompt_keys is not None or policy_versions is not None:
            keys = list(prompt_keys) if prompt_keys is not None else [None] * len(ids)
            versions = list(policy_versions) if policy_versions is not None else [None] * len(ids)
            if len(keys) != len(ids) or len(versions) != len(ids):
                raise ValueError(f"batch_get: expected one prompt key and policy version (or None) per request, "
                                 f"got {len(keys)} and {len(versions)} for {len(ids)}")
            pairs = [history_args(k, v) for k, v in zip(keys, versions)]
            request.prompt_keys.extend(k for k, _ in pairs)
            request.policy_versions.extend(v for _, v in pairs)
        resp = self._client.unary(self._client.stub.BatchGet, request, None)
        k, n = resp.draft_token_num, len(ids)
        drafts = arrays.unpack(resp.drafts, arrays.I32, "drafts", n * k).astype(np.int64)
        mask = arrays.unpack(resp.mask, arrays.U8, "mask", n * k * k).astype(np.int64)
        return drafts, mask

    def batch_put(self, batch_tokens: Sequence[Sequence[int]]) -> None:
        runs = [token_array(t, f"batch_tokens[{i}]") for i, t in enumerate(batch_tokens)]
        request = pb.BatchPutRequest(namespace=self.namespace, lengths=arrays.pack([r.size for r in runs]),
                                     tokens=b"".join(arrays.pack(r) for r in runs))
        self._client.breaker.check()
        self._puts = [f for f in self._puts if not f.done() or f.exception() is not None]
        self._puts.append(self._client.stub.BatchPut.future(request, timeout=self._client.timeout,
                                                              metadata=self._client.metadata or None))

    def synchronize(self) -> None:
        """Waits for this client's puts, then for the server to apply every queued insert. On a
        replica: until the commits it queued and the stream's messages are applied there (the next
        draft on that replica sees them; docs/reliability.md, "Replication")."""
        puts, self._puts = self._puts, []
        for f in puts:
            try:
                f.result()
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None
        self._client.unary(self._client.stub.BatchPut, pb.BatchPutRequest(namespace=self.namespace, synchronize=True), None)

    def reset(self) -> None:
        self._client.reset()

    def announce_policy_version(self, version: int) -> int:
        """The policy's weights changed (``CorpusClient.announce_policy_version``)."""
        return self._client.announce_policy_version(version)

    def erase_match_state(self, req_ids: Sequence[object]) -> None:
        request = pb.EraseMatchStateRequest(namespace=self.namespace, client_id=self.client_id,
                                            req_ids=[req_id(r) for r in req_ids])
        self._client.unary(self._client.stub.EraseMatchState, request, None)

    def load_external_corpus_named(self, corpus_id: str, chunks: Iterable[Sequence[int] | np.ndarray]) -> int:
        def messages():
            first = True
            for i, chunk in enumerate(chunks):
                tokens = arrays.pack(token_array(chunk, f"chunk {i}"))
                yield pb.ExternalChunk(namespace=self.namespace if first else "", name=corpus_id if first else "", tokens=tokens)
                first = False
            if first:  # no chunks: still create the (empty) staged corpus, as the engine does
                yield pb.ExternalChunk(namespace=self.namespace, name=corpus_id)

        self._client.breaker.check()
        try:
            resp = self._client.stub.LoadExternalCorpus(messages(), timeout=max(self._client.timeout, 600.0),
                                                        metadata=self._client.metadata or None)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return int(resp.loaded_tokens)

    def commit_external_corpus_load(self, corpus_id: str, loaded_token_count: int | None = None) -> None:
        request = pb.CommitExternalCorpusRequest(namespace=self.namespace, name=corpus_id,
                                                 expected_tokens=-1 if loaded_token_count is None else int(loaded_token_count))
        self._client.unary(self._client.stub.CommitExternalCorpus, request, None)

    def remove_external_corpus(self, corpus_id: str) -> None:
        request = pb.RemoveExternalCorpusRequest(namespace=self.namespace, name=corpus_id)
        self._client.unary(self._client.stub.RemoveExternalCorpus, request, None)

    def list_external_corpora(self) -> dict[str, int]:
        resp = self._client.unary(self._client.stub.ListExternalCorpora,
                                   pb.ListExternalCorporaRequest(namespace=self.namespace), None)
        return dict(resp.corpora)

    def describe_namespaces(self, timeout: float = 30.0) -> dict[str, dict]:
        """The namespaces this client may read (``CorpusClient.describe_namespaces``)."""
        return self._client.describe_namespaces(timeout=timeout)

    @property
    def target(self) -> str:
        return self._client.target

    def close(self) -> None:
        self._client.close()
