"""A stand-in llama-server for the fault tests: takes llama-server's command line, writes
its pid to $FAKE_LLAMA_PID, and behaves as $FAKE_LLAMA_MODE says:

- hang_loading: /health answers 503 (loading) for ever;
- hang: /health answers 200, a /completion is read and never answered, nothing logged;
- slow: a /completion is answered after 2.5 s, logging a line every 0.3 s meanwhile.
"""

import http.server
import json
import os
import sys
import time

MODE = os.environ["FAKE_LLAMA_MODE"]
ANSWER = {"tokens": [20], "stop_type": "limit", "tokens_evaluated": 3,
          "timings": {"predicted_n": 1}}


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503 if MODE == "hang_loading" else 200)
        self.end_headers()
        self.wfile.write(b"{}")

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if MODE == "hang":
            time.sleep(10**6)
        for _ in range(8):
            print("slot update_slots: prompt processing progress", flush=True)
            time.sleep(0.3)
        body = json.dumps(ANSWER).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    with open(os.environ["FAKE_LLAMA_PID"], "w") as f:
        f.write(str(os.getpid()))
    port = int(sys.argv[sys.argv.index("--port") + 1])
    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
