// The SDK against a real sandbox-gateway over two real sandboxd nodes (gVisor): sandboxes through the gateway,
// services, jobs, agent runs, secrets, SSH keys and access, API keys (tokens), and the gateway's errors.
import assert from "node:assert/strict";
import { generateKeyPairSync } from "node:crypto";
import { after, before, describe, test } from "node:test";

import {
  BadGateway,
  Client,
  Conflict,
  FetchTransport,
  InvalidRequest,
  NotFound,
  NotServed,
  Refused,
  Sandbox,
  Unauthorized,
  Unavailable,
  Unsupported,
  type WebSocketClass,
  resolveEndpoint,
} from "@sbx/sdk";
import { WebSocket as WsWebSocket } from "ws";

import { decode, env, rejectsWith, runExample, waitFor } from "./helpers.js";

const T = { timeout: 300_000 };
let admin: Client;
let alice: Client;
let reader: Client;

before(() => {
  const url = env("SBX_TEST_GATEWAY_URL");
  admin = new Client({ url, token: env("SBX_TEST_GATEWAY_ADMIN_KEY") });
  alice = new Client({ url, token: env("SBX_TEST_GATEWAY_KEY") });
  reader = new Client({ url, token: env("SBX_TEST_GATEWAY_READER_KEY") });
});

after(async () => {
  for (const c of [admin, alice, reader]) await c.close();
});

/** An OpenSSH public key line of a fresh ed25519 key. */
function publicKeyLine(comment: string): string {
  const { publicKey } = generateKeyPairSync("ed25519");
  const raw = Buffer.from(publicKey.export({ format: "jwk" }).x!, "base64url");
  const field = (b: Buffer): Buffer => Buffer.concat([Buffer.from([0, 0, 0, b.length]), b]);
  return `ssh-ed25519 ${Buffer.concat([field(Buffer.from("ssh-ed25519")), field(raw)]).toString("base64")} ${comment}`;
}

describe("sandboxes through the gateway", () => {
  test("whoami, create, run, attach over the WebSocket with the key in a header, terminate", T, async () => {
    assert.equal((await alice.health()).status, "ok");
    const me = await alice.whoami();
    assert.deepEqual([me.user, me.tenant], ["alice", "acme"]);
    const s = await alice.sandboxes.create({ labels: { suite: "sdk-typescript" } });
    try {
      assert.equal(decode((await s.run(["echo", "via gateway"])).stdout), "via gateway\n");
      const proc = await s.startProcess(["sh", "-c", "read x; echo got $x; exit 5"]);
      const attached = await proc.attach();
      await attached.writeStdin("it\n");
      let out = "";
      for await (const f of attached) if (f.type === "o") out += decode(f.payload);
      assert.deepEqual([out, attached.exitCode], ["got it\n", 5]);
      assert.deepEqual((await alice.sandboxes.list({ suite: "sdk-typescript" })).map((x) => x.id), [s.id]);
      await rejectsWith(reader.sandboxes.create({}), Refused, "sandbox:create");
    } finally {
      await s.terminate();
    }
    await rejectsWith(alice.images.list(), Unsupported, "");
    await rejectsWith(new Client({ url: env("SBX_TEST_GATEWAY_URL"), token: "sgk_wrong" }).sandboxes.list(), Unauthorized, "");
  });
});

