"""A server on 127.0.0.1 that answers /v1/models as vLLM does and misbehaves on completions.

Raw sockets, not http.server: the faults live below HTTP (an answer that is not HTTP, a body
cut short, a connection closed or held silent), where a well-behaved server library cannot go.
"""

import json
import socket
import threading

FAULTS = ("not_http", "cut_short", "close", "silent", "other_model")
"""not_http: a line of text instead of a status line. cut_short: a Content-Length the body
never reaches. close: the connection closed without a byte. silent: the request read, then
nothing until the server is closed. other_model: a fluent greedy-looking completion of tokens
the target would not choose (every answer the same rotation of ordinary word ids)."""

OTHER_MODEL_IDS = list(range(10, 40))
"""Ordinary word ids of the tiny tokenizer (past its 5 specials): never its eos."""


class FaultyServer:
    def __init__(self, served_id: str, fault: str):
        assert fault in FAULTS, fault
        self.served_id, self.fault = served_id, fault
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)  # the accept loop checks `closed` this often
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.closed = threading.Event()
        self.completions = 0
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.closed.set()
        self._thread.join(timeout=10)
        for conn in self._held:
            conn.close()
        self.listener.close()

    def __enter__(self) -> "FaultyServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _serve(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        method, body = _read_request(conn)
        if method == "GET":
            _send_json(conn, {"object": "list", "data": [
                {"id": self.served_id, "object": "model", "root": self.served_id}]})
            conn.close()
            return
        self.completions += 1
        if self.fault == "silent":
            self._held.append(conn)  # closed only by close(): the client must time out
            return
        if self.fault == "not_http":
            conn.sendall(b"this is not an HTTP server\r\n\r\n")
        elif self.fault == "cut_short":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 500\r\n\r\n{\"choices\": [")
        elif self.fault == "other_model":
            n = json.loads(body)["max_tokens"]
            ids = [OTHER_MODEL_IDS[i % len(OTHER_MODEL_IDS)] for i in range(n)]
            _send_json(conn, {"choices": [{"index": 0, "text": "", "token_ids": ids,
                                           "finish_reason": "length"}]})
        conn.close()


def _read_request(conn: socket.socket) -> tuple[str, bytes]:
    """(method, body) of one HTTP/1.1 request with a Content-Length (or none)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return "", b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next((int(v) for k, _, v in (line.partition(":") for line in lines[1:])
                   if k.strip().lower() == "content-length"), 0)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return lines[0].split(" ")[0], body


def _send_json(conn: socket.socket, reply: dict) -> None:
    data = json.dumps(reply).encode()
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(data)).encode() + b"\r\nConnection: close\r\n\r\n" + data)
