// What needs no server: the error tree, the framing, endpoints, and that the generated types match the API
// description.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { once } from "node:events";
import { type IncomingMessage, type ServerResponse, createServer } from "node:http";
import type { AddressInfo } from "node:net";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import * as sdk from "@sbx/sdk";
import { frames } from "@sbx/sdk";

const PACKAGE = join(dirname(fileURLToPath(import.meta.url)), "..", "..");

test("the generated types are those of docs/openapi.yaml (npm run generate remakes them)", () => {
  const dir = mkdtempSync(join(tmpdir(), "sbx-ts-gen-"));
  try {
    const out = join(dir, "openapi.ts");
    execFileSync(process.execPath, [join(PACKAGE, "node_modules/openapi-typescript/bin/cli.js"), join(PACKAGE, "../../docs/openapi.yaml"), "-o", out], {
      stdio: "pipe",
    });
    const fresh = readFileSync(out, "utf8");
    const kept = readFileSync(join(PACKAGE, "src/generated/openapi.ts"), "utf8");
    assert.ok(fresh.includes("export interface paths"), "the generator wrote no paths");
    assert.ok(fresh === kept, "src/generated/openapi.ts is stale: run `npm run generate` in sdk/typescript and commit it");
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

// The spec's Errors table: class, status, code, parent.
const TABLE: Array<[new (m: string) => sdk.SandboxError, number, string, Function]> = [
  [sdk.InvalidRequest, 400, "invalid_request", sdk.SandboxError],
  [sdk.Unauthorized, 401, "unauthorized", sdk.SandboxError],
  [sdk.Refused, 403, "refused", sdk.SandboxError],
  [sdk.ForbiddenOrigin, 403, "forbidden_origin", sdk.SandboxError],
  [sdk.NotFound, 404, "not_found", sdk.SandboxError],
  [sdk.NotServed, 404, "unsupported", sdk.NotFound],
  [sdk.Conflict, 409, "conflict", sdk.SandboxError],
  [sdk.PayloadTooLarge, 413, "invalid_request", sdk.SandboxError],
  [sdk.Unsupported, 501, "unsupported", sdk.SandboxError],
  [sdk.Unavailable, 503, "unavailable", sdk.SandboxError],
  [sdk.BadGateway, 502, "internal", sdk.SandboxError],
  [sdk.GatewayTimeout, 504, "internal", sdk.BadGateway],
  [sdk.Internal, 500, "internal", sdk.SandboxError],
];

test("every error class carries its status, code and message, and is rebuilt from its wire body", () => {
  assert.equal(sdk.ERROR_CLASSES.length, TABLE.length);
  for (const [cls, status, code, parent] of TABLE) {
    const made = new cls("what to change");
    assert.ok(made instanceof parent && made instanceof sdk.SandboxError && made instanceof Error, cls.name);
    assert.deepEqual([made.name, made.status, made.code, made.message], [cls.name, status, code, "what to change"]);
    assert.equal(String(made), `${code}: what to change`);
    assert.deepEqual(made.toBody(), { error: { code, message: "what to change" } });
    const rebuilt = sdk.errorFromWire(status, { error: { code, message: "m" } });
    assert.equal(rebuilt.constructor, cls, `${status} ${code}`);
    assert.deepEqual([rebuilt.status, rebuilt.code, rebuilt.message], [status, code, "m"]);
  }
});

test("an answer the tree does not know keeps its status and code; a body that is not JSON names the status", () => {
  const teapot = sdk.errorFromWire(418, { error: { code: "conflict", message: "short and stout" } });
  assert.ok(teapot instanceof sdk.Conflict);
  assert.deepEqual([teapot.status, teapot.code, teapot.message], [418, "conflict", "short and stout"]);
  const odd = sdk.errorFromWire(429, { error: { code: "slow_down", message: "later" } });
  assert.ok(odd instanceof sdk.Internal);
  assert.deepEqual([odd.status, odd.code], [429, "slow_down"]);
  const html = sdk.errorFromAnswer(502, new TextEncoder().encode("<html>proxy</html>"));
  assert.ok(html instanceof sdk.BadGateway);
  assert.equal(html.message, "HTTP 502");
});

test("frames: encode, decode across splits, signals, resize, exit and the limits", () => {
  const wire = sdk.frames.encodeFrame("o", new TextEncoder().encode("hi"));
  assert.deepEqual([...wire], [0x6f, 0, 0, 0, 2, 0x68, 0x69]);
  const decoder = new frames.FrameDecoder(frames.SERVER_TYPES);
  const exit = new Uint8Array([0x78, 0, 0, 0, 4, 0xff, 0xff, 0xff, 0xfd]);
  const stream = new Uint8Array([...wire, ...exit]);
  const got = [...decoder.feed(stream.subarray(0, 3)), ...decoder.feed(stream.subarray(3, 8)), ...decoder.feed(stream.subarray(8))];
  assert.deepEqual(got.map((f) => f.type), ["o", "x"]);
  assert.equal(frames.decodeExit(got[1]!.payload), -3);
  assert.equal(decoder.pendingBytes, 0);
  assert.deepEqual([...frames.signalFrame("SIGTERM")], [0x73, 0, 0, 0, 4, ...new TextEncoder().encode("TERM")]);
  assert.throws(() => frames.signalFrame("STOP"), sdk.InvalidRequest);
  assert.deepEqual([...frames.resizeFrame(30, 100)], [0x72, 0, 0, 0, 4, 0, 30, 0, 100]);
  assert.throws(() => frames.resizeFrame(0, 80), sdk.InvalidRequest);
  assert.throws(() => new frames.FrameDecoder(frames.SERVER_TYPES).feed(new Uint8Array([0x69, 0, 0, 0, 0])), sdk.InvalidRequest);
  assert.throws(() => new frames.FrameDecoder().feed(new Uint8Array([0x6f, 0, 0x20, 0, 0])), /limit/);
  const big = frames.encodeChunks("i", new Uint8Array(frames.MAX_PAYLOAD_BYTES + 1));
  assert.deepEqual(big.map((f) => f.length - 5), [frames.MAX_PAYLOAD_BYTES, 1]);
});

test("endpoints: the accepted forms, the environment, and no credentials in a URL", () => {
  assert.deepEqual(sdk.resolveEndpoint(undefined, undefined, {}), { baseUrl: "http://localhost", socketPath: "/run/sandboxd.sock" });
  assert.deepEqual(sdk.resolveEndpoint("unix:///tmp/s.sock", "t", {}), { baseUrl: "http://localhost", socketPath: "/tmp/s.sock", token: "t" });
  assert.deepEqual(sdk.resolveEndpoint(undefined, undefined, { SANDBOX_URL: "https://gw.example:8443/", SANDBOX_TOKEN: "k" }), {
    baseUrl: "https://gw.example:8443",
    token: "k",
  });
  for (const bad of ["ftp://x", "unix:", "gw.example:80", "https://user:secret@gw.example", "http://h/?key=secret"]) {
    assert.throws(() => sdk.resolveEndpoint(bad, undefined, {}), sdk.InvalidRequest, bad);
  }
  try {
    sdk.resolveEndpoint("https://user:hunter2@gw.example", undefined, {});
  } catch (err) {
    assert.ok(!(err as Error).message.includes("hunter2"), "the refusal repeats the secret");
  }
  assert.equal(sdk.displayEndpoint(sdk.resolveEndpoint("http://h:1", "secret-key", {})), "http://h:1");
});

test("failures to reach a server are Unavailable naming the address and never the key", async () => {
  const client = new sdk.Client({ url: "unix:///nonexistent/sbx.sock", token: "sk-never-shown" });
  await assert.rejects(client.capabilities(), (err: unknown) => {
    assert.ok(err instanceof sdk.Unavailable);
    assert.match(err.message, /cannot reach sandboxd at unix:\/\/\/nonexistent\/sbx\.sock/);
    assert.ok(!err.message.includes("sk-never-shown"));
    return true;
  });
  await client.close();
});

test("docs/sdk-typescript.md shows every example as it is in examples/", () => {
  const doc = readFileSync(join(PACKAGE, "../../docs/sdk-typescript.md"), "utf8");
  const names = execFileSync("ls", [join(PACKAGE, "examples")], { encoding: "utf8" }).split("\n").filter((n) => n.endsWith(".ts"));
  assert.ok(names.length >= 5, names.join(" "));
  for (const name of names) {
    const source = readFileSync(join(PACKAGE, "examples", name), "utf8");
    assert.ok(doc.includes(`<!-- example: ${name} -->\n\`\`\`ts\n${source}\`\`\`\n`), `docs/sdk-typescript.md does not show examples/${name} as it is`);
  }
});

/** A local HTTP server answering each request with `answer`; records what it received. */
async function localServer(
  answer: (req: IncomingMessage, res: ServerResponse) => void,
): Promise<{ url: string; seen: Array<{ url: string; headers: IncomingMessage["headers"] }>; close: () => Promise<void> }> {
  const seen: Array<{ url: string; headers: IncomingMessage["headers"] }> = [];
  const server = createServer((req, res) => {
    seen.push({ url: req.url ?? "", headers: req.headers });
    answer(req, res);
  });
  server.listen(0, "127.0.0.1");
  await once(server, "listening");
  const { port } = server.address() as AddressInfo;
  return {
    url: `http://127.0.0.1:${port}`,
    seen,
    close: async () => {
      server.closeAllConnections();
      server.close();
    },
  };
}

const sendJson = (res: ServerResponse, status: number, body: unknown): void => {
  res.writeHead(status, { "Content-Type": "application/json" }).end(JSON.stringify(body));
};

for (const [name, transport] of [
  ["NodeTransport", (url: string, token: string) => new sdk.NodeTransport(sdk.resolveEndpoint(url, token, {}))],
  ["FetchTransport (browsers)", (url: string, token: string) => new sdk.FetchTransport(sdk.resolveEndpoint(url, token, {}))],
] as const) {
  test(`${name}: the key in Authorization only; answers the API cannot provoke (504, 500, not JSON, cut, silent)`, async () => {
    const server = await localServer((req, res) => {
      if (req.url!.startsWith("/v1/sandboxes/a")) sendJson(res, 504, { error: { code: "internal", message: "replica slow" } });
      else if (req.url!.startsWith("/v1/sandboxes/b")) sendJson(res, 500, { error: { code: "internal", message: "a bug" } });
      else if (req.url!.startsWith("/v1/sandboxes/c")) res.writeHead(200, { "Content-Type": "application/json" }).end("{not json");
      else if (req.url!.startsWith("/v1/sandboxes/d")) {
        res.writeHead(200, { "Content-Type": "application/json", "Content-Length": "100" });
        res.write("{");
        setTimeout(() => res.destroy(), 50);
      } else if (req.url!.startsWith("/v1/sandboxes/e/processes/1/output")) {
        res.writeHead(200, { "Content-Type": "application/x-ndjson" });
        res.write(JSON.stringify({ stream: "stdout", data: "aGkK" }) + "\n");
        setTimeout(() => res.destroy(), 50);
      } else if (req.url!.startsWith("/v1/capabilities")) {
        // never answers: the client's timeout ends it
      } else sendJson(res, 200, { id: "sbx_1", state: "running" });
    });
    const key = "sk-test-key-never-in-a-url";
    const client = new sdk.Client({ transport: transport(server.url, key) });
    const timed = new sdk.Client({ transport: name === "NodeTransport" ? new sdk.NodeTransport(sdk.resolveEndpoint(server.url, key, {}), { timeoutMs: 300 }) : new sdk.FetchTransport(sdk.resolveEndpoint(server.url, key, {}), { timeoutMs: 300 }) });
    try {
      await client.sandboxes.get("sbx_1");
      const first = server.seen.at(-1)!;
      assert.equal(first.headers["authorization"], `Bearer ${key}`);
      assert.ok(!first.url.includes(key), first.url);
      const timeout = await client.sandboxes.get("a").catch((e: unknown) => e);
      assert.ok(timeout instanceof sdk.GatewayTimeout && timeout instanceof sdk.BadGateway, String(timeout));
      assert.deepEqual([timeout.status, timeout.code, timeout.message], [504, "internal", "replica slow"]);
      const bug = await client.sandboxes.get("b").catch((e: unknown) => e);
      assert.ok(bug instanceof sdk.Internal);
      assert.deepEqual([bug.status, bug.code, bug.message], [500, "internal", "a bug"]);
      const garbled = await client.sandboxes.get("c").catch((e: unknown) => e);
      assert.ok(garbled instanceof sdk.Internal && /invalid JSON/.test(garbled.message), String(garbled));
      const cut = await client.sandboxes.get("d").catch((e: unknown) => e);
      assert.ok(cut instanceof sdk.Unavailable, String(cut));
      const proc = new sdk.Process(client, "e", { pid: 1, argv: ["x"], state: "running", exit_code: null, started_at: "" });
      const chunks: string[] = [];
      const ended = await (async () => {
        for await (const c of proc.output()) chunks.push(new TextDecoder().decode(c.data));
      })().catch((e: unknown) => e);
      assert.deepEqual(chunks, ["hi\n"]);
      assert.ok(ended instanceof sdk.Unavailable, String(ended));
      const silent = await timed.capabilities().catch((e: unknown) => e);
      assert.ok(silent instanceof sdk.Unavailable && /did not answer in time/.test(silent.message), String(silent));
      for (const request of server.seen) assert.ok(!request.url.includes(key));
    } finally {
      await client.close();
      await timed.close();
      await server.close();
    }
  });
}

test("persistent sandboxes: create sends persistent, stop() and resume() post to their paths and keep the answer", async () => {
  const seen: Array<{ method: string; url: string; body: unknown }> = [];
  const base = { id: "sbx_p1", name: "keeper", image: "default", persistent: true };
  const server = createServer((req, res) => {
    let raw = "";
    req.on("data", (chunk: Buffer) => (raw += chunk.toString("utf8")));
    req.on("end", () => {
      seen.push({ method: req.method ?? "", url: req.url ?? "", body: raw ? JSON.parse(raw) : null });
      if (req.method === "POST" && req.url === "/v1/sandboxes") sendJson(res, 201, { ...base, state: "running" });
      else if (req.url === "/v1/sandboxes/sbx_p1/stop") sendJson(res, 200, { ...base, state: "stopped", stopped_reason: "request" });
      else if (req.url === "/v1/sandboxes/sbx_p1/resume") sendJson(res, 200, { ...base, state: "running" });
      else if (req.url === "/v1/sandboxes/sbx_plain/stop") {
        sendJson(res, 409, { error: { code: "conflict", message: "sandbox sbx_plain is not persistent" } });
      } else sendJson(res, 404, { error: { code: "not_found", message: `no route ${req.url}` } });
    });
  });
  server.listen(0, "127.0.0.1");
  await once(server, "listening");
  const client = new sdk.Client({ url: `http://127.0.0.1:${(server.address() as AddressInfo).port}` });
  try {
    const box = await client.sandboxes.create({ name: "keeper", persistent: true });
    assert.deepEqual(seen.at(-1), { method: "POST", url: "/v1/sandboxes", body: { name: "keeper", persistent: true } });
    assert.deepEqual([box.state, box.persistent, box.stoppedReason], ["running", true, null]);
    const same = await box.stop();
    assert.equal(same, box, "stop() answers the sandbox itself, updated");
    assert.deepEqual(seen.at(-1), { method: "POST", url: "/v1/sandboxes/sbx_p1/stop", body: null });
    assert.deepEqual([box.state, box.persistent, box.stoppedReason], ["stopped", true, "request"]);
    await box.resume();
    assert.deepEqual(seen.at(-1), { method: "POST", url: "/v1/sandboxes/sbx_p1/resume", body: null });
    assert.deepEqual([box.state, box.stoppedReason], ["running", null]);
    const plain = new sdk.Sandbox(client, { ...base, id: "sbx_plain", state: "running", persistent: false } as sdk.SandboxInfo);
    assert.equal(plain.persistent, false);
    const refused = await plain.stop().catch((e: unknown) => e);
    assert.ok(refused instanceof sdk.Conflict, String(refused));
    assert.equal(refused.message, "sandbox sbx_plain is not persistent");
    assert.equal(plain.state, "running", "a refused stop leaves info as it was");
  } finally {
    await client.close();
    server.closeAllConnections();
    server.close();
  }
});
