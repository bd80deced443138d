"""The master's live status page: who is alive, what the job is doing, how each recovery went.

``StatusBoard`` is a view of the event log, like ``metrics.csv`` (it subscribes to ``EventLog``): pure,
each record in, a JSON-able snapshot out. ``StatusServer`` serves it over HTTP on a side port bound to
loopback by default (``--status-port``, ``--status-host``), behind the job's token (the gRPC one, in
``RUN_DIR/token``): ``/?token=T`` is the page, ``/status.json`` its data (the token as ``?token=`` or an
``Authorization: Bearer`` header). A request without it, or with another, is 401 with nothing else in
the answer. The page is one HTML file with its script inline (no build step): it polls the JSON every
second and draws the nodes, the current generation's pipelines, the recovery table as it grows
(``faults.report.recovery_rows``, the table printed at the end), throughput and loss, checkpoints and
stragglers. Written by hand on ``http.server``: a page and one JSON answer need no web framework.

Memory stays bounded on a job of weeks: every membership, plan, recovery and checkpoint event is kept
(they come with failures, not with steps), the step events of the last ``STEPS_KEPT`` steps, and the
step just before and just after each other event (what a recovery row reads).
"""

from __future__ import annotations

import collections
import hmac
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from oobleck_mm.faults.report import recovery_rows

STEPS_KEPT = 2000
"""Step events kept for the throughput and loss curves (and the recovery rows of recent incidents)."""
SHOWN_STEPS = 600
"""Points of the curves the page draws."""
NODE_STATES = {"registered": "registered", "lost": "lost", "left": "left", "straggler_benched": "benched"}


class StatusBoard:
    """The job's state as the event log tells it (feed it every record, in order)."""

    def __init__(self, model: str = "", steps: int = 0, clock=time.time) -> None:
        self.model, self.steps, self.clock = model, steps, clock
        self._lock = threading.Lock()
        self._events: list[dict] = []
        self._steps: collections.deque = collections.deque(maxlen=STEPS_KEPT)
        self._pin_next = False
        self.nodes: dict[str, dict] = {}
        self.plan: dict | None = None
        self.checkpoints: list[dict] = []
        self.stragglers: dict[str, float | None] = {}
        self.finished: str | None = None

    def __call__(self, record: dict) -> None:
        """``EventLog.subscribe``'s callback."""
        with self._lock:
            self._observe(record)

    def _observe(self, r: dict) -> None:
        kind, ts = r.get("event"), r.get("ts", self.clock())
        if kind == "step":
            self._steps.append(r)
            if self._pin_next:  # the first step after a membership event: a recovery row reads it
                self._events.append(r)
                self._pin_next = False
            return
        if kind in ("assignment_sent", "subscribed", "heartbeat_late", "node_ready"):
            return  # per node and per generation: many, and nothing the page shows
        if self._steps and (not self._events or self._events[-1] is not self._steps[-1]):
            self._events.append(self._steps[-1])  # the last step before it
        self._events.append(r)
        self._pin_next = True
        node = r.get("node")
        if kind in NODE_STATES and node:
            self._set(node, NODE_STATES[kind], ts, r.get("reason") or "")
        elif kind == "plan_decided":
            self.plan = r
            for name in r.get("nodes", ()):
                self._set(name, "training", ts, "")
        elif kind == "straggler_detected" or kind == "straggler_changed":
            self.stragglers[node] = r.get("factor")
        elif kind == "straggler_cleared":
            self.stragglers.pop(node, None)
        elif kind and kind.startswith("checkpoint"):
            self.checkpoints = [*self.checkpoints[-19:], r]
        elif kind in ("done", "shutdown") and self.finished is None:
            self.finished = r.get("reason") or kind

    def _set(self, node: str, state: str, ts: float, reason: str) -> None:
        """A node's state, and since when it holds (kept while a new plan leaves it as it was)."""
        if self.nodes.get(node, {}).get("state") != state:
            self.nodes[node] = {"state": state, "since": ts, "reason": reason}

    def snapshot(self) -> dict[str, Any]:
        """What the page shows, as plain JSON values."""
        with self._lock:
            events = list(self._events)
            steps = list(self._steps)[-SHOWN_STEPS:]
            nodes = {k: dict(v) for k, v in self.nodes.items()}
            plan = dict(self.plan) if self.plan else None
            checkpoints, stragglers = list(self.checkpoints), dict(self.stragglers)
        rows = [row.to_dict() for row in recovery_rows(events)]
        now = self.clock()
        last = steps[-1] if steps else {}
        return {
            "now": now,
            "model": self.model,
            "steps": self.steps,
            "step": last.get("step", -1) + 1 if last else 0,
            "loss": last.get("loss"),
            "samples_per_s": last.get("samples_per_s"),
            "finished": self.finished,
            "nodes": [{"name": k, **v, "for_s": round(now - v["since"], 1)} for k, v in sorted(nodes.items())],
            "generation": None
            if plan is None
            else {
                "number": plan.get("generation"),
                "nodes": plan.get("nodes", []),
                "pipelines": plan.get("describe", ""),
                "cause": plan.get("cause", ""),
                "reason": plan.get("reason", ""),
                "predicted_samples_per_s": plan.get("predicted_samples_per_s"),
            },
            "recoveries": rows,
            "curve": [[s.get("step"), s.get("samples_per_s"), s.get("loss"), s.get("generation")] for s in steps],
            "checkpoints": [{k: c.get(k) for k in ("event", "step", "dir", "generation", "ts")} for c in checkpoints],
            "stragglers": stragglers,
        }


