"""Client keepalive pings that the corpus server accepts: no "too_many_pings" GOAWAY on a connection
left idle for many keepalive intervals (the verifier's corpus client got one with gRPC's server
defaults). Real gRPC servers and channels on 127.0.0.1, the intervals scaled down to 200 ms through
the same option builders the client library and the server use."""

import time
from concurrent import futures

import grpc

from corpus_service.client.policy import CHANNEL_OPTIONS, KEEPALIVE_TIME_MS, keepalive_options
from corpus_service.server.grpc_server import keepalive_options as server_keepalive_options

INTERVAL_MS = 200
IDLE_S = 6.0  # 30 client pings (gRPC's default server policy hangs up after 3-5 s of them)


def peers_across_idleness(server_options: list, client_options: tuple) -> tuple[str, str]:
    """The client address the server sees on a call, then on a call after IDLE_S of idleness: the
    same address is the same connection (a GOAWAY makes the channel reconnect from a new port)."""
    peer = grpc.unary_unary_rpc_method_handler(lambda request, context: context.peer().encode())
    server = grpc.server(futures.ThreadPoolExecutor(2), options=server_options,
                         handlers=[grpc.method_handlers_generic_handler("keepalive.Test", {"Peer": peer})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=client_options)
    try:
        call = channel.unary_unary("/keepalive.Test/Peer")
        before = call(b"", timeout=10).decode()
        time.sleep(IDLE_S)
        return before, call(b"", timeout=10).decode()
    finally:
        channel.close()
        server.stop(0)


def scaled_client_options() -> tuple:
    """The client library's channel options with its keepalive at INTERVAL_MS."""
    keep = dict(keepalive_options(INTERVAL_MS, 5 * INTERVAL_MS))
    return tuple((k, v) for k, v in CHANNEL_OPTIONS if k not in keep) + tuple(keep.items())


def test_an_idle_connection_gets_no_goaway():
    before, after = peers_across_idleness(server_keepalive_options(INTERVAL_MS), scaled_client_options())
    assert before == after  # one connection throughout


def test_gRPC_server_defaults_would_hang_up():
    """The check can fail: the same client against a server with gRPC's default ping policy."""
    try:
        before, after = peers_across_idleness([], scaled_client_options())
    except grpc.RpcError as e:  # the GOAWAY raced the second call
        assert e.code() == grpc.StatusCode.UNAVAILABLE and "Too many pings" in e.details(), e
    else:
        assert before != after  # "too_many_pings": the server closed it, the channel reconnected


def test_the_real_settings_agree():
    client = dict(CHANNEL_OPTIONS)
    server = dict(server_keepalive_options())
    assert client["grpc.keepalive_time_ms"] == KEEPALIVE_TIME_MS
    # The server takes pings at least as often as the client sends them, with room for timer drift.
    assert server["grpc.http2.min_ping_interval_without_data_ms"] <= client["grpc.keepalive_time_ms"] // 2
    assert server["grpc.keepalive_permit_without_calls"] == client["grpc.keepalive_permit_without_calls"] == 1
    assert client["grpc.http2.max_pings_without_data"] == 0
