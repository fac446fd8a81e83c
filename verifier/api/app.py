"""Routes: /v1/completions, /v1/chat/completions (JSON or SSE), /v1/models, /v1/policy-version (RL
loops: the policy's weights changed), /v1/update-weights (new weights in place), /metrics, /healthz.

Bad requests answer 400 with ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape),
whatever FastAPI or the engine rejected them for. Request bodies are JSON whatever their
Content-Type (``body.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Annotated

from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect

from ..engine.request import Request as GenRequest
from ..engine.runner import EngineLoop, Update
from ..step.sampling import SamplingParams
from . import choices
from .admin import AdminAccess
from .body import ApiError, parse_body
from .lifecycle import Lifecycle, LifecycleConfig
from .metrics import ApiMetrics
from .policy_version import PolicyAnnouncer, PolicyVersionRequest
from .schemas import ChatCompletionRequest, CompletionRequest
from .weights import UpdateWeightsRequest, WeightUpdater

DEFAULT_MAX_TOKENS = 256
MAX_ERROR_CHARS = 1000  # of an error's message (and param): see _error


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    # An error names what was wrong, it does not echo it back: a message built from a caller's
    # value (a stop list, a nested field's path) is cut to MAX_ERROR_CHARS.
    message, param = _cut(message), None if param is None else _cut(param)
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def _cut(text: str) -> str:
    if len(text) <= MAX_ERROR_CHARS:
        return text
    return f"{text[:MAX_ERROR_CHARS]}... ({len(text):,} characters in all)"


class _TextStream:
    """Text deltas from a growing token list: holds back an incomplete UTF-8 character and any
    tail that could still become a stop string."""

    def __init__(self, decode, stop: tuple[str, ...]) -> None:
        self.decode, self.sent = decode, 0
        self.hold = max((len(s) - 1 for s in stop), default=0)

    def delta(self, upd: Update) -> str:
        text = upd.text if upd.finished else self.decode(upd.output_ids)
        end = len(text) if upd.finished else max(self.sent, len(text.rstrip("\ufffd")) - self.hold)
        out, self.sent = text[self.sent:end], max(self.sent, end)
        return out


def create_app(loop: EngineLoop, model_name: str, api_key: str = "", announcer: PolicyAnnouncer | None = None,
               weights: WeightUpdater | None = None, admin: AdminAccess | None = None,
               lifecycle: LifecycleConfig | None = None) -> FastAPI:
    """``announcer``: how ``POST /v1/policy-version`` reaches the corpus (default: this engine's
    drafter, its corpus service's default namespace and no token); ``weights``: ``POST
    /v1/update-weights`` (default: refused, 403); ``admin``: who may call those two (admin.py;
    default: nobody); ``lifecycle``: the waiting queue's bounds and the shutdown's deadline
    (lifecycle.py; app.state.lifecycle is the gate a DrainingServer drains)."""
    admin = admin or AdminAccess()
    app = FastAPI(title="ngram-verifier", version="0.1.0")
    announcer = announcer or PolicyAnnouncer(loop.engine.drafter)
    weights = weights or WeightUpdater(loop, "", announcer, enabled=False)
    engine = loop.engine
    codec = engine.codec
    metrics = ApiMetrics(engine)
    life = app.state.lifecycle = Lifecycle(loop, lifecycle or LifecycleConfig(), metrics.registry)
    created = int(time.time())
    token_str = choices.TokenStrings(codec.decode)

    async def check_key(authorization: Annotated[str | None, Header()] = None) -> None:
        if api_key and authorization != f"Bearer {api_key}":
            raise HTTPException(401, "missing or wrong API key (Authorization: Bearer <key>)")

    auth = [Depends(check_key)]

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        metrics.requests.labels(request.url.path, "400").inc()
        return _error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", where or None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return _error(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect):
        """The client left while its body was read (sent and dropped): nothing was queued."""
        life.abandoned.labels(request.url.path).inc()
        return Response(status_code=499)  # (nobody reads it)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.get("/healthz")
    async def healthz():
        """200 while the engine runs; ``corpus`` says where drafts come from and, for a corpus
        service, whether it is reachable, its outages and its namespace check (an unreachable
        corpus is no 503: the verifier serves, drafting in process); ``native_linear``: whether the
        engine's projections run ``kernels.norm_linear`` (``--native-linear``; with ``auto``,
        ``linear_probe_ms`` holds the start-up probe's two decode-step times it chose by)."""
        alive = loop.alive
        d = engine.drafter
        corpus = {"target": "none"} if d is None else d.health.snapshot() if d.health is not None else {"target": "local"}
        status = "draining" if life.draining else "ok" if alive else "engine stopped"
        return JSONResponse({"status": status, "corpus": corpus, "weights": weights.state(),
                             "native_linear": engine.native_linear, "linear_probe_ms": engine.linear_probe},
                            status_code=200 if alive and not life.draining else 503)

    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                             "owned_by": "ngram-verifier", "max_model_len": engine.config.max_len}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/policy-version")
    async def policy_version(request: Request, authorization: Annotated[str | None, Header()] = None):
        """The policy's weights changed (verifier/api/policy_version.py); admin key only (admin.py)."""
        admin.require("/v1/policy-version", admin.policy_version, "--allow-policy-version", authorization)
        body = await parse_body(request, PolicyVersionRequest)
        out = await asyncio.to_thread(announcer.announce, body.version)
        metrics.requests.labels("/v1/policy-version", "200").inc()
        return out

    @app.post("/v1/update-weights")
    async def update_weights(request: Request, authorization: Annotated[str | None, Header()] = None):
        """New weights in place (verifier/api/weights.py); requests wait while they go in; admin key
        only (admin.py)."""
        admin.require("/v1/update-weights", weights.enabled, "--allow-weight-updates", authorization)
        body = await parse_body(request, UpdateWeightsRequest)
        out = await weights.update(body)
        metrics.requests.labels("/v1/update-weights", "200").inc()
        return out

    async def _left(request: Request, route: str) -> Response | None:
        """A 499 (which nobody reads) if the client has left already: a flood of requests sent and
        dropped costs no parsing, tokenizing or queueing (lifecycle.py)."""
        await request.body()  # (read once: parse_body takes the same bytes)
        if not await life.left(request):
            return None
        life.abandoned.labels(route).inc()
        metrics.requests.labels(route, "499").inc()
        return Response(status_code=499)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        if (gone := await _left(request, "/v1/completions")) is not None:
            return gone
        body = await parse_body(request, CompletionRequest)
        if isinstance(body.prompt, str):
            prompt_ids = codec.encode(body.prompt)
        else:
            prompt_ids = list(body.prompt)
        return await _run(request, "/v1/completions", "text_completion", body, prompt_ids)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(request: Request):
        if (gone := await _left(request, "/v1/chat/completions")) is not None:
            return gone
        body = await parse_body(request, ChatCompletionRequest)
        try:
            text = codec.apply_chat_template([m.for_template() for m in body.messages])
        except Exception as e:  # a template that fails on these messages is the request's problem
            return _error(400, f"messages: the chat template failed: {e}", "messages")
        return await _run(request, "/v1/chat/completions", "chat.completion", body, codec.encode(text))

    async def _run(request: Request, route: str, kind: str, body, prompt_ids: list[int]):
        if body.model is not None and body.model != model_name:
            metrics.requests.labels(route, "404").inc()
            return _error(404, f"model '{body.model}' is not served here (serving '{model_name}')", "model", "model_not_found")
        subs: list[tuple[GenRequest, asyncio.Queue]] = []
        rid = f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        room = engine.config.max_len - len(prompt_ids) - 1  # tokens of output the model length leaves
        if room < 1:
            where = "messages" if kind.startswith("chat") else "prompt"
            metrics.requests.labels(route, "400").inc()
            return _error(400, f"{where}: {len(prompt_ids)} prompt tokens fill the model length of this server "
                          f"({engine.config.max_len - 1} tokens): no room for any output; shorten the prompt", where)
        vocab = engine.model.config.vocab_size
        if bad := [t for t in body.stop_token_ids or () if t >= vocab]:
            metrics.requests.labels(route, "400").inc()
            return _error(400, f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {vocab})", "stop_token_ids")
        if weights.updating:  # held until the new weights are in (and the running requests drained)
            await weights.admit()
        if (gone := await _left(request, route)) is not None:  # (it may have left while its prompt was read)
            return gone
        try:
            params: SamplingParams = body.sampling(min(DEFAULT_MAX_TOKENS, room))
            k = body.samples()
            if k > body.n and params.logprobs is None:  # best_of ranks by cumulative logprob
                params = dataclasses.replace(params, logprobs=0)
            # The samples share the prompt: one corpus request group, so each drafts from the others.
            # An explicit prompt_key groups every live request of the key in the corpus namespace
            # (this request's samples and their siblings on other replicas): no group of its own then.
            group = rid if k > 1 and body.prompt_key is None else None
            if (refused := life.refusal(route, k, len(prompt_ids) + params.max_tokens)) is not None:
                metrics.requests.labels(route, str(refused.status_code)).inc()
                return refused
            for i in range(k):  # sample i: seed + i, so n samples are n different draws
                p = params if params.seed is None or i == 0 else dataclasses.replace(params, seed=(params.seed + i) % 2**63)
                subs.append(loop.submit(prompt_ids, p, group=group, prompt_key=body.prompt_key,
                                        policy_version=body.policy_version, progress=bool(body.stream)))
        except ValueError as e:
            for req, _ in subs:
                loop.abort(req.req_id)
            metrics.requests.labels(route, "400").inc()
            return _error(400, str(e))
        t0 = time.monotonic()
        if body.stream:
            metrics.requests.labels(route, "200").inc()
            return StreamingResponse(_sse(route, kind, rid, body, subs, t0), media_type="text/event-stream")
        try:
            if not await life.answered(request, [queue for _, queue in subs]):
                life.abandon(route, [req.req_id for req, _ in subs])  # the client left: nobody waits for it
                metrics.requests.labels(route, "499").inc()
                return Response(status_code=499)  # (nobody reads it)
        except asyncio.CancelledError:  # (uvicorn cancels handlers past its graceful-shutdown timeout)
            for req, _ in subs:
                loop.abort(req.req_id)
            raise
        metrics.latency.labels(route).observe(time.monotonic() - t0)
        reqs = [req for req, _ in subs]
        if (msg := choices.failed_internally(reqs)) is not None:
            metrics.requests.labels(route, "500").inc()
            return _error(500, msg)
        metrics.requests.labels(route, "200").inc()
        want_lp = body.top_logprob_count() is not None
        out = []
        for i, req in enumerate(choices.best_of(reqs, body.n)):
            choice = {"index": i, "finish_reason": req.finish_reason, "logprobs": None}
            if want_lp:
                choice["logprobs"] = (choices.chat_logprobs if kind == "chat.completion" else choices.completion_logprobs)(
                    req.logprobs, token_str)
            if kind == "chat.completion":
                choice["message"] = {"role": "assistant", "content": req.text}
            else:
                choice["text"] = req.text
            if req.finish_reason == "error":
                choice["error"] = {"message": req.error}
            out.append(choice)
        return {"id": rid, "object": kind, "created": int(time.time()), "model": model_name,
                "choices": out, "usage": choices.usage(reqs)}

    async def _sse(route, kind, rid, body, subs: list[tuple[GenRequest, asyncio.Queue]], t0: float):
        chat = kind == "chat.completion"
        obj = "chat.completion.chunk" if chat else "text_completion"
        want_lp = body.top_logprob_count() is not None
        reqs = [req for req, _ in subs]
        streams = [_TextStream(codec.decode, req.params.stop) for req in reqs]
        sent_lp = [0] * len(reqs)  # logprobs entries sent per choice
        text_sent = [0] * len(reqs)  # characters sent per choice (completions' text_offset)

        def chunk(i: int, delta: str | None, finish: str | None, role: bool = False, lps=None) -> str:
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                choice = {"index": i, "delta": d, "finish_reason": finish,
                          "logprobs": choices.chat_logprobs(lps, token_str) if lps else None}
            else:
                choice = {"index": i, "text": delta or "", "finish_reason": finish,
                          "logprobs": choices.completion_logprobs(lps, token_str, text_sent[i]) if lps else None}
            if finish == "error":
                choice["error"] = {"message": reqs[i].error}
            return "data: " + json.dumps({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                                          "choices": [choice]}) + "\n\n"

        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, queue: asyncio.Queue) -> None:
            while True:
                upd = await queue.get()
                merged.put_nowait((i, upd))
                if upd.finished:
                    return

        pumps = [asyncio.create_task(pump(i, q)) for i, (_, q) in enumerate(subs)]
        try:
            if chat:
                for i in range(len(reqs)):
                    yield chunk(i, None, None, role=True)
            live = len(reqs)
            while live:
                i, upd = await merged.get()
                text = streams[i].delta(upd)
                lps = None
                if want_lp:  # the entries of the tokens this update committed
                    lps = reqs[i].logprobs[sent_lp[i]:len(upd.output_ids)]
                    sent_lp[i] += len(lps)
                if text or lps:
                    yield chunk(i, text, None, lps=lps)
                    text_sent[i] += len(text)
                if upd.finished:
                    live -= 1
                    yield chunk(i, None if chat else "", upd.finish_reason)
            if body.include_usage:
                yield "data: " + json.dumps({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                                             "choices": [], "usage": choices.usage(reqs)}) + "\n\n"
            yield "data: [DONE]\n\n"
            metrics.latency.labels(route).observe(time.monotonic() - t0)
        finally:
            for t in pumps:
                t.cancel()
            for req in reqs:
                if not req.finished:  # the client went away
                    loop.abort(req.req_id)

    return app