class StatusServer:
    """``StatusBoard`` over HTTP, behind the job's token (a thread of its own)."""

    def __init__(self, board: StatusBoard, token: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.board, self.token = board, token
        self._http = ThreadingHTTPServer((host, port), _handler(self))
        self._http.daemon_threads = True
        self.host, self.port = host, self._http.server_address[1]
        self._thread = threading.Thread(target=self._http.serve_forever, name="status-http", daemon=True)

    def start(self) -> StatusServer:
        self._thread.start()
        return self

    def url(self, with_token: bool = False) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/" + (f"?token={self.token}" if with_token else "")

    def allowed(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()


def _handler(server: StatusServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            url = urlparse(self.path)
            given = parse_qs(url.query).get("token", [None])[0]
            auth = self.headers.get("Authorization", "")
            if auth.startswith("Bearer "):
                given = auth[len("Bearer ") :]
            if not server.allowed(given):
                self._send(401, b"401 unauthorized: the job's token (RUN_DIR/token) is required\n", "text/plain")
                return
            if url.path == "/":
                self._send(200, PAGE.encode(), "text/html; charset=utf-8")
            elif url.path == "/status.json":
                self._send(200, json.dumps(server.board.snapshot()).encode(), "application/json")
            else:
                self._send(404, b"404 not found\n", "text/plain")

        def _send(self, code: int, body: bytes, kind: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            if code == 401:
                self.send_header("WWW-Authenticate", 'Bearer realm="oobleck_mm"')
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's signature)
            pass  # the master's console is the job's, not an access log

    return Handler


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>oobleck_mm: job status</title>
<style>
 body{font:14px system-ui,sans-serif;margin:1.2em;color:#222;background:#fafafa}
 h1{font-size:1.3em;margin:0 0 .3em} h2{font-size:1.05em;margin:1.2em 0 .4em}
 table{border-collapse:collapse;background:#fff} td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
 .training{color:#1a7f37}.lost{color:#cf222e;font-weight:bold}.left{color:#9a6700}.benched{color:#8250df}
 .registered{color:#0969da} #summary{font-size:1.1em} svg{background:#fff;border:1px solid #ddd}
 code{background:#eee;padding:0 3px}
</style></head><body>
<h1>oobleck_mm <span id="model"></span></h1>
<div id="summary">connecting...</div>
<h2>Nodes</h2><table id="nodes"><tr><th>node</th><th>state</th><th>for</th><th>reason</th></tr></table>
<h2>Generation</h2><div id="generation">-</div>
<h2>Throughput and loss</h2>
<div><span style="color:#0969da">&#9644; samples/s</span> &nbsp; <span style="color:#cf222e">&#9644; loss</span>
 &nbsp; <span id="range"></span></div><svg id="curve" width="720" height="160"></svg>
<h2>Recoveries</h2><table id="recoveries"></table>
<h2>Stragglers</h2><div id="stragglers">none</div>
<h2>Checkpoints</h2><table id="checkpoints"></table>
<script>
const token = new URLSearchParams(location.search).get("token") || "";
const esc = s => String(s ?? "").replace(/[&<>"]/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"}[c]));
const num = (x, d=2) => (x === null || x === undefined) ? "-" : Number(x).toFixed(d);
function rows(table, head, body) {
  table.innerHTML = "<tr>" + head.map(h => "<th>" + esc(h) + "</th>").join("") + "</tr>" +
    body.map(r => "<tr>" + r.map(c => "<td>" + c + "</td>").join("") + "</tr>").join("");
}
function line(points, w, h, colour) {
  const ys = points.map(p => p[1]).filter(y => y !== null && isFinite(y));
  if (ys.length < 2) return "";
  const lo = Math.min(...ys), hi = Math.max(...ys), xs = points.map(p => p[0]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs) || 1;
  const d = points.filter(p => p[1] !== null).map((p, i) =>
    (i ? "L" : "M") + ((p[0] - x0) / ((x1 - x0) || 1) * (w - 10) + 5).toFixed(1) + "," +
    (h - 5 - (p[1] - lo) / ((hi - lo) || 1) * (h - 10)).toFixed(1)).join("");
  return '<path d="' + d + '" fill="none" stroke="' + colour + '" stroke-width="1.5"/>';
}
function draw(s) {
  document.getElementById("model").textContent = s.model;
  document.getElementById("summary").innerHTML = "step <b>" + s.step + "</b> of " + s.steps +
    " &middot; loss " + num(s.loss, 4) + " &middot; " + num(s.samples_per_s, 1) + " samples/s" +
    (s.finished ? " &middot; <b>" + esc(s.finished) + "</b>" : "");
  rows(document.getElementById("nodes"), ["node", "state", "for", "reason"],
    s.nodes.map(n => [esc(n.name), '<span class="' + esc(n.state) + '">' + esc(n.state) + "</span>",
                      num(n.for_s, 0) + " s", esc(n.reason)]));
  const g = s.generation;
  document.getElementById("generation").innerHTML = g ? "generation <b>" + g.number + "</b> (" + esc(g.cause) +
    ") on " + g.nodes.length + " nodes: <code>" + esc(g.pipelines) + "</code><br>" + esc(g.reason) : "-";
  const svg = document.getElementById("curve");
  svg.innerHTML = line(s.curve.map(c => [c[0], c[1]]), 720, 160, "#0969da") +
                  line(s.curve.map(c => [c[0], c[2]]), 720, 160, "#cf222e");
  const tp = s.curve.map(c => c[1]).filter(x => x !== null), ls = s.curve.map(c => c[2]).filter(x => x !== null);
  document.getElementById("range").textContent = s.curve.length ? "steps " + (s.curve[0][0] + 1) + "-" +
    (s.curve[s.curve.length - 1][0] + 1) + "; samples/s " + num(Math.min(...tp), 1) + "-" + num(Math.max(...tp), 1) +
    "; loss " + num(Math.min(...ls), 3) + "-" + num(Math.max(...ls), 3) : "";
  rows(document.getElementById("recoveries"), ["#", "kind", "nodes", "step", "detect s", "plan s", "rdv s",
    "copy s", "resume s", "lost s", "outcome"], s.recoveries.map((r, i) => [i + 1, esc(r.kind),
    esc((r.nodes || []).join(",")), esc(r.step), num(r.detect_s), num(r.decide_s), num(r.rendezvous_s),
    num(r.copy_s), num(r.resume_s), num(r.lost_s), esc(r.outcome)]));
  const st = Object.entries(s.stragglers);
  document.getElementById("stragglers").textContent = st.length ?
    st.map(([n, f]) => n + " x" + num(f)).join(", ") : "none";
  rows(document.getElementById("checkpoints"), ["event", "step", "dir"],
    s.checkpoints.map(c => [esc(c.event), esc(c.step), esc(c.dir)]));
}
async function poll() {
  try {
    const r = await fetch("status.json", {headers: {"Authorization": "Bearer " + token}, cache: "no-store"});
    if (r.ok) draw(await r.json());
    else document.getElementById("summary").textContent = "the master answered " + r.status;
  } catch (e) {
    document.getElementById("summary").textContent = "the master is not answering (" + e + ")";
  }
  setTimeout(poll, 1000);
}
poll();
</script></body></html>
"""