describe("the browser's way: fetch and a standard WebSocket", () => {
  // What a browser runs: FetchTransport (the global fetch) and a WebSocket of the standard interface, here the
  // `ws` package's class used exactly as a browser's (no headers: the key offered as a subprotocol).
  const browserClient = (token: string): Client =>
    new Client({
      transport: new FetchTransport(resolveEndpoint(env("SBX_TEST_GATEWAY_URL"), token)),
      WebSocket: WsWebSocket as unknown as WebSocketClass,
    });

  test("create, run, files, followed output, attach with the key as a subprotocol, errors", T, async () => {
    const browser = browserClient(env("SBX_TEST_GATEWAY_KEY"));
    const s = await browser.sandboxes.create({ labels: { suite: "sdk-typescript-browser" } });
    try {
      assert.equal(decode((await s.run(["cat"], { stdin: "from fetch" })).stdout), "from fetch");
      await s.files.write("/sandbox/home/b.txt", new Uint8Array([0, 1, 2, 255]));
      assert.deepEqual([...(await s.files.read("/sandbox/home/b.txt"))], [0, 1, 2, 255]);
      const proc = await s.startProcess(["sh", "-c", "echo a; sleep 1; echo b; read x; echo got $x; exit 6"]);
      const followed: string[] = [];
      for await (const chunk of proc.output()) {
        followed.push(decode(chunk.data));
        if (followed.join("").includes("b\n")) break;
      }
      assert.equal(followed.join(""), "a\nb\n");
      const attached = await proc.attach();
      await attached.writeStdin("over a browser socket\n");
      let out = "";
      for await (const f of attached) if (f.type === "o") out += decode(f.payload);
      assert.deepEqual([out, attached.exitCode], ["a\nb\ngot over a browser socket\n", 6]);
      await rejectsWith(browser.sandboxes.get("sbx_nope"), NotFound, "");
      await rejectsWith(s.tunnel(8080), Unsupported, "browser");
      await rejectsWith(s.attach(999_999), NotFound, "999999");
      const stranger = browserClient("sgk_wrong");
      await rejectsWith(stranger.sandboxes.list(), Unauthorized, "");
      // A browser hides why a WebSocket was refused: the SDK asks the same resource plainly and throws its error.
      await rejectsWith(new Sandbox(stranger, s.info).attach(proc.pid), Unauthorized, "");
    } finally {
      await s.terminate();
    }
    assert.throws(() => new FetchTransport(resolveEndpoint("unix:///run/sandboxd.sock")), InvalidRequest);
  });
});

describe("services", () => {
  test("create, get, list, update (a rollout), scale, delete", T, async () => {
    const spec = { name: "ts-api", command: ["sleep", "infinity"], replicas: 1 };
    const created = await alice.services.create(spec);
    assert.deepEqual([created.spec.name, created.tenant], ["ts-api", "acme"]);
    try {
      await rejectsWith(alice.services.create(spec), Conflict, "ts-api");
      await waitFor(async () => (await alice.services.get("ts-api")).ready === 1, "one ready replica", 180_000);
      assert.ok((await alice.services.list()).some((s) => s.spec.name === "ts-api"));
      const updated = await alice.services.update({ ...spec, env: { MODE: "two" } });
      assert.ok(updated.revision > created.revision, `${updated.revision} after ${created.revision}`);
      assert.deepEqual(updated.env_names, ["MODE"]);
      assert.equal((await alice.services.scale("ts-api", 2)).desired, 2);
      await waitFor(async () => (await alice.services.get("ts-api")).ready === 2, "two ready replicas", 180_000);
      assert.equal((await admin.services.get("ts-api", "acme")).spec.name, "ts-api");
      await rejectsWith(alice.services.scale("ts-api", 1000), InvalidRequest, "");
      await rejectsWith(alice.services.create({ name: "Bad Name" }), InvalidRequest, "");
    } finally {
      await alice.services.delete("ts-api");
    }
    await rejectsWith(alice.services.get("ts-api"), NotFound, "ts-api");
  });
});

