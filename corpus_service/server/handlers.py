"""Registers the Corpus servicer with request decoding that cannot fail inside gRPC.

The generated ``add_CorpusServicer_to_server`` decodes with ``FromString``: a malformed message
(corrupt wire format, invalid UTF-8 in a string field) then raises inside gRPC itself, which
answers UNKNOWN or INTERNAL and logs a traceback per message, so a hostile client could flood the
log. Here a message that does not decode becomes a ``Malformed`` value that the handlers answer
with INVALID_ARGUMENT (see ``grpc_server.py``), like every other bad input.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Corpus"]
_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


@dataclass(frozen=True, slots=True)
class Malformed:
    """A request that did not decode as ``message``."""

    message: str
    error: str

    def describe(self) -> str:
        return f"malformed {self.message} message: {self.error}"


def _decoder(cls):
    def decode(data: bytes):
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as e:  # RuntimeError: the upb backend's recursion limit
            return Malformed(cls.DESCRIPTOR.name, str(e)[:200])

    return decode


def add_corpus_servicer(servicer, server) -> None:
    handlers = {}
    for method in SERVICE.methods:
        req = getattr(pb, method.input_type.name)
        resp = getattr(pb, method.output_type.name)
        factory = _FACTORIES[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(getattr(servicer, method.name), request_deserializer=_decoder(req),
                                        response_serializer=resp.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
