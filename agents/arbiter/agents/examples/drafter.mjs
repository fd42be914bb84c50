// The drafter agent in JavaScript, through a front door (arbiter serve): Node 18+, no package needed.
//
//   arbiter agents add drafter-js --allow doc:
//   KEY=$(arbiter agents api-key drafter-js)
//   node drafter.mjs http://127.0.0.1:8080 "$KEY" doc:launch-plan "Timeline"
//
// It leases the document (waiting its turn), reads its version, commits its section on that
// version with the lease's token, and gives the lease back. Every answer is a JSON object; a
// refusal carries a stable "reason" and "what_to_do".

const [door = "http://127.0.0.1:8080", key = process.env.ARBITER_API_KEY, doc = "doc:launch-plan",
       section = "Timeline"] = process.argv.slice(2);

async function call(method, path, body) {
  const answer = await fetch(door + path, {
    method,
    headers: { authorization: `Bearer ${key}`, "content-type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const json = await answer.json();
  if (!answer.ok) throw Object.assign(new Error(`${answer.status} ${json.reason}: ${json.what_to_do ?? json.detail}`), { json });
  return json;
}

const lease = await call("POST", "/v1/leases/acquire", { resource: doc, ttl: 30, wait: 60 });
try {
  const { version } = await call("GET", `/v1/resources/${encodeURIComponent(doc)}`);
  const patch = { sections: { [section]: `${section}, drafted in JavaScript` } };
  const written = await call("POST", "/v1/commit", { resource: doc, base_version: version, patch, token: lease.token });
  console.log(JSON.stringify({ applied: written.applied, version: written.version }));
} finally {
  await call("POST", "/v1/leases/release", { resource: doc, token: lease.token });
}