describe("jobs and agent runs", () => {
  test("a job: its output and kept file; list; a cancel; a bad spec", T, async () => {
    const job = await alice.jobs.create({
      name: "ts-job",
      command: ["sh", "-c", "echo out; echo err >&2; echo kept > /sandbox/home/f"],
      keep: { files: ["/sandbox/home/f"] },
    });
    const done = await alice.jobs.wait(job.id, { timeoutMs: 240_000, pollMs: 300 });
    assert.equal(done.state, "succeeded", JSON.stringify(done));
    const output = await alice.jobs.output(job.id, 1);
    assert.deepEqual([decode(output.stdout), decode(output.stderr), output.truncated], ["out\n", "err\n", false]);
    assert.equal(decode(await alice.jobs.file(job.id, 1, "/sandbox/home/f")), "kept\n");
    assert.ok((await alice.jobs.list()).some((j) => j.id === job.id));
    const long = await alice.jobs.create({ command: ["sleep", "300"] });
    assert.equal((await alice.jobs.cancel(long.id)).state, "cancelled");
    assert.equal((await alice.jobs.wait(long.id, { timeoutMs: 120_000 })).state, "cancelled");
    await rejectsWith(alice.jobs.create({ command: [] }), InvalidRequest, "command");
    await rejectsWith(alice.jobs.get("job_nope"), NotFound, "");
  });

  test("an agent run with a secret: the prompt in, the result out", T, async () => {
    await alice.secrets.set("AGENT_KEY", "agent-secret-value");
    const [shouter] = (await alice.jobs.agents()).filter((a) => a.name === "shouter");
    assert.ok(shouter, "the agents file's shouter is listed");
    assert.deepEqual([shouter.secrets, shouter.timeout_secs], [["AGENT_KEY"], 120]);
    const job = await alice.jobs.agentRun({ agent: "shouter", prompt: "hello agent", keep: { files: ["/sandbox/home/result.txt"] } });
    const done = await alice.jobs.wait(job.id, { timeoutMs: 240_000, pollMs: 300 });
    assert.equal(done.state, "succeeded", JSON.stringify(done));
    assert.equal(decode((await alice.jobs.output(job.id, 1)).stdout), "agent read 11 chars; key present\n");
    assert.equal(decode(await alice.jobs.file(job.id, 1, "/sandbox/home/result.txt")), "HELLO AGENT");
    await rejectsWith(alice.jobs.agentRun({ agent: "nobody", prompt: "x" }), InvalidRequest, "nobody");
  });
});

describe("secrets, SSH keys, API keys", () => {
  test("secrets: set, listed by name only, delete", T, async () => {
    await alice.secrets.set("TS_SECRET", "s3cr3t-value");
    const listed = await alice.secrets.list();
    assert.ok(listed.some((s) => s.name === "TS_SECRET"));
    assert.ok(!JSON.stringify(listed).includes("s3cr3t-value"));
    await alice.secrets.delete("TS_SECRET");
    assert.ok(!(await alice.secrets.list()).some((s) => s.name === "TS_SECRET"));
    await rejectsWith(alice.secrets.delete("TS_SECRET"), NotFound, "TS_SECRET");
    await rejectsWith(reader.secrets.set("X", "y"), Refused, "secrets:write");
    await rejectsWith(alice.secrets.set("bad name", "y"), InvalidRequest, "");
  });

  test("SSH: the server's keys, add a public key, access to a sandbox, remove", T, async () => {
    const made = await admin.keys.create("alice", ["sandbox:read", "sandbox:create", "sandbox:delete", "sandbox:ssh"], "acme");
    const ssh = new Client({ url: env("SBX_TEST_GATEWAY_URL"), token: made.secret });
    try {
      await rejectsWith(alice.ssh.addKey(publicKeyLine("no@scope")), Refused, "sandbox:ssh");
      const info = await ssh.ssh.info();
      assert.ok(info.port > 0 && info.host_keys.length > 0 && info.fingerprint.startsWith("SHA256:"), JSON.stringify(info));
      const key = await ssh.ssh.addKey(publicKeyLine("ts@test"));
      assert.match(key.fingerprint, /^SHA256:/);
      assert.ok((await ssh.ssh.keys()).some((k) => k.id === key.id));
      await rejectsWith(ssh.ssh.addKey("ssh-ed25519 notbase64"), InvalidRequest, "");
      const s = await ssh.sandboxes.create({});
      try {
        const access = await ssh.ssh.access(s.id, 120);
        assert.ok(access.command.includes("ssh") && access.port === info.port, JSON.stringify(access));
      } finally {
        await s.terminate();
      }
      await ssh.ssh.removeKey(key.id);
      await rejectsWith(ssh.ssh.removeKey(key.id), NotFound, "");
    } finally {
      await ssh.close();
      await admin.keys.revoke(made.id);
    }
    const plain = new Client({ url: env("SBX_TEST_PLAIN_GATEWAY_URL"), token: env("SBX_TEST_PLAIN_GATEWAY_KEY") });
    try {
      const err = await rejectsWith(plain.ssh.info(), NotServed, "--ssh-listen");
      assert.ok(err instanceof NotFound);
    } finally {
      await plain.close();
    }
  });

  test("API keys: an admin creates one, it works, it is listed, revoked it is refused", T, async () => {
    const made = await admin.keys.create("ts-user", ["sandbox:read"], "acme");
    assert.ok(made.secret.length > 20);
    const client = new Client({ url: env("SBX_TEST_GATEWAY_URL"), token: made.secret });
    try {
      assert.deepEqual([(await client.whoami()).user, (await client.whoami()).key_id], ["ts-user", made.id]);
      const listed = await admin.keys.list();
      assert.ok(listed.some((k) => k.id === made.id));
      assert.ok(!JSON.stringify(listed).includes(made.secret));
      await rejectsWith(alice.keys.list(), Refused, "admin");
      await admin.keys.revoke(made.id);
      await rejectsWith(client.whoami(), Unauthorized, "");
      await rejectsWith(admin.keys.create("x", ["no:such"]), InvalidRequest, "no:such");
    } finally {
      await client.close();
    }
  });
});

