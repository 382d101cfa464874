// `sandbox.ports` without a server of ours: a local HTTP server answering the exposed-ports endpoints as
// docs/openapi.yaml describes them, through both transports. The real gateway: test/ports-gateway.test.ts.
import assert from "node:assert/strict";
import { once } from "node:events";
import { type IncomingMessage, type ServerResponse, createServer } from "node:http";
import type { AddressInfo } from "node:net";
import { test } from "node:test";

import * as sdk from "@sbx/sdk";

import { rejectsWith } from "./helpers.js";

const KEY = "sbxk_owner";
const ID = "sbx_0123456789abcdef";
const SANDBOX = {
  id: ID, name: "web", state: "running", image: "default", cpus: 1, memory_mb: 512, disk_mb: 2048, env_names: [],
  network: { mode: "none", deny: [] }, labels: {}, idle_timeout_secs: 600, snapshot_every_secs: 0, snapshot_keep: 0,
  created_at: "2024-05-01T12:00:00.000Z", persistent: false,
};

/** A gateway's ports endpoints: 8000 listens; `serving` false answers 501 as a gateway without --ports-domain. */
async function portsGateway(serving = true) {
  const seen: Array<[string, string, unknown]> = [];
  const pub = new Set<number>();
  const url = (port: number) => `http://${port}-0123456789abcdef.ports.test/`;
  const body = (port: number) => ({ port, url: url(port), public: pub.has(port), listening: port === 8000 });
  const send = (res: ServerResponse, status: number, value: unknown) =>
    res.writeHead(status, { "Content-Type": "application/json" }).end(JSON.stringify(value));
  const error = (res: ServerResponse, status: number, code: string, message: string) => send(res, status, { error: { code, message } });
  const server = createServer(async (req: IncomingMessage, res: ServerResponse) => {
    let text = "";
    for await (const chunk of req) text += chunk;
    const json = text ? JSON.parse(text) : undefined;
    seen.push([req.method!, req.url!, json]);
    if (req.headers.authorization !== `Bearer ${KEY}`) return error(res, 401, "unauthorized", "a valid API key is required");
    if (req.url === `/v1/sandboxes/web`) return send(res, 200, SANDBOX);
    const m = /^\/v1\/sandboxes\/([^/]+)\/ports(?:\/(\d+))?(\/tokens)?$/.exec(req.url!);
    if (!m || m[1] !== ID) return error(res, 404, "not_found", `no route ${req.url}`);
    if (!serving) return error(res, 501, "unsupported", "exposed ports are off: start the gateway with --ports-domain DOMAIN");
    const port = Number(m[2]);
    if (!m[2]) return send(res, 200, { ports: [...new Set([8000, ...pub])].sort((a, b) => a - b).map(body) });
    if (m[3]) {
      const ttl = json.ttl_secs ?? 3600;
      return send(res, 201, { token: `sbxp_${ttl}`, url: `${url(port)}?sbx_port_token=sbxp_${ttl}`, expires_at: "2030-01-01T00:00:00Z" });
    }
    if (req.method === "PUT") {
      if (json.public) pub.add(port);
      else pub.delete(port);
    }
    return send(res, 200, body(port));
  });
  server.listen(0, "127.0.0.1");
  await once(server, "listening");
  const address = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
  return { address, seen, pub, url, close: () => { server.closeAllConnections(); server.close(); } };
}

for (const [name, transport] of [
  ["NodeTransport", (url: string) => new sdk.NodeTransport(sdk.resolveEndpoint(url, KEY, {}))],
  ["FetchTransport (browsers)", (url: string) => new sdk.FetchTransport(sdk.resolveEndpoint(url, KEY, {}))],
] as const) {
  test(`${name}: ports list, get, url, public, token build the spec's requests`, async () => {
    const gw = await portsGateway();
    const client = new sdk.Client({ url: gw.address, token: KEY, transport: transport(gw.address) });
    try {
      const sandbox = await client.sandboxes.get("web");
      assert.deepEqual(await sandbox.ports.list(), [{ port: 8000, url: gw.url(8000), public: false, listening: true }]);
      assert.deepEqual(await sandbox.ports.get(9000), { port: 9000, url: gw.url(9000), public: false, listening: false });
      assert.equal(await sandbox.ports.url(8000), gw.url(8000));
      assert.equal((await sandbox.ports.public(9000, true)).public, true);
      assert.deepEqual((await sandbox.ports.list()).map((p) => p.port), [8000, 9000]);
      assert.equal((await sandbox.ports.public(9000, false)).public, false);
      const token = await sandbox.ports.token(8000, 600);
      assert.deepEqual(token, { token: "sbxp_600", url: `${gw.url(8000)}?sbx_port_token=sbxp_600`, expires_at: "2030-01-01T00:00:00Z" });
      assert.equal((await sandbox.ports.token(8000)).token, "sbxp_3600");
      const ports = `/v1/sandboxes/${ID}/ports`;
      assert.deepEqual(gw.seen.slice(1), [
        ["GET", ports, undefined],
        ["GET", `${ports}/9000`, undefined],
        ["GET", `${ports}/8000`, undefined],
        ["PUT", `${ports}/9000`, { public: true }],
        ["GET", ports, undefined],
        ["PUT", `${ports}/9000`, { public: false }],
        ["POST", `${ports}/8000/tokens`, { ttl_secs: 600 }],
        ["POST", `${ports}/8000/tokens`, {}],
      ]);
    } finally {
      await client.close();
      gw.close();
    }
  });
}

test("ports: bad arguments are InvalidRequest before sending; no --ports-domain is Unsupported", async () => {
  const gw = await portsGateway(false);
  const client = new sdk.Client({ url: gw.address, token: KEY });
  try {
    const sandbox = await client.sandboxes.get("web");
    const sent = gw.seen.length;
    await rejectsWith(sandbox.ports.get(0), sdk.InvalidRequest, "port 0: give a TCP port number, 1 to 65535");
    await rejectsWith(sandbox.ports.url(65536), sdk.InvalidRequest, "port 65536");
    await rejectsWith(sandbox.ports.url(80.5), sdk.InvalidRequest, "port 80.5");
    await rejectsWith(sandbox.ports.token(80, 0), sdk.InvalidRequest, "ttlSecs 0: give 1 to 86400 seconds");
    await rejectsWith(sandbox.ports.token(80, 86401), sdk.InvalidRequest, "ttlSecs 86401");
    await rejectsWith(sandbox.ports.public(80, "yes" as unknown as boolean), sdk.InvalidRequest, 'public "yes"');
    assert.equal(gw.seen.length, sent);
    await rejectsWith(sandbox.ports.list(), sdk.Unsupported, "--ports-domain");
    await rejectsWith(sandbox.ports.token(8000), sdk.Unsupported, "--ports-domain");
  } finally {
    await client.close();
    gw.close();
  }
});
