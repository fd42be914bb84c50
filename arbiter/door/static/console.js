// Arbiter's live console. Every name is user input: it is only ever set as text (textContent), never as HTML.
"use strict";
const state = { resources: new Map(), edges: new Map(), deadlocks: [], sagas: new Map(), refusals: [],
                workers: {}, members: null, lag: {}, decisions: 0, seen: [] };
let dirty = true, key = sessionStorage.getItem("arbiter-key") || "";
window.arbiterConsole = { state, appeared: {} };   // for tests: when each holder first appeared (ms)
const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}
function row(cells) { const tr = el("tr"); for (const c of cells) { const td = el("td"); td.append(c); tr.append(td); } return tr; }
function names(list, cls) { const span = el("span", list.join(", "), cls); return span; }

function noteHolders(resource, book) {
  for (const h of book.holders) {
    const k = resource + "\u0000" + h.agent;
    if (!(k in window.arbiterConsole.appeared)) window.arbiterConsole.appeared[k] = Date.now();
  }
}

function apply(change) {
  switch (change.kind) {
    case "snapshot":
      state.resources = new Map(Object.entries(change.resources));
      state.edges = new Map(change.edges.map((e) => [e.id, e]));
      state.deadlocks = change.deadlocks; state.sagas = new Map(Object.entries(change.sagas));
      state.refusals = change.refusals; state.workers = change.workers; state.members = change.members;
      state.lag = change.lag;
      state.decisions = change.decisions;
      for (const [r, b] of state.resources) noteHolders(r, b);
      break;
    case "granted": case "queued": case "released": case "expired": case "revoked": case "denied":
    case "waittimedout": case "cancelled": case "renewed":
      state.decisions += 1; state.seen.push(Date.now());
      if (change.book.holders.length || change.book.queue.length) state.resources.set(change.resource, change.book);
      else state.resources.delete(change.resource);
      noteHolders(change.resource, change.book);
      if (change.kind === "denied") addRefusal(change.at, change.reason);
      break;
    case "write":
      state.decisions += 1; state.seen.push(Date.now());
      if (change.reason !== "applied") addRefusal(change.at, change.reason);
      break;
    case "edge": state.edges.set(change.edge.id, change.edge); break;
    case "edge_removed": state.edges.delete(change.id); break;
    case "deadlock": state.deadlocks.push(change.deadlock); break;
    case "saga": state.sagas.set(change.saga.id, change.saga); break;
    case "worker": state.workers[change.worker.id] = change.worker; break;
    case "members": state.members = change.members; break;
    case "lag": state.lag = change.lag; break;
    case "dead_letter": addRefusal(change.at, "dead letter: " + change.reason); break;
    case "overflow": reconnect(); break;
  }
  dirty = true;
}

function addRefusal(atMs, reason) {
  const bucket = Math.floor(atMs / 1000 / 10) * 10;
  let last = state.refusals[state.refusals.length - 1];
  if (!last || last.at !== bucket) { last = { at: bucket, by_reason: {} }; state.refusals.push(last); }
  last.by_reason[reason] = (last.by_reason[reason] || 0) + 1;
  if (state.refusals.length > 30) state.refusals.shift();
}

function render() {
  if (!dirty) return;
  dirty = false;
  $("decisions").textContent = state.decisions;
  const now = Date.now(); state.seen = state.seen.filter((t) => now - t < 5000);
  $("rate").textContent = (state.seen.length / 5).toFixed(0);
  const body = $("leases"); const rows = [];
  const sorted = [...state.resources.keys()].sort();
  for (const r of sorted.slice(0, 1000)) {
    const b = state.resources.get(r);
    const tr = row([el("span", r), names(b.holders.map((h) => h.agent + (h.mode === "shared" ? " (shared)" : "")), "held"),
                    names(b.queue, "queued")]);
    tr.dataset.resource = r; rows.push(tr);
  }
  body.replaceChildren(...rows);
  $("resource-count").textContent = state.resources.size;
  const graph = $("graph"); const edges = [];
  for (const e of state.edges.values()) edges.push(el("div", e.waiter + " → " + e.holder + (e.resource ? "  (" + e.resource + ")" : "  (" + e.source + ")")));
  graph.replaceChildren(...(edges.length ? edges : [el("div", "no one waits", "dim")]));
  const dl = $("deadlocks"); const cycles = [];
  for (const d of state.deadlocks.slice(-10).reverse()) {
    const box = el("div", null, "cycle"); box.dataset.victim = d.victim;
    box.append(el("div", "cycle: " + d.cycle.join(" → ")));
    const v = el("div", "victim: "); v.append(el("span", d.victim, "victim")); box.append(v); cycles.push(box);
  }
  dl.replaceChildren(...(cycles.length ? cycles : [el("div", "none", "dim")]));
  const ref = $("refusals"); const bars = []; const totals = {};
  for (const b of state.refusals) for (const [reason, n] of Object.entries(b.by_reason)) totals[reason] = (totals[reason] || 0) + n;
  const most = Math.max(1, ...Object.values(totals));
  for (const [reason, n] of Object.entries(totals).sort((a, b) => b[1] - a[1])) {
    const line = el("div"); const bar = el("span", null, "bar"); bar.style.width = (120 * n / most) + "px";
    line.append(bar, el("span", " " + n + " " + reason)); bars.push(line);
  }
  ref.replaceChildren(...(bars.length ? bars : [el("div", "none", "dim")]));
  const sagas = [...state.sagas.values()].slice(-50).reverse();
  $("sagas").replaceChildren(...sagas.map((s) => row([el("span", s.id), el("span", s.status, s.status === "COMPENSATION_FAILED" ? "victim" : ""),
                                                      el("span", plural(s.steps, "step") + ", " + s.compensated + " compensated", "dim")])));
  renderWorkers();
}

