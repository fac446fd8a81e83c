from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenRuns(_message.Message):
    __slots__ = ("req_ids", "lengths", "tokens", "groups", "prompt_keys", "policy_versions")
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_KEYS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    lengths: bytes
    tokens: bytes
    groups: _containers.RepeatedScalarFieldContainer[str]
    prompt_keys: _containers.RepeatedScalarFieldContainer[str]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., lengths: _Optional[bytes] = ..., tokens: _Optional[bytes] = ..., groups: _Optional[_Iterable[str]] = ..., prompt_keys: _Optional[_Iterable[str]] = ..., policy_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("req_ids", "budget")
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    budget: int
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., budget: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("seq", "namespace", "start", "extend", "finish", "draft", "restore", "abandon")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    EXTEND_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    ABANDON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    namespace: str
    start: TokenRuns
    extend: TokenRuns
    finish: _containers.RepeatedScalarFieldContainer[str]
    draft: DraftRequest
    restore: TokenRuns
    abandon: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq: _Optional[int] = ..., namespace: _Optional[str] = ..., start: _Optional[_Union[TokenRuns, _Mapping]] = ..., extend: _Optional[_Union[TokenRuns, _Mapping]] = ..., finish: _Optional[_Iterable[str]] = ..., draft: _Optional[_Union[DraftRequest, _Mapping]] = ..., restore: _Optional[_Union[TokenRuns, _Mapping]] = ..., abandon: _Optional[_Iterable[str]] = ...) -> None: ...

class DraftTrees(_message.Message):
    __slots__ = ("budget", "counts", "tokens", "parents", "probs")
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    budget: int
    counts: bytes
    tokens: bytes
    parents: bytes
    probs: bytes
    def __init__(self, budget: _Optional[int] = ..., counts: _Optional[bytes] = ..., tokens: _Optional[bytes] = ..., parents: _Optional[bytes] = ..., probs: _Optional[bytes] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message", "draft_only")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ONLY_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    draft_only: bool
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., draft_only: _Optional[bool] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("seq", "drafts", "error")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    seq: int
    drafts: DraftTrees
    error: Error
    def __init__(self, seq: _Optional[int] = ..., drafts: _Optional[_Union[DraftTrees, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class BatchGetRequest(_message.Message):
    __slots__ = ("namespace", "client_id", "windows", "total_lens", "draft_token_num", "prompt_keys", "policy_versions")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_NUM_FIELD_NUMBER: _ClassVar[int]
    PROMPT_KEYS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    client_id: str
    windows: TokenRuns
    total_lens: bytes
    draft_token_num: int
    prompt_keys: _containers.RepeatedScalarFieldContainer[str]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., client_id: _Optional[str] = ..., windows: _Optional[_Union[TokenRuns, _Mapping]] = ..., total_lens: _Optional[bytes] = ..., draft_token_num: _Optional[int] = ..., prompt_keys: _Optional[_Iterable[str]] = ..., policy_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchGetResponse(_message.Message):
    __slots__ = ("draft_token_num", "drafts", "mask")
    DRAFT_TOKEN_NUM_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    draft_token_num: int
    drafts: bytes
    mask: bytes
    def __init__(self, draft_token_num: _Optional[int] = ..., drafts: _Optional[bytes] = ..., mask: _Optional[bytes] = ...) -> None: ...

class BatchPutRequest(_message.Message):
    __slots__ = ("namespace", "lengths", "tokens", "synchronize")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SYNCHRONIZE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    lengths: bytes
    tokens: bytes
    synchronize: bool
    def __init__(self, namespace: _Optional[str] = ..., lengths: _Optional[bytes] = ..., tokens: _Optional[bytes] = ..., synchronize: _Optional[bool] = ...) -> None: ...

class BatchPutResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    def __init__(self, tokens: _Optional[int] = ...) -> None: ...

class EraseMatchStateRequest(_message.Message):
    __slots__ = ("namespace", "client_id", "req_ids")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    client_id: str
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[str] = ..., client_id: _Optional[str] = ..., req_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EraseMatchStateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExternalChunk(_message.Message):
    __slots__ = ("namespace", "name", "tokens")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    tokens: bytes
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ..., tokens: _Optional[bytes] = ...) -> None: ...

class LoadExternalCorpusResponse(_message.Message):
    __slots__ = ("loaded_tokens",)
    LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    loaded_tokens: int
    def __init__(self, loaded_tokens: _Optional[int] = ...) -> None: ...

class CommitExternalCorpusRequest(_message.Message):
    __slots__ = ("namespace", "name", "expected_tokens")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    expected_tokens: int
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ..., expected_tokens: _Optional[int] = ...) -> None: ...

class CommitExternalCorpusResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    def __init__(self, tokens: _Optional[int] = ...) -> None: ...

class RemoveExternalCorpusRequest(_message.Message):
    __slots__ = ("namespace", "name")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class RemoveExternalCorpusResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListExternalCorporaRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class ListExternalCorporaResponse(_message.Message):
    __slots__ = ("corpora",)
    class CorporaEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CORPORA_FIELD_NUMBER: _ClassVar[int]
    corpora: _containers.ScalarMap[str, int]
    def __init__(self, corpora: _Optional[_Mapping[str, int]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("namespace", "describe")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    DESCRIBE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    describe: bool
    def __init__(self, namespace: _Optional[str] = ..., describe: _Optional[bool] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("values", "external_corpora", "sessions", "vocab_size", "tokenizer", "tokenizer_probe", "counters", "tokenizer_error")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ExternalCorporaEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_CORPORA_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_PROBE_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ERROR_FIELD_NUMBER: _ClassVar[int]
    values: _containers.ScalarMap[str, float]
    external_corpora: _containers.ScalarMap[str, int]
    sessions: int
    vocab_size: int
    tokenizer: str
    tokenizer_probe: _containers.RepeatedScalarFieldContainer[int]
    counters: _containers.ScalarMap[str, int]
    tokenizer_error: str
    def __init__(self, values: _Optional[_Mapping[str, float]] = ..., external_corpora: _Optional[_Mapping[str, int]] = ..., sessions: _Optional[int] = ..., vocab_size: _Optional[int] = ..., tokenizer: _Optional[str] = ..., tokenizer_probe: _Optional[_Iterable[int]] = ..., counters: _Optional[_Mapping[str, int]] = ..., tokenizer_error: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("namespaces",)
    class NamespacesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: NamespaceStats
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[NamespaceStats, _Mapping]] = ...) -> None: ...
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.MessageMap[str, NamespaceStats]
    def __init__(self, namespaces: _Optional[_Mapping[str, NamespaceStats]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AnnouncePolicyVersionRequest(_message.Message):
    __slots__ = ("namespace", "version")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    version: int
    def __init__(self, namespace: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class AnnouncePolicyVersionResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...
