"""The request operations a drafter hands to a remote source, in order: typed, so that the thread
client, the child process' client and a replay after a restart run the same three calls."""

from __future__ import annotations

from typing import NamedTuple


class StartRequest(NamedTuple):
    """``prompt_key``/``policy_version``: the prompt history's key and the policy sampling the
    request (``NgramCorpus.start_request``); sent to the corpus only where set."""

    req_id: str
    prompt: list[int]
    group: str | None = None
    prompt_key: str | None = None
    policy_version: int | None = None


class Extend(NamedTuple):
    """One step's committed tokens, one run per request (``CorpusClient.extend_many``)."""

    items: list[tuple[str, list[int]]]


class Finish(NamedTuple):
    """``rollout=False``: the request did not finish (aborted, failed); its cut output stays out of
    its prompt key's history."""

    req_id: str
    rollout: bool = True


Call = StartRequest | Extend | Finish
CALL_TYPES = (StartRequest, Extend, Finish)


def apply(client, call: Call):
    """Runs ``call`` on a ``CorpusClient`` (or an ``AsyncCorpusClient``: the awaitable is returned)."""
    if type(call) is StartRequest:
        history = {k: v for k, v in (("prompt_key", call.prompt_key), ("policy_version", call.policy_version))
                   if v is not None}
        return client.start_request(call.req_id, call.prompt, call.group, **history)
    if type(call) is Extend:
        return client.extend_many(call.items)
    if type(call) is Finish:
        return client.finish(call.req_id, rollout=call.rollout)
    raise ValueError(f"unknown corpus call {type(call).__name__}: expected one of "
                     f"{', '.join(t.__name__ for t in CALL_TYPES)}")
