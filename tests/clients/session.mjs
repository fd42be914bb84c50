// A front-door session client in plain JavaScript (Node's built-in WebSocket and fetch, no packages),
// driven by tests/door/test_door_http.py: it shows an agent in another language holding a session.
//
//   node session.mjs URL API_KEY [--acquire RESOURCE] [--until TYPE] [--timeout SECONDS]
//
// It opens ws://.../v1/session, authenticates with its first frame ({"op": "auth", "api_key"}: a
// browser's or Node's WebSocket cannot set an Authorization header) and prints every frame it gets
// as one JSON line on stdout. Each line on stdin is a frame to send. --acquire takes a lease over
// HTTP (fetch) once the session is open and prints {"op": "acquired", "status", "body"}. --until
// TYPE exits 0 after printing the first event of that record type (for the acquired lease, if any).
// The session's close is printed as {"op": "closed", "code", "reason"}.
import readline from "node:readline";

const [url, apiKey, ...rest] = process.argv.slice(2);
const option = (name) => {
  const i = rest.indexOf(name);
  return i >= 0 ? rest[i + 1] : undefined;
};
const acquire = option("--acquire");
const until = option("--until");
const timeout = Number(option("--timeout") ?? "30");
const print = (value) => process.stdout.write(JSON.stringify(value) + "\n");

setTimeout(() => {
  print({ op: "timeout", seconds: timeout });
  process.exit(3);
}, timeout * 1000).unref();

let lease = null;
const ws = new WebSocket(url.replace(/^http/, "ws") + "/v1/session");

ws.onopen = () => ws.send(JSON.stringify({ op: "auth", api_key: apiKey }));

ws.onmessage = async (message) => {
  const frame = JSON.parse(message.data);
  print(frame);
  if (frame.op === "hello") {
    readline.createInterface({ input: process.stdin }).on("line", (line) => {
      if (line.trim()) ws.send(line);
    });
    if (acquire !== undefined) {
      const answer = await fetch(url + "/v1/leases/acquire", {
        method: "POST",
        headers: { authorization: `Bearer ${apiKey}`, "content-type": "application/json" },
        body: JSON.stringify({ resource: acquire, ttl: 30 }),
      });
      const body = await answer.json();
      if (answer.status === 200) lease = body;
      print({ op: "acquired", status: answer.status, body });
    }
  } else if (frame.op === "event" && until !== undefined && frame.record.type === until &&
             (lease === null || (frame.record.resource === lease.resource && frame.record.token === lease.token))) {
    process.exit(0);
  }
};

ws.onclose = (event) => {
  print({ op: "closed", code: event.code, reason: event.reason });
  process.exit(until === undefined ? 0 : 4);
};

ws.onerror = (event) => print({ op: "ws_error", message: String(event.message ?? event.type) });
