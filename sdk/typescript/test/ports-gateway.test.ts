// `sandbox.ports` against a real sandbox-gateway run with --ports-domain over a real sandboxd (started by
// tests/integration/test_sdk_typescript.py, with a guest server listening on SBX_TEST_PORTS_PORT). Port URLs are
// opened on loopback only: a lookup that answers 127.0.0.1 for every name under the ports domain.
import assert from "node:assert/strict";
import { type IncomingMessage, request } from "node:http";
import { test } from "node:test";

import { Client, InvalidRequest, NotFound } from "@sbx/sdk";

import { env, rejectsWith } from "./helpers.js";

const URL_ = env("SBX_TEST_PORTS_GATEWAY_URL");
const KEY = env("SBX_TEST_PORTS_KEY");
const OTHER = env("SBX_TEST_PORTS_OTHER_KEY");
const SANDBOX = env("SBX_TEST_PORTS_SANDBOX");
const PORT = Number(env("SBX_TEST_PORTS_PORT"));
const EXPECTED = env("SBX_TEST_PORTS_URL");
const PAGE = "hello from the guest";

/** Every name resolves to loopback: nothing leaves this machine whatever the URL says. */
const loopback = (_host: string, options: unknown, callback: (...args: unknown[]) => void): void => {
  if ((options as { all?: boolean }).all) callback(null, [{ address: "127.0.0.1", family: 4 }]);
  else callback(null, "127.0.0.1", 4);
};

/** One GET of `url` (redirects not followed): status, headers, body. */
function get(url: string, headers: Record<string, string> = {}): Promise<{ status: number; headers: IncomingMessage["headers"]; body: string }> {
  return new Promise((resolve, reject) => {
    const req = request(url, { headers, lookup: loopback as never }, (res) => {
      let body = "";
      res.setEncoding("utf8");
      res.on("data", (chunk: string) => (body += chunk));
      res.on("end", () => resolve({ status: res.statusCode ?? 0, headers: res.headers, body }));
    });
    req.on("error", reject);
    req.end();
  });
}

test("ports: list, url, token opened as a browser does, public and private again", async () => {
  const client = new Client({ url: URL_, token: KEY });
  try {
    const sandbox = await client.sandboxes.get(SANDBOX);
    const listed = (await sandbox.ports.list()).find((p) => p.port === PORT);
    assert.deepEqual(listed, { port: PORT, url: EXPECTED, public: false, listening: true });
    assert.equal(await sandbox.ports.url(PORT), EXPECTED);
    assert.equal((await get(EXPECTED)).status, 401);

    const link = await sandbox.ports.token(PORT, 120);
    assert.ok(link.url.startsWith(EXPECTED) && link.url.includes(link.token), link.url);
    const traded = await get(link.url);
    assert.ok([302, 303, 307].includes(traded.status), `${traded.status} ${traded.body}`);
    const cookie = String(traded.headers["set-cookie"]?.[0] ?? "").split(";")[0] ?? "";
    assert.ok(cookie.includes("="), JSON.stringify(traded.headers));
    const page = await get(EXPECTED, { Cookie: cookie });
    assert.equal(page.status, 200);
    assert.ok(page.body.includes(PAGE), page.body.slice(0, 200));

    assert.equal((await sandbox.ports.public(PORT, true)).public, true);
    const open = await get(EXPECTED);
    assert.ok(open.status === 200 && open.body.includes(PAGE));
    assert.equal((await sandbox.ports.public(PORT, false)).public, false);
    assert.equal((await get(EXPECTED)).status, 401);

    await rejectsWith(sandbox.ports.token(PORT, 0), InvalidRequest, "ttlSecs 0");
  } finally {
    await client.close();
  }
});

test("ports: another user's key finds no such sandbox", async () => {
  const client = new Client({ url: URL_, token: OTHER });
  try {
    await rejectsWith(client.sandboxes.get(SANDBOX), NotFound, SANDBOX);
  } finally {
    await client.close();
  }
});
