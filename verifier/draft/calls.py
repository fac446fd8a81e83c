"""The request operations a drafter hands to a remote source, in order: typed, so that the thread
client, the child process' client and a replay after a restart run the same three calls."""

from __future__ import annotations

from typing import NamedTuple


class StartRequest(NamedTuple):
    req_id: str
    prompt: list[int]
    group: str | None = None


class Extend(NamedTuple):
    """One step's committed tokens, one run per request (``CorpusClient.extend_many``)."""

    items: list[tuple[str, list[int]]]


class Finish(NamedTuple):
    req_id: str


Call = StartRequest | Extend | Finish
CALL_TYPES = (StartRequest, Extend, Finish)


def apply(client, call: Call):
    """Runs ``call`` on a ``CorpusClient`` (or an ``AsyncCorpusClient``: the awaitable is returned)."""
    if type(call) is StartRequest:
        return client.start_request(call.req_id, call.prompt, call.group)
    if type(call) is Extend:
        return client.extend_many(call.items)
    if type(call) is Finish:
        return client.finish(call.req_id)
    raise ValueError(f"unknown corpus call {type(call).__name__}: expected one of "
                     f"{', '.join(t.__name__ for t in CALL_TYPES)}")
