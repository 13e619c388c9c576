"""Local daemons (``waltz.local.daemons``) as ``waltz dev`` and the tests start them."""

import http.server
import os
import socket
import threading

import pytest

from waltz.local.daemons import DaemonError, local_storage

pytestmark = pytest.mark.timeout(30)


class _Ping(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"pong")

    def log_message(self, *args):
        pass


def test_a_daemon_whose_http_port_another_process_answers_is_not_started(tmp_path):
    # `waltz dev up` started it, it died at once (its ports taken), the other process answered its /ping, and
    # up reported it started, with a dead pid recorded.
    other = http.server.HTTPServer(("127.0.0.1", 0), _Ping)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        daemon = local_storage(str(tmp_path / "storage"), "127.0.0.1:1", "/w",
                               **{"storage.http.port": other.server_address[1]})
        with pytest.raises(DaemonError, match="http port %d already answers /ping: another process serves it"
                           % other.server_address[1]):
            daemon.start()
        assert daemon.process is None and not os.path.exists(daemon.pid_path)
    finally:
        other.shutdown()
        other.server_close()


def test_a_port_answered_by_something_other_than_http_is_no_answer_to_ping(tmp_path):
    # A Waltz port on the daemon's HTTP port (two local daemons given the same port) answered with its Hello:
    # ping raised http.client.BadStatusLine, and the run stopped with "BadStatusLine: H..." instead of the
    # daemon's own reason ("Address already in use").
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def answer_with_a_hello():
        connection, _ = listener.accept()
        connection.recv(1024)
        connection.sendall(b"H\x00\x00\x00\x00\x00\x17\x00\x00\x00\x01\x00\x00")
        connection.close()
    threading.Thread(target=answer_with_a_hello, daemon=True).start()
    try:
        daemon = local_storage(str(tmp_path / "storage"), "127.0.0.1:1", "/w",
                               **{"storage.http.port": listener.getsockname()[1]})
        assert daemon.ping() is False
    finally:
        listener.close()
