"""The JetStream stream that holds the commit log: created with the configured retention, updated
to it when it exists with other limits, and identified per incarnation.

A stream that is deleted (or lost with the broker's storage) and created again numbers its
messages from 1 again, so a position means nothing without the stream it belongs to. Its
*incarnation* is the broker's creation time of the stream. The replica that recreates a lost
stream names in the stream's description the snapshot every replica starts the new incarnation
from (its *base*), so all replicas, and any started later, reach the same state:

    description  {"ngram-corpus": 1, "base": "snapshots/<dir>"}   (base: null = start empty)
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import nats.js.errors
from nats.js import api

from corpus_service.server.config import ServiceConfig

log = logging.getLogger("corpus_service.replication")
DEDUP_WINDOW_S = 120.0  # a batch re-sent under the same Nats-Msg-Id within this is stored once


@dataclass(frozen=True, slots=True)
class StreamView:
    incarnation: str  # the broker's creation time of the stream
    first: int  # oldest message held (retention drops older ones)
    last: int  # newest message (0: empty)
    base: str | None  # snapshot directory the incarnation starts from (None: empty)


def _view(info) -> StreamView:
    base = None
    try:
        desc = json.loads(info.config.description or "{}")
        if isinstance(desc, dict) and isinstance(desc.get("base"), str):
            base = desc["base"]
    except ValueError:
        pass  # a stream an operator described by hand: no base
    return StreamView(str(info.created), int(info.state.first_seq), int(info.state.last_seq), base)


class CommitStream:
    def __init__(self, config: ServiceConfig, subject: str) -> None:
        self.name, self.subject = config.log_stream, subject
        self.max_msgs = config.log_max_msgs or -1
        self.max_bytes = config.log_max_bytes or -1
        self.max_age = float(config.log_max_age_s)  # 0 = no age limit
        # Servers holding the stream: the configured count (log_replicas), else as last seen (an
        # operator may have raised it by hand): a stream recreated after a loss keeps it.
        self.wanted_replicas = int(config.log_replicas)
        self.num_replicas = self.wanted_replicas or 1

    def _limits(self, cfg: api.StreamConfig) -> api.StreamConfig:
        cfg.max_msgs, cfg.max_bytes, cfg.max_age = self.max_msgs, self.max_bytes, self.max_age
        # JetStream refuses a duplicate window longer than the age limit.
        cfg.duplicate_window = min(DEDUP_WINDOW_S, self.max_age) if self.max_age else DEDUP_WINDOW_S
        cfg.discard = api.DiscardPolicy.OLD  # retention never refuses a publish
        return cfg

    async def view(self, js) -> StreamView | None:
        """The stream as it is now; None when the broker answers that it does not exist. Other
        errors (broker down, timeouts) propagate: they say nothing about the stream."""
        try:
            return _view(await js.stream_info(self.name))
        except nats.js.errors.NotFoundError:
            return None

    async def create(self, js, base: str | None) -> StreamView:
        """Creates the stream with ``base`` in its description; if another replica created it first
        (with its own base), returns that one."""
        cfg = self._limits(api.StreamConfig(name=self.name, subjects=[self.subject], storage=api.StorageType.FILE,
                                            description=json.dumps({"ngram-corpus": 1, "base": base}),
                                            num_replicas=self.num_replicas))
        try:
            info = await js.add_stream(cfg)
            log.info("commit log stream %s created (base snapshot: %s; retention: max_msgs=%d max_bytes=%d "
                     "max_age_s=%g)", self.name, base or "none, empty", self.max_msgs, self.max_bytes, self.max_age)
            return _view(info)
        except nats.js.errors.BadRequestError as e:
            if e.err_code != 10058:  # 10058: the name is in use with another configuration
                raise
        view = await self.view(js)
        if view is None:
            raise RuntimeError(f"stream {self.name}: creation raced with a deletion; retrying")
        return view

    async def ensure(self, js) -> StreamView:
        """The stream, created (empty, no base) if missing, with this replica's retention applied:
        limits changed since it was created take effect at the next start of any replica."""
        try:
            info = await js.stream_info(self.name)
        except nats.js.errors.NotFoundError:
            return await self.create(js, None)
        cfg = info.config
        have_replicas = cfg.num_replicas or 1
        self.num_replicas = self.wanted_replicas or have_replicas
        have = (cfg.max_msgs, cfg.max_bytes, float(cfg.max_age or 0))
        if have != (self.max_msgs, self.max_bytes, self.max_age) or have_replicas != self.num_replicas:
            cfg.num_replicas = self.num_replicas
            info = await js.update_stream(self._limits(cfg))
            log.warning("commit log stream %s: retention changed from max_msgs=%d max_bytes=%d max_age_s=%g "
                        "replicas=%d to max_msgs=%d max_bytes=%d max_age_s=%g replicas=%d", self.name, *have,
                        have_replicas, self.max_msgs, self.max_bytes, self.max_age, self.num_replicas)
        return _view(info)
