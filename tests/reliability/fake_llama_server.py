"""A stand-in llama-server for the fault tests: takes llama-server's command line, writes
its pid to $FAKE_LLAMA_PID, and behaves as $FAKE_LLAMA_MODE says:

- hang_loading: /health answers 503 (loading) for ever;
- hang: /health answers 200, a /completion is read and never answered, nothing logged;
- slow: a /completion is answered after 2.5 s, logging a line every 0.3 s meanwhile;
- serve: a /completion of n_predict N generates the tokens 20 .. 20 + N - 1 ("limit"). With a
  drafter (-md), each verify step accepts 1 of its drafts (commits 2 tokens) and takes
  30 ms of decode time, logged as llama-server logs it (LLAMA_TRACE), and /metrics counts
  the steps; without one, each token takes 10 ms. $FAKE_LLAMA_ORDER (if set) gets a line
  per request: "drafter" or "plain".
"""

import http.server
import json
import math
import os
import sys
import time

MODE = os.environ["FAKE_LLAMA_MODE"]
ANSWER = {"tokens": [20], "stop_type": "limit", "tokens_evaluated": 3,
          "timings": {"predicted_n": 1}}


def _health(handler) -> None:
    handler.send_response(503 if MODE == "hang_loading" else 200)
    handler.end_headers()
    handler.wfile.write(b"{}")


class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if MODE == "serve":
            return self._send(_completion(body))
        if MODE == "hang":
            time.sleep(10**6)
        for _ in range(8):
            print("slot update_slots: prompt processing progress", flush=True)
            time.sleep(0.3)
        self._send(ANSWER)

    def _send(self, answer) -> None:
        body = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if MODE != "serve" or self.path != "/metrics":
            return _health(self)
        self._send(_metrics())

    def log_message(self, *args):
        pass


DRAFTS = (int(sys.argv[sys.argv.index("--spec-draft-n-max") + 1])
          if "-md" in sys.argv else None)
STEPS: list[int] = []
"""Accepted drafts of every verify step so far (for /metrics)."""


def _completion(body: dict) -> dict:
    n = body["n_predict"]
    task = len(STEPS) + 1000
    timings = {"predicted_n": n, "predicted_ms": 10.0 * (n - 1)}
    if DRAFTS is not None:
        steps = math.ceil((n - 1) / 2)
        for _ in range(steps):
            print(f"slot operator(): id  0 | task {task} | accepted  1/{DRAFTS:2d} draft tokens")
        STEPS.extend([1] * steps)
        timings |= {"predicted_ms": 30.0 * steps, "draft_n": DRAFTS * steps,
                    "draft_n_accepted": steps}
    print(f"slot release: id  0 | task {task} | stop processing: n_tokens = {n}", flush=True)
    if os.environ.get("FAKE_LLAMA_ORDER"):
        with open(os.environ["FAKE_LLAMA_ORDER"], "a") as f:
            f.write(("plain" if DRAFTS is None else "drafter") + "\n")
    return {"tokens": [20 + i for i in range(n)], "stop_type": "limit",
            "tokens_evaluated": len(body["prompt"]), "timings": timings}


def _metrics() -> str:
    lines = [f"llamacpp:spec_decode_num_drafts_total {len(STEPS)}",
             f"llamacpp:spec_decode_num_draft_tokens_total {len(STEPS) * (DRAFTS or 0)}",
             f"llamacpp:spec_decode_num_accepted_tokens_total {sum(STEPS)}"]
    lines += [f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{k}"}} '
              f"{sum(a > k for a in STEPS)}" for k in range(DRAFTS or 0)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with open(os.environ["FAKE_LLAMA_PID"], "w") as f:
        f.write(str(os.getpid()))
    port = int(sys.argv[sys.argv.index("--port") + 1])
    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
