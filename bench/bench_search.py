"""Concurrent text_search_tool calls overlap their network waits.

A local Search-R1-style retriever answers every request after DELAY seconds. 32 threads call
the tool at once (as a rollout's 32 trajectories would). With the waits overlapped the batch
takes about one call's time; serialised it would take 32. Both runs happen here, so the ratio
compares like with like on this machine.

    python bench/bench_search.py [--calls 32] [--delay 0.2]
"""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson

from marscli.tools.search import TextSearchTool, tool_failed

REPLY = orjson.dumps({"result": [[{"document": {"contents": f'"Doc {i}"\nText of doc {i}.'},
                                   "score": 1.0} for i in range(5)]]})


def serve(delay: float) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            time.sleep(delay)
            self.send_response(200)
            self.send_header("Content-Length", str(len(REPLY)))
            self.end_headers()
            self.wfile.write(REPLY)

        def log_message(self, *a) -> None:
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 128  # the default 5 would drop simultaneous connects

    srv = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    return srv


def batch(calls: int, delay: float) -> float:
    srv = serve(delay)
    try:
        tool = TextSearchTool(f"retriever:http://127.0.0.1:{srv.server_port}", cache=None,
                              concurrency=calls)
        tool({"query": "warm-up"}, None)  # first-use imports out of the timing
        t0 = time.perf_counter()
        with ThreadPoolExecutor(calls) as pool:
            results = list(pool.map(lambda i: tool({"query": f"question {i}"}, None),
                                    range(calls)))
        wall = time.perf_counter() - t0
        assert not any(tool_failed(r) for r in results), [r.text for r in results][:3]
        return wall
    finally:
        srv.shutdown()
        srv.server_close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=32)
    ap.add_argument("--delay", type=float, default=0.2)
    a = ap.parse_args()
    fast = batch(a.calls, 0.0)
    slow = batch(a.calls, a.delay)
    print(f"{a.calls} concurrent calls, zero latency:      {fast * 1000:7.1f} ms")
    print(f"{a.calls} concurrent calls, {a.delay * 1000:.0f} ms latency:    "
          f"{slow * 1000:7.1f} ms")
    print(f"extra time from latency: {(slow - fast) * 1000:.1f} ms = "
          f"{(slow - fast) / a.delay:.2f} calls' latency (serial: {a.calls})")
    print(f"ratio to the zero-latency run: {slow / fast:.2f}")


if __name__ == "__main__":
    main()
