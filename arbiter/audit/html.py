"""The audit report as one self-contained HTML page an auditor can open offline.

``render(report)`` turns the dict ``audit()`` returns into a single HTML file with
inline CSS and JavaScript only: no URLs, fonts or CDNs, and a Content-Security-Policy
that forbids loading anything, so the page reads the same on an air-gapped machine.

The page has two halves:

- **static HTML**, written here and readable without JavaScript: the verdict
  (PASS / VIOLATIONS), the source, the counts, the table of checks and every finding
  (violations first, then open items) with the log positions (``topic[p]@offset``)
  that prove it;
- **the timeline**, an inline SVG that a small vanilla-JS renderer draws when the page
  loads, from the report embedded verbatim as JSON in
  ``<script type="application/json" id="audit-data">``. Time runs left to right in
  seconds from the start of the log; each resource is a lane holding its leases (bars
  coloured by how they ended, shared leases translucent), waits (hatched), applied
  writes (ticks), rejected writes (red crosses) and violations (red ``!``), followed by
  a row of deadlocks and a row per saga with its compensations. The renderer sets
  ``data-rendered="true"`` on ``<svg id="timeline">`` when done.

The renderer builds every node with ``createElementNS``/``textContent``, never from
markup, so names in the log cannot inject anything. The SVG marker class names
(``lease``, ``wait``, ``write``, ``rejection``, ``violation``, ``deadlock``, ``saga``,
``compensation``) are used by the timeline only, so counting them counts the marks.
At most ``MAX_LANES`` resource lanes (resources with violations first) and as many
saga rows are drawn; the page says how many were left out.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from html import escape
from typing import Any

__all__ = ["MAX_LANES", "render"]

MAX_LANES = 200

_STYLE = """
:root{--ink:#0f172a;--muted:#64748b;--line:#e2e8f0;--band:#f8fafc;--ok:#15803d;--bad:#dc2626;--warn:#b45309;
--released:#2563eb;--expired:#d97706;--revoked:#9333ea;--open:#64748b;--wait:#94a3b8;
--completed:#16a34a;--compensated:#ea580c;--deadlock:#7f1d1d;--compensation:#7c2d12}
*{box-sizing:border-box}
body{margin:0;padding:24px 32px 48px;color:var(--ink);background:#fff;
font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
h1{font-size:22px;margin:0}
h2{font-size:16px;margin:28px 0 10px;padding-bottom:4px;border-bottom:1px solid var(--line)}
h3{font-size:14px;margin:16px 0 6px}
code{font:12px/1.4 ui-monospace,"SFMono-Regular",Menlo,Consolas,monospace;background:#f1f5f9;
padding:1px 4px;border-radius:3px;overflow-wrap:anywhere}
header{display:flex;align-items:center;gap:20px;padding:16px 20px;border-radius:8px;border:2px solid}
header.pass{border-color:var(--ok);background:#f0fdf4}
header.fail{border-color:var(--bad);background:#fef2f2}
.verdict{font-size:26px;font-weight:800;letter-spacing:.04em}
header.pass .verdict{color:var(--ok)}
header.fail .verdict{color:var(--bad)}
.source{margin:4px 0 0;color:var(--muted)}
.figures{display:grid;grid-template-columns:repeat(auto-fill,minmax(130px,1fr));gap:8px;margin:16px 0 0}
.figures div{border:1px solid var(--line);border-radius:6px;padding:8px 10px}
.figures div.wide{grid-column:span 2}
.figures dt{color:var(--muted);font-size:12px}
.figures dd{margin:0;font-size:18px;font-weight:600}
.figures dd small{display:block;font-size:11px;font-weight:400;color:var(--muted)}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:5px 10px;border-bottom:1px solid var(--line);vertical-align:top}
th{font-size:12px;color:var(--muted);font-weight:600}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
.status-ok{color:var(--ok);font-weight:600}
.status-bad{color:var(--bad);font-weight:600}
.status-warn{color:var(--warn);font-weight:600}
.stats{columns:3 220px;margin:0;padding:0;list-style:none}
.stats li{display:flex;justify-content:space-between;gap:12px;padding:2px 0;border-bottom:1px dotted var(--line)}
.stats li span:last-child{font-variant-numeric:tabular-nums}
ol.findings{list-style:none;margin:0;padding:0}
ol.findings>li{border-left:4px solid;padding:6px 12px;margin:8px 0;background:var(--band)}
ol.findings>li.sev-violation{border-color:var(--bad)}
ol.findings>li.sev-open{border-color:var(--warn)}
ol.findings>li.sev-intrusion{border-color:#8e44ad}
.sev-intrusion .badge{background:#8e44ad}
.verdict-note{margin:4px 0 0;font-size:14px}
.badge{display:inline-block;font-size:11px;font-weight:700;text-transform:uppercase;padding:1px 6px;
border-radius:3px;color:#fff}
.sev-violation .badge{background:var(--bad)}
.sev-open .badge{background:var(--warn)}
.finding-head{display:flex;flex-wrap:wrap;gap:10px;align-items:baseline}
.check{font-weight:600}
.meta{color:var(--muted);font-size:12px}
.msg{margin:4px 0}
ul.where{margin:0;padding:0;list-style:none;display:flex;flex-wrap:wrap;gap:4px}
.none{color:var(--muted)}
ul.legend{list-style:none;padding:0;margin:0 0 10px;display:flex;flex-wrap:wrap;gap:6px 18px;font-size:12px}
ul.legend li{display:flex;align-items:center;gap:6px}
.key{display:inline-block;width:22px;height:10px;border-radius:2px}
.key.released{background:var(--released)}
.key.expired{background:var(--expired)}
.key.revoked{background:var(--revoked)}
.key.open{background:#fff;border:1.5px dashed var(--open)}
.key.shared{background:rgba(37,99,235,.3);border:1.5px solid var(--released)}
.key.waiting{background:repeating-linear-gradient(45deg,#f1f5f9 0 2px,var(--wait) 2px 3px);border:1px solid var(--wait)}
.key.tick{width:2px;height:12px;background:var(--ink);border-radius:0}
.key.completed{background:var(--completed)}
.key.compensated{background:var(--compensated)}
.glyph{font-weight:700;width:14px;text-align:center}
#timeline-wrap{width:100%;overflow-x:auto;border:1px solid var(--line);border-radius:6px}
#timeline{display:block;font-size:11px}
#timeline text{fill:var(--ink)}
#timeline .axis-label,#timeline .axis-note,#timeline .section-note,#timeline .note{fill:var(--muted)}
#timeline .section-title{font-weight:700;text-transform:uppercase;letter-spacing:.05em}
#timeline .section-rule{stroke:var(--line)}
#timeline .gridline{stroke:#eef2f6}
#timeline .lane-bg{fill:#fff}
#timeline .lane-bg.odd{fill:var(--band)}
#timeline .lane-label{font-size:12px}
#timeline .empty{font-style:italic;fill:var(--muted)}
#timeline .bar-label{fill:#fff;pointer-events:none}
#timeline .bar-label.shared{fill:var(--ink)}
#timeline .hatch-bg{fill:#f1f5f9}
#timeline .hatch-line{stroke:var(--wait);stroke-width:2}
rect.lease{color:var(--open);fill:currentColor;stroke:#fff;stroke-width:1}
rect.lease[data-end=released]{color:var(--released)}
rect.lease[data-end=expired]{color:var(--expired)}
rect.lease[data-end=revoked]{color:var(--revoked)}
rect.lease[data-end=open]{fill:#fff;stroke:currentColor;stroke-width:1.5;stroke-dasharray:4 2}
rect.lease[data-mode=shared]{fill:currentColor;fill-opacity:.3;stroke:currentColor;stroke-width:1.5}
rect.wait{fill:url(#hatch);stroke:var(--wait);stroke-width:1}
line.write{stroke:var(--ink);stroke-width:2}
g.rejection .halo{stroke:#fff;stroke-width:5}
g.rejection .cross{stroke:var(--bad);stroke-width:2.5}
g.violation line{stroke:var(--bad);stroke-width:1.5;stroke-dasharray:3 2}
g.violation circle{fill:#fff;stroke:var(--bad);stroke-width:2}
#timeline g.violation text{fill:var(--bad);font-weight:800;text-anchor:middle}
path.deadlock{fill:var(--deadlock);stroke:#fff;stroke-width:1}
rect.saga{fill:var(--open)}
rect.saga[data-outcome=COMPLETED]{fill:var(--completed)}
rect.saga[data-outcome=COMPENSATED]{fill:var(--compensated)}
rect.saga[data-outcome=open]{fill:#fff;stroke:var(--open);stroke-width:1.5;stroke-dasharray:4 2}
path.compensation{fill:var(--compensation);stroke:#fff;stroke-width:1}
.js-error{color:var(--bad);font-weight:600}
"""

_LEGEND = """<ul class="legend">
<li><span class="key released"></span>lease released</li>
<li><span class="key expired"></span>lease expired</li>
<li><span class="key revoked"></span>lease revoked</li>
<li><span class="key open"></span>lease still held at end of log</li>
<li><span class="key shared"></span>shared lease</li>
<li><span class="key waiting"></span>waiting for a lease</li>
<li><span class="key tick"></span>applied write</li>
<li><span class="glyph" style="color:var(--bad)">&#x2715;</span>rejected write</li>
<li><span class="glyph" style="color:var(--bad)">!</span>violation</li>
<li><span class="glyph" style="color:var(--deadlock)">&#x25C6;</span>deadlock</li>
<li><span class="key completed"></span>saga completed</li>
<li><span class="key compensated"></span>saga compensated</li>
<li><span class="glyph" style="color:var(--compensation)">&#x25BC;</span>compensation</li>
</ul>"""

_SCRIPT = r"""
(() => {
  "use strict";
  const svg = document.getElementById("timeline");
  const NS = svg.namespaceURI;
  const MAX_LANES = Number(svg.dataset.maxLanes);
  const LABEL_W = 200, RIGHT = 24, AXIS_H = 40, HEAD_H = 28, TRACK_H = 16, PAD = 5, ROW_H = 24, MAX_TRACKS = 6;
  const data = JSON.parse(document.getElementById("audit-data").textContent);
  const tl = data.timeline || {};
  const t0 = tl.start_ms || 0;
  const t1 = tl.end_ms > t0 ? tl.end_ms : t0 + 1000;  // a log without a span still gets a readable axis
  const rel = (ms) => "+" + ((ms - t0) / 1000).toFixed(3) + " s";
  const span = (a, b) => rel(a) + " \u2192 " + rel(b) + " (" + ((b - a) / 1000).toFixed(3) + " s)";
  const count = (n, noun) => n + " " + noun + (n === 1 ? "" : "s");

  function el(name, attrs, parent) {
    const node = document.createElementNS(NS, name);
    for (const [key, value] of Object.entries(attrs)) {
      if (value !== null && value !== undefined) node.setAttribute(key, String(value));
    }
    parent.appendChild(node);
    return node;
  }
  function titled(node, lines) {
    el("title", {}, node).textContent = lines.filter((line) => line !== null && line !== undefined && line !== "")
      .join("\n");
    return node;
  }
  function text(parent, x, y, content, cls) {
    const node = el("text", {x: x, y: y, class: cls}, parent);
    node.textContent = content;
    return node;
  }
  function fit(name, px) {
    const max = Math.max(2, Math.floor(px / 6.6));
    return name.length > max ? name.slice(0, max - 1) + "\u2026" : name;
  }

  // Resource lanes: every resource of the timeline, plus any resource a violation names
  // that has no lease event of its own; capped, keeping resources with violations first.
  const lanes = (() => {
    const byName = new Map();
    const blank = {leases: [], waits: [], rejections: [], writes: []};
    for (const r of tl.resources || []) byName.set(r.resource, {...blank, ...r, violations: []});
    for (const f of data.findings || []) {
      if (f.severity !== "violation" || f.resource === null || f.resource === undefined
          || f.at_ms === null || f.at_ms === undefined) continue;
      if (!byName.has(f.resource)) byName.set(f.resource, {...blank, resource: f.resource, violations: []});
      byName.get(f.resource).violations.push(f);
    }
    const all = [...byName.values()];
    const keep = new Set(all.filter((r) => r.violations.length).slice(0, MAX_LANES));
    for (const r of all) {
      if (keep.size >= MAX_LANES) break;
      keep.add(r);
    }
    return {shown: all.filter((r) => keep.has(r)), omitted: all.filter((r) => !keep.has(r))};
  })();
  const leaseCount = (rs) => rs.reduce((n, r) => n + r.leases.length, 0);

  function draw() {
    svg.replaceChildren();
    const width = Math.max(760, Math.floor(svg.parentNode.clientWidth));
    const plotW = width - LABEL_W - RIGHT;
    const x = (ms) => LABEL_W + (Math.min(Math.max(ms, t0), t1) - t0) / (t1 - t0) * plotW;
    const hatch = el("pattern", {id: "hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse",
                                 patternTransform: "rotate(45)"}, el("defs", {}, svg));
    el("rect", {width: 6, height: 6, class: "hatch-bg"}, hatch);
    el("line", {x1: 0, y1: 0, x2: 0, y2: 6, class: "hatch-line"}, hatch);
    const bands = el("g", {}, svg), grid = el("g", {}, svg), body = el("g", {}, svg);
    const band = (index, top, height) =>
      el("rect", {x: 0, y: top, width: width, height: height, class: index % 2 ? "lane-bg odd" : "lane-bg"}, bands);
    const heading = (top, title, note) => {
      text(body, 8, top + 19, title, "section-title");
      text(body, LABEL_W, top + 19, note, "section-note");
      el("line", {x1: 0, x2: width, y1: top + HEAD_H - 0.5, y2: top + HEAD_H - 0.5, class: "section-rule"}, body);
      return top + HEAD_H;
    };

    function lane(r, index, top) {
      // Leases and waits share tracks: an item goes on the first track free at its start,
      // so overlapping holders (shared leases, or a broken mutual exclusion) stack visibly.
      const items = r.leases.map((v) => ({kind: "lease", v: v})).concat(r.waits.map((v) => ({kind: "wait", v: v})));
      items.sort((a, b) => a.v.start_ms - b.v.start_ms);
      const ends = [];
      for (const item of items) {
        let k = ends.findIndex((end) => end <= item.v.start_ms);
        if (k < 0) k = Math.min(ends.length, MAX_TRACKS - 1);
        ends[k] = Math.max(ends[k] ?? -Infinity, item.v.end_ms);
        item.track = k;
      }
      const height = Math.max(1, ends.length) * TRACK_H + 2 * PAD;
      const bottom = top + height, mid = top + height / 2;
      band(index, top, height);
      const g = el("g", {"data-resource": r.resource}, body);
      titled(text(g, 8, mid + 4, fit(r.resource, LABEL_W - 16), "lane-label"), [r.resource]);
      for (const {kind, v, track} of items) {
        const y = top + PAD + track * TRACK_H;
        const x0 = x(v.start_ms), w = Math.max(2, x(v.end_ms) - x0);
        if (kind === "lease") {
          titled(el("rect", {class: "lease", x: x0, y: y + 1, width: w, height: TRACK_H - 3, rx: 2,
                             "data-agent": v.agent, "data-token": v.token, "data-mode": v.mode, "data-end": v.end,
                             "data-where": v.where}, g),
                 [v.agent + " \u00b7 token " + v.token + " \u00b7 " + v.mode, "ended: " + v.end,
                  span(v.start_ms, v.end_ms), v.where]);
          const name = v.agent + " #" + v.token;
          if (w > name.length * 6.2 + 8) {
            text(g, x0 + 4, y + TRACK_H - 4, name, v.mode === "shared" ? "bar-label shared" : "bar-label");
          }
        } else {
          titled(el("rect", {class: "wait", x: x0, y: y + 4, width: w, height: TRACK_H - 9, "data-agent": v.agent,
                             "data-end": v.end}, g),
                 [v.agent + " waiting", "ended: " + v.end, span(v.start_ms, v.end_ms)]);
        }
      }
      for (const w of r.writes) {
        const wx = x(w.at_ms);
        titled(el("line", {class: "write", x1: wx, x2: wx, y1: bottom - PAD - 2, y2: bottom, "data-agent": w.agent}, g),
               [w.agent + " wrote version " + w.version + " via " + w.tool, rel(w.at_ms), w.where]);
      }
      for (const j of r.rejections) {
        const rx = x(j.at_ms), cross = "M" + (rx - 4) + " " + (mid - 4) + "l8 8m0 -8l-8 8";
        const mark = el("g", {class: "rejection", "data-agent": j.agent, "data-reason": j.reason}, g);
        el("path", {d: cross, class: "halo"}, mark);
        el("path", {d: cross, class: "cross"}, mark);
        titled(mark, [j.reason, j.agent + ", token " + (j.token === null ? "none" : j.token), rel(j.at_ms), j.where]);
      }
      for (const f of r.violations) {
        const vx = x(f.at_ms);
        const mark = el("g", {class: "violation", "data-check": f.check}, g);
        el("line", {x1: vx, x2: vx, y1: top, y2: bottom}, mark);
        el("circle", {cx: vx, cy: top + 7, r: 6.5}, mark);
        text(mark, vx, top + 11, "!", null);
        titled(mark, [f.check + ": " + f.message, rel(f.at_ms)].concat(f.where));
      }
      return bottom;
    }

    let y = AXIS_H;
    const all = lanes.shown.concat(lanes.omitted);
    y = heading(y, "resources", count(all.length, "resource") + ", " + count(leaseCount(all), "lease"));
    if (!lanes.shown.length) {
      text(body, LABEL_W, y + 16, "no leases in this log", "empty");
      y += ROW_H;
    }
    lanes.shown.forEach((r, i) => { y = lane(r, i, y); });
    if (lanes.omitted.length) {
      text(body, 8, y + 16, lanes.omitted.length + " more resources (" + leaseCount(lanes.omitted)
           + " leases) not drawn: the timeline shows at most " + MAX_LANES + " lanes;"
           + " the findings above list everything.", "note");
      y += ROW_H;
    }

    const deadlocks = tl.deadlocks || [];
    if (deadlocks.length) {
      y = heading(y, "deadlocks", count(deadlocks.length, "deadlock"));
      const mid = y + ROW_H / 2;
      text(body, 8, mid + 4, "wait-for cycles broken", "lane-label");
      for (const d of deadlocks) {
        const dx = x(d.at_ms), ring = d.cycle.length ? d.cycle.concat([d.cycle[0]]) : [];
        titled(el("path", {class: "deadlock", d: "M" + dx + " " + (mid - 7) + "l7 7l-7 7l-7 -7z",
                           "data-victim": d.victim}, body),
               ["victim " + d.victim + "; cycle " + ring.join(" \u2192 "), rel(d.at_ms), d.where]);
      }
      y += ROW_H;
    }

    const sagas = tl.sagas || [];
    if (sagas.length) {
      y = heading(y, "sagas", count(sagas.length, "saga"));
      sagas.slice(0, MAX_LANES).forEach((s, i) => {
        const mid = y + ROW_H / 2;
        band(i, y, ROW_H);
        titled(text(body, 8, mid + 4, fit(s.saga_id, LABEL_W - 16), "lane-label"), [s.saga_id]);
        const x0 = x(s.start_ms);
        titled(el("rect", {class: "saga", x: x0, y: mid - 5, width: Math.max(2, x(s.end_ms) - x0), height: 10, rx: 3,
                           "data-outcome": s.outcome}, body),
               [s.saga_id + " by " + s.agent, s.outcome + " \u00b7 " + count(s.steps, "step"),
                span(s.start_ms, s.end_ms)]);
        for (const c of s.compensations) {
          const cx = x(c.at_ms);
          titled(el("path", {class: "compensation", d: "M" + (cx - 5) + " " + (mid - 10) + "h10l-5 8z"}, body),
                 ["compensated step " + c.step, rel(c.at_ms)]);
        }
        y += ROW_H;
      });
      if (sagas.length > MAX_LANES) {
        text(body, 8, y + 16, (sagas.length - MAX_LANES) + " more sagas not drawn.", "note");
        y += ROW_H;
      }
    }
    y += 8;

    // Time axis: round steps (1, 2 or 5 times a power of ten) about 90 px apart, in seconds from the start.
    const raw = (t1 - t0) / Math.max(1, Math.floor(plotW / 90));
    const power = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
    const decimals = Math.max(0, Math.ceil(-Math.log10(step / 1000) - 1e-9));
    text(grid, 8, 16, "seconds from", "axis-note");
    text(grid, 8, 30, new Date(t0).toISOString(), "axis-note");
    for (let t = 0; t <= t1 - t0; t += step) {
      const gx = x(t0 + t);
      el("line", {x1: gx, x2: gx, y1: AXIS_H - 6, y2: y, class: "gridline"}, grid);
      text(grid, gx, AXIS_H - 10, (t / 1000).toFixed(decimals), "axis-label").setAttribute("text-anchor", "middle");
    }

    svg.setAttribute("width", width);
    svg.setAttribute("height", y);
    svg.setAttribute("viewBox", "0 0 " + width + " " + y);
  }

  try {
    draw();
    svg.setAttribute("data-rendered", "true");
  } catch (error) {
    svg.setAttribute("data-rendered", "error");
    const p = document.createElement("p");
    p.className = "js-error";
    p.textContent = "The timeline could not be drawn: " + error;
    svg.parentNode.after(p);
    throw error;
  }
  let pending = 0;
  window.addEventListener("resize", () => {
    clearTimeout(pending);
    pending = setTimeout(draw, 150);
  });
})();
"""


def render(report: dict[str, Any]) -> str:
    """One self-contained HTML page for ``report`` (the dict ``audit()`` returns)."""
    passed = report.get("verdict") == "pass"
    verdict = "PASS" if passed else "VIOLATIONS" if report.get("violations", 1) else "INTRUSIONS"
    intrusions = int(report.get("intrusions", 0))
    note = (f"<p class=\"verdict-note\">{'No safety rule was broken. ' if report.get('violations', 0) == 0 else ''}"
            f"{intrusions} intrusion(s) detected: forged or unauthorized messages that the workers refused and "
            "the agents' SDKs ignored; nothing changed by them (listed below).</p>" if intrusions else "")
    source = str(report.get("source", ""))
    return "".join([
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n",
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'\">\n",
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n",
        f"<title>Arbiter audit: {verdict} \u2014 {escape(source)}</title>\n",
        f"<style>{_STYLE}</style>\n</head>\n<body>\n",
        f"<header class=\"{'pass' if passed else 'fail'}\"><div class=\"verdict\">{verdict}</div>",
        f"<div><h1>Arbiter audit</h1><p class=\"source\">source: <code>{escape(source)}</code></p>{note}</div>"
        "</header>\n",
        _figures(report),
        _checks(report.get("checks", {})),
        "<h2>Timeline</h2>\n",
        _LEGEND,
        f"\n<div id=\"timeline-wrap\"><svg id=\"timeline\" data-max-lanes=\"{MAX_LANES}\" role=\"img\" "
        "aria-label=\"Timeline of leases, waits, writes, deadlocks and sagas\"></svg></div>\n",
        "<noscript><p class=\"none\">The timeline is drawn by JavaScript; "
        "the rest of the page reads without.</p></noscript>\n",
        _findings(report.get("findings", []), (report.get("timeline") or {}).get("start_ms")),
        _human_actions(report.get("human_actions") or [], (report.get("timeline") or {}).get("start_ms")),
        _stats(report.get("stats", {})),
        f"<script type=\"application/json\" id=\"audit-data\">{_embed(report)}</script>\n",
        f"<script>{_SCRIPT}</script>\n</body>\n</html>\n",
    ])


def _embed(report: dict[str, Any]) -> str:
    """``report`` as JSON that cannot end its <script> element early.

    ``</`` would close the element and ``<!--`` would start a script-data comment that
    swallows the real end tag; both are rewritten as JSON escapes that parse back the same.
    """
    text = json.dumps(report, ensure_ascii=False, separators=(",", ":"))
    return text.replace("</", "<\\/").replace("<!--", "\\u003c!--")


def _utc(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _figures(report: dict[str, Any]) -> str:
    timeline = report.get("timeline") or {}
    resources = timeline.get("resources", [])
    findings = report.get("findings", [])
    # Each severity counted on its own, as the JSON does: intrusions are neither violations nor open items.
    count = {severity: sum(1 for f in findings if f.get("severity") == severity)
             for severity in ("violation", "intrusion", "open")}
    cells = [_figure("messages", f"{report.get('messages', 0):,}")]
    span = report.get("span_ms") or []
    if len(span) == 2:
        cells.append(_figure("span", f"{(span[1] - span[0]) / 1000:,.3f} s", f"from {_utc(span[0])}",
                             f"to {_utc(span[1])}"))
    cells += [
        _figure("violations", f"{count['violation']:,}"),
        _figure("intrusions", f"{count['intrusion']:,}"),
        _figure("open items", f"{count['open']:,}"),
        _figure("resources", f"{len(resources):,}"),
        _figure("leases", f"{sum(len(r.get('leases', [])) for r in resources):,}"),
        _figure("deadlocks", f"{len(timeline.get('deadlocks', [])):,}"),
        _figure("sagas", f"{len(timeline.get('sagas', [])):,}"),
    ]
    if report.get("human_actions"):
        cells.append(_figure("human actions", f"{len(report['human_actions']):,}"))
    return f"<dl class=\"figures\">{''.join(cells)}</dl>\n"


def _figure(name: str, value: str, *notes: str) -> str:
    small = "".join(f"<small>{escape(note)}</small>" for note in notes)
    wide = " class=\"wide\"" if notes else ""
    return f"<div{wide}><dt>{escape(name)}</dt><dd>{escape(value)}{small}</dd></div>"


def _checks(checks: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, row in checks.items():
        violations, opened = int(row.get("violations", 0)), int(row.get("open", 0))
        intrusions = int(row.get("intrusions", 0))
        if violations:
            status = f"<span class=\"status-bad\">\u2715 {violations} violation{'s' if violations != 1 else ''}</span>"
        elif opened:
            status = f"<span class=\"status-warn\">{opened} open</span>"
        elif intrusions:
            plural = "s" if intrusions != 1 else ""
            status = f"<span class=\"status-warn\">\u2713 holds; {intrusions} intrusion{plural} detected</span>"
        else:
            status = "<span class=\"status-ok\">\u2713 holds</span>"
        rows.append(f"<tr><td><code>{escape(name)}</code></td><td>{escape(str(row.get('description', '')))}</td>"
                    f"<td class=\"num\">{violations}</td><td class=\"num\">{intrusions}</td>"
                    f"<td class=\"num\">{opened}</td><td>{status}</td></tr>")
    head = ("<tr><th>check</th><th>rule</th><th class=\"num\">violations</th><th class=\"num\">intrusions</th>"
            "<th class=\"num\">open</th><th>status</th></tr>")
    return f"<h2>Checks</h2>\n<table class=\"checks\">{head}{''.join(rows)}</table>\n"


def _findings(findings: list[dict[str, Any]], origin: int | None) -> str:
    """Violations first, then open items; ``origin`` is where the timeline's seconds count from."""
    parts = ["<h2>Findings</h2>\n"]
    if not findings:
        parts.append("<p class=\"none\">No findings.</p>\n")
    for severity, heading in (("violation", "Violations"),
                              ("intrusion", "Intrusions detected (refused or ignored: nothing changed by them)"),
                              ("open", "Open items")):
        group = [f for f in findings if f.get("severity") == severity]
        if group:
            items = "".join(_finding(f, origin) for f in group)
            parts.append(f"<h3>{heading} ({len(group)})</h3>\n<ol class=\"findings\">{items}</ol>\n")
    return "".join(parts)


def _finding(finding: dict[str, Any], origin: int | None) -> str:
    severity = str(finding.get("severity", ""))
    meta = []
    if finding.get("resource") is not None:
        meta.append(f"resource <code>{escape(str(finding['resource']))}</code>")
    at_ms = finding.get("at_ms")
    if at_ms is not None:
        offset = f"+{(at_ms - origin) / 1000:.3f} s, " if origin is not None else ""
        meta.append(f"at {offset}{_utc(at_ms)}")
    where = "".join(f"<li><code>{escape(str(w))}</code></li>" for w in finding.get("where", []))
    return (f"<li class=\"finding sev-{escape(severity)}\"><div class=\"finding-head\">"
            f"<span class=\"badge\">{escape(severity)}</span>"
            f"<span class=\"check\">{escape(str(finding.get('check', '')))}</span>"
            f"<span class=\"meta\">{' &middot; '.join(meta)}</span></div>"
            f"<p class=\"msg\">{escape(str(finding.get('message', '')))}</p>"
            f"<ul class=\"where\">{where}</ul></li>")


def _human_actions(actions: list[dict[str, Any]], origin: int | None) -> str:
    """The operators' overrides (admin-signed revocations and saga aborts): who, what, why, where."""
    if not actions:
        return ""
    rows = []
    for action in actions:
        at_ms = action.get("at_ms")
        when = ""
        if isinstance(at_ms, int):
            when = (f"+{(at_ms - origin) / 1000:.3f} s, " if origin is not None else "") + _utc(at_ms)
        outcome = ", ".join(str(o) for o in action.get("outcome") or []) or "no decision recorded"
        rows.append(f"<tr><td>{escape(str(action.get('who', '')))}</td><td>{escape(str(action.get('what', '')))}"
                    f"</td><td>{escape(str(action.get('reason', '')))}</td><td>{escape(outcome)}</td>"
                    f"<td>{escape(when)}</td><td><code>{escape(str(action.get('where', '')))}</code></td></tr>")
    head = "<tr><th>who</th><th>what</th><th>reason</th><th>outcome</th><th>when</th><th>where</th></tr>"
    return (f"<h2>Human actions ({len(actions)})</h2>\n<p class=\"none\">Operator overrides, signed with an admin "
            f"key.</p>\n<table class=\"human-actions\">{head}{''.join(rows)}</table>\n")


def _stats(stats: dict[str, int]) -> str:
    if not stats:
        return ""
    items = "".join(f"<li><span>{escape(str(name))}</span><span>{value:,}</span></li>"
                    for name, value in sorted(stats.items()))
    return f"<h2>Figures from the log</h2>\n<ul class=\"stats\">{items}</ul>\n"
