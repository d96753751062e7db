"""`peers.wait_until_gone`: how a finished BSP worker waits for its chief, on real sockets."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from syncswitch.peers import host_port, wait_until_gone


def listener() -> tuple[socket.socket, str]:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    return server, f"127.0.0.1:{server.getsockname()[1]}"


def test_nothing_listening_is_gone_at_once() -> None:
    server, address = listener()
    server.close()
    assert wait_until_gone(address, timeout=30) is True


def test_a_listener_that_stays_is_waited_for_until_the_timeout() -> None:
    server, address = listener()
    with server:
        assert wait_until_gone(address, timeout=0.5) is False


def test_it_returns_once_the_listener_and_its_connections_close_and_not_before() -> None:
    """Like a chief's TF server: it greets, drops an idle connection now and then (gRPC's handshake
    timeout) while it still listens, and everything closes when its process exits."""
    server, address = listener()
    closed_at: list[float] = []

    def serve() -> None:
        conn, _ = server.accept()
        conn.sendall(b"greeting")
        time.sleep(0.2)
        conn.close()  # dropped while the server still listens: the waiter must look again
        conn, _ = server.accept()
        time.sleep(0.3)
        closed_at.append(time.monotonic())
        server.close()
        conn.close()

    thread = threading.Thread(target=serve)
    thread.start()
    assert wait_until_gone(address, timeout=60) is True
    returned_at = time.monotonic()
    thread.join()
    assert closed_at and returned_at >= closed_at[0]


def test_a_server_that_keeps_talking_does_not_stretch_the_timeout() -> None:
    server, address = listener()
    stop = threading.Event()

    def chatter() -> None:
        conn, _ = server.accept()
        with conn, contextlib.suppress(OSError):  # the waiter may close first
            while not stop.wait(0.05):
                conn.sendall(b".")

    thread = threading.Thread(target=chatter)
    thread.start()
    try:
        assert wait_until_gone(address, timeout=0.3) is False
    finally:
        stop.set()
        thread.join()
        server.close()


def test_addresses_as_tf_config_writes_them() -> None:
    assert host_port("10.0.0.2:2222") == ("10.0.0.2", 2222)
    assert host_port("node-1:2222") == ("node-1", 2222)
    assert host_port("[::1]:2222") == ("::1", 2222)