function plural(n, word) { return n + " " + word + (n === 1 ? "" : "s"); }

// The workers running are the members of the workers' group; a worker that announced its start and is not
// in the group has stopped. The lag is every input partition's, summed: one figure, then the partitions behind.
function renderWorkers() {
  const running = state.members || [];
  const lines = running.map((id) => {
    const line = el("div", id + (state.workers[id] ? "  " + state.workers[id].guarantee : ""), "worker");
    line.dataset.worker = id; return line;
  });
  const stopped = Object.keys(state.workers).filter((id) => !running.includes(id)).length;
  if (state.members === null) lines.push(el("div", "measuring…", "dim"));
  else if (!running.length) lines.push(el("div", "no worker is running", "victim"));
  if (stopped && state.members !== null) lines.push(el("div", stopped + " stopped", "dim"));
  $("workers").replaceChildren(...lines);
  const behind = Object.entries(state.lag).filter(([, n]) => n > 0).sort((a, b) => b[1] - a[1]);
  const total = behind.reduce((sum, [, n]) => sum + n, 0);
  const known = Object.keys(state.lag).length > 0;
  $("lag-total").textContent = !known ? "lag: measuring…" : total ? "lag: " + plural(total, "input") + " behind" : "lag: 0, caught up";
  $("lag-total").className = total ? "queued" : "dim";
  $("lag").replaceChildren(...behind.slice(0, 20).map(([tp, n]) => row([el("span", tp), el("span", n + " behind", "queued")])));
}

async function search(name) {
  $("history-name").textContent = name;
  const answer = await fetch("/console/history?name=" + encodeURIComponent(name), { headers: auth() });
  const body = await answer.json();
  $("history").replaceChildren(...(body.events || []).slice().reverse().map((e) =>
    row([el("span", new Date(e.at).toISOString().slice(11, 23), "dim"), el("span", e.kind), el("span", e.resource || ""),
         el("span", e.agent || ""), el("span", e.reason || e.tool || "")])));
}

function auth() { return key ? { Authorization: "Bearer " + key } : {}; }

let controller = null;
async function connect() {
  controller = new AbortController();
  $("status").textContent = "connecting…"; $("status").className = "";
  let answer;
  try { answer = await fetch("/console/stream", { headers: auth(), signal: controller.signal }); }
  catch (e) { return retry(); }
  if (answer.status === 401 || answer.status === 403) { $("login").className = "show"; $("status").textContent = "key needed"; return; }
  if (!answer.ok) return retry();
  $("status").textContent = "live"; $("status").className = "live";
  const reader = answer.body.getReader(); const decoder = new TextDecoder(); let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
        for (const line of frame.split("\n")) if (line.startsWith("data: ")) apply(JSON.parse(line.slice(6)));
      }
    }
  } catch (e) { /* the stream ended */ }
  retry();
}
function retry() { $("status").textContent = "reconnecting…"; $("status").className = "down"; setTimeout(connect, 1000); }
function reconnect() { if (controller) controller.abort(); }

$("search").addEventListener("keydown", (e) => { if (e.key === "Enter" && e.target.value.trim()) search(e.target.value.trim()); });
$("go").addEventListener("click", () => { key = $("key").value.trim(); sessionStorage.setItem("arbiter-key", key); $("login").className = ""; connect(); });
// At most five redraws a second, however fast decisions come: a redraw rebuilds up to 1,000 rows.
let drawn = -Infinity;
(function frame(at) { if (at - drawn >= 200) { drawn = at; render(); } requestAnimationFrame(frame); })(0);
setInterval(() => { dirty = true; }, 1000);
connect();