describe("revocation", () => {
  test("revoking the key cuts its attach stream: Unavailable, not a quiet end; its calls are Unauthorized", T, async () => {
    const made = await admin.keys.create("alice", ["sandbox:read", "sandbox:create", "sandbox:delete"], "acme");
    const doomed = new Client({ url: env("SBX_TEST_GATEWAY_URL"), token: made.secret });
    const s = await alice.sandboxes.create({});
    try {
      const proc = await s.startProcess(["sh", "-c", "echo attached; sleep 300"]);
      const attached = await (await doomed.sandboxes.get(s.id)).attach(proc.pid);
      assert.equal(decode((await attached.recv())!.payload), "attached\n");
      await admin.keys.revoke(made.id);
      await rejectsWith(attached.recv(), Unavailable, "ended before the process exited");
      await rejectsWith(doomed.sandboxes.get(s.id), Unauthorized, "");
      assert.equal((await alice.sandboxes.get(s.id)).state, "running");
      await proc.kill();
    } finally {
      await s.terminate();
      await doomed.close();
    }
  });
});

describe("organisations", () => {
  test("the org option acts in an organisation: calls and attach carry X-Sandbox-Org", T, async () => {
    const crud = ["sandbox:read", "sandbox:create", "sandbox:delete"];
    const made = await admin.keys.create("olga", [...crud, "org:create"]);
    const url = env("SBX_TEST_GATEWAY_URL");
    const olga = new Client({ url, token: made.secret });
    const inOrg = new Client({ url, token: made.secret, org: "tsorg" });
    try {
      await rejectsWith(inOrg.whoami(), NotFound, "organization");
      await olga.call("POST", "/v1/orgs", { json: { name: "tsorg" } });
      assert.equal((await inOrg.whoami()).org, "tsorg");
      const s = await inOrg.sandboxes.create({});
      try {
        assert.equal(s.info.labels["gateway.tenant"], "tsorg");
        await rejectsWith(olga.sandboxes.get(s.id), NotFound, s.id);
        const proc = await s.startProcess(["sh", "-c", "echo in the org; exit 4"]);
        const attached = await proc.attach();
        let out = "";
        for await (const f of attached) if (f.type === "o") out += decode(f.payload);
        assert.deepEqual([out, attached.exitCode], ["in the org\n", 4]);
      } finally {
        await s.terminate();
      }
    } finally {
      await olga.close();
      await inOrg.close();
      await admin.keys.revoke(made.id);
    }
  });
});

describe("a node that does not answer", () => {
  test("BadGateway naming the node", T, async () => {
    const plain = new Client({ url: env("SBX_TEST_PLAIN_GATEWAY_URL"), token: env("SBX_TEST_PLAIN_GATEWAY_KEY") });
    try {
      const s = await plain.sandboxes.create({});
      process.kill(Number(env("SBX_TEST_PLAIN_NODE_PID")), "SIGKILL");
      await rejectsWith(s.run(["true"]), BadGateway, "did not answer");
    } finally {
      await plain.close();
    }
  });
});

describe("the examples of docs/sdk-typescript.md", () => {
  test("gateway-job", T, async () => {
    const out = await runExample("gateway-job", { SANDBOX_URL: env("SBX_TEST_GATEWAY_URL"), SANDBOX_TOKEN: env("SBX_TEST_GATEWAY_KEY") });
    assert.equal(out, "I am alice\nsucceeded done\nhello from a secret\n");
  });
});
