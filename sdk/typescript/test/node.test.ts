// The SDK against a real sandboxd (gVisor sandboxes) over its unix socket, and a second one over HTTPS with a
// token: every call of sandboxes, processes, files, attach, suspend/resume, persistent sandboxes (stop, wake),
// snapshots, forks, volumes, metrics, events and images, and the errors each can give.
import assert from "node:assert/strict";
import { once } from "node:events";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { createConnection, createServer, type Socket } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";

import {
  Client,
  Conflict,
  ForbiddenOrigin,
  InvalidRequest,
  MAX_BUFFERED_BYTES,
  NodeTransport,
  NotFound,
  PayloadTooLarge,
  Refused,
  type Sandbox,
  Unauthorized,
  Unavailable,
  openAttachment,
  resolveEndpoint,
} from "@sbx/sdk";

import { decode, env, rejectsWith, runExample, waitFor } from "./helpers.js";

const T = { timeout: 300_000 };
const LABEL = { suite: "sdk-typescript" };
let client: Client;
let box: Sandbox;

before(async () => {
  client = new Client({ url: env("SBX_TEST_URL") });
  box = await client.sandboxes.create({ labels: LABEL, env: { FROM_CREATE: "yes" } });
});

after(async () => {
  for (const s of await client.sandboxes.list(LABEL)) await s.terminate();
  await client.close();
});

describe("server", () => {
  test("capabilities and node status", T, async () => {
    const caps = await client.capabilities();
    assert.equal(caps.capabilities["websocket_attach"], true);
    const node = await client.node();
    assert.ok(node.running >= 1 && node.cordoned === false, JSON.stringify(node));
  });

  test("cordon: a cordoned node refuses new sandboxes with Unavailable, then takes them again", T, async () => {
    assert.equal((await client.cordon(true)).cordoned, true);
    try {
      await rejectsWith(client.sandboxes.create({ labels: LABEL }), Unavailable, "cordon");
    } finally {
      assert.equal((await client.cordon(false)).cordoned, false);
    }
  });
});

describe("sandboxes", () => {
  test("create, get by id and name, list by label, update, terminate (idempotent)", T, async () => {
    const made = await client.sandboxes.create({ name: "ts-create", labels: { ...LABEL, kind: "crud" }, cpus: 1, memory_mb: 256 });
    try {
      assert.match(made.id, /^sbx_/);
      assert.deepEqual([made.state, made.name, made.info.cpus, made.info.memory_mb], ["running", "ts-create", 1, 256]);
      assert.equal((await client.sandboxes.get("ts-create")).id, made.id);
      assert.deepEqual((await client.sandboxes.list({ kind: "crud" })).map((s) => s.id), [made.id]);
      await rejectsWith(client.sandboxes.create({ name: "ts-create" }), Conflict, "ts-create");
      await made.update({ name: "ts-renamed", labels: { ...LABEL, kind: "crud", extra: "1" }, idle_timeout_secs: 3600 });
      assert.deepEqual([made.name, made.info.labels["extra"], made.info.idle_timeout_secs], ["ts-renamed", "1", 3600]);
      assert.equal((await made.refresh()).name, "ts-renamed");
      await rejectsWith(client.sandboxes.get("ts-create"), NotFound, "ts-create");
    } finally {
      await made.terminate();
    }
    assert.equal((await made.refresh()).state, "terminated");
    await made.terminate();
    await client.sandboxes.terminate(made.id);
  });

  test("bad create fields are InvalidRequest, reserved env names Refused, and nothing is made", T, async () => {
    const before = (await client.sandboxes.list(LABEL)).length;
    await rejectsWith(client.sandboxes.create({ labels: LABEL, cpus: -1 }), InvalidRequest, "cpus");
    await rejectsWith(client.sandboxes.create({ labels: LABEL, bogus: 1 } as never), InvalidRequest, "bogus");
    await rejectsWith(client.sandboxes.create({ labels: LABEL, env: { LD_PRELOAD: "/x.so" } }), Refused, "LD_PRELOAD");
    assert.equal((await client.sandboxes.list(LABEL)).length, before);
    await rejectsWith(client.sandboxes.get("sbx_0000000000000000"), NotFound, "sbx_0000000000000000");
  });
});

describe("run", () => {
  test("exit code, stdout and stderr as bytes, binary stdin", T, async () => {
    const result = await box.run(["sh", "-c", "cat; echo err >&2; exit 3"], { stdin: new Uint8Array([105, 110, 0, 255]) });
    assert.deepEqual([result.exitCode, [...result.stdout], decode(result.stderr), result.truncated, result.timedOut], [3, [105, 110, 0, 255], "err\n", false, false]);
  });

  test("env merged over the sandbox's, cwd, and a string stdin", T, async () => {
    const result = await box.run(["sh", "-c", 'echo "$FROM_CREATE $EXTRA $(pwd)"; cat'], { env: { EXTRA: "more" }, cwd: "/tmp", stdin: "piped" });
    assert.equal(decode(result.stdout), "yes more /tmp\npiped");
  });

  test("a timeout kills the command: timedOut and exit code -1", T, async () => {
    const started = Date.now();
    const result = await box.run(["sleep", "60"], { timeoutSecs: 1 });
    assert.deepEqual([result.timedOut, result.exitCode], [true, -1]);
    assert.ok(Date.now() - started < 50_000);
  });

  test("bad argv is refused before sending; a bad field by the server", T, async () => {
    await rejectsWith(box.run("ls -l" as never), InvalidRequest, "argv");
    await rejectsWith(box.run(["true"], { timeoutSecs: -5 }), InvalidRequest, "timeout_secs");
    await rejectsWith(box.run(["true"], { env: { LD_PRELOAD: "x" } }), Refused, "LD_PRELOAD");
  });
});

describe("background processes", () => {
  test("followed output arrives while the process runs; then its exit code", T, async () => {
    const proc = await box.startProcess(["sh", "-c", "echo one; sleep 3; echo two >&2; exit 4"]);
    assert.ok(proc.pid > 0);
    assert.equal(proc.exitCode, null);
    const seen: Array<[string, string, number]> = [];
    for await (const chunk of proc.output()) seen.push([chunk.stream, decode(chunk.data), Date.now()]);
    assert.deepEqual(seen.map(([s, d]) => [s, d]), [["stdout", "one\n"], ["stderr", "two\n"]]);
    // The first line came before the sleep ended: the stream follows, it does not wait for the end.
    assert.ok(seen[1]![2] - seen[0]![2] > 1000, JSON.stringify(seen));
    assert.equal(proc.exitCode, 4);
    assert.equal((await proc.refresh()).info.state, "exited");
    assert.equal((await box.getProcess(proc.pid)).exitCode, 4);
    assert.ok((await box.processes()).some((p) => p.pid === proc.pid && p.exitCode === 4));
  });

  test("stdin written in pieces, then closed", T, async () => {
    const proc = await box.startProcess(["wc", "-c"], { stdin: "ab" });
    await proc.writeStdin(new Uint8Array(1000));
    await proc.writeStdin("x".repeat(22), true);
    const out = [];
    for await (const chunk of proc.output()) out.push(decode(chunk.data));
    assert.equal(out.join("").trim(), "1024");
    assert.equal(proc.exitCode, 0);
    const cat = await box.startProcess(["cat"]);
    await cat.closeStdin();
    assert.equal(await cat.wait(), 0);
  });

  test("signals: TERM and KILL end it, a name outside the spec is InvalidRequest", T, async () => {
    const sleeper = await box.startProcess(["sleep", "300"]);
    await rejectsWith(sleeper.signal("STOP"), InvalidRequest, "STOP");
    await sleeper.signal("SIGTERM");
    assert.notEqual(await sleeper.wait(), 0);
    const stubborn = await box.startProcess(["sh", "-c", "trap '' TERM; echo ready; sleep 300"]);
    for await (const chunk of stubborn.output()) if (decode(chunk.data).includes("ready")) break;
    await stubborn.kill();
    // Killed by KILL: -9 for the process itself, 137 when its shell reports the child's death.
    assert.ok([-9, 137].includes(await stubborn.wait()), String(stubborn.exitCode));
  });

  test("a tty process: one stream, its size, rows without tty refused", T, async () => {
    const proc = await box.startProcess(["stty", "size"], { tty: true, rows: 33, cols: 111 });
    const out = [];
    for await (const chunk of proc.output()) out.push(decode(chunk.data));
    assert.equal(out.join("").trim(), "33 111");
    await rejectsWith(box.startProcess(["true"], { rows: 10 }), InvalidRequest, "tty");
    await rejectsWith(box.getProcess(999_999), NotFound, "999999");
  });
});

describe("files and directories", () => {
  test("write and read bytes and text, list a directory, remove", T, async () => {
    const bytes = new Uint8Array(256).map((_, i) => i);
    await box.files.write("/sandbox/home/ts/dir/blob.bin", bytes);
    await box.files.write("/sandbox/home/ts/dir/note.txt", "héllo\n");
    assert.deepEqual([...(await box.files.read("/sandbox/home/ts/dir/blob.bin"))], [...bytes]);
    assert.equal(await box.files.readText("/sandbox/home/ts/dir/note.txt"), "héllo\n");
    const entries = await box.files.list("/sandbox/home/ts/dir");
    assert.deepEqual(entries.map((e) => [e.name, e.type, e.size]), [["blob.bin", "file", 256], ["note.txt", "file", 7]]);
    assert.deepEqual((await box.files.list("/sandbox/home/ts")).map((e) => [e.name, e.type]), [["dir", "dir"]]);
    await box.files.remove("/sandbox/home/ts/dir/blob.bin");
    await box.files.remove("/sandbox/home/ts/dir/note.txt");
    await box.files.remove("/sandbox/home/ts/dir");
    assert.deepEqual(await box.files.list("/sandbox/home/ts"), []);
  });

  test("a missing file is NotFound; a body over 64 MiB is PayloadTooLarge and writes nothing", T, async () => {
    await rejectsWith(box.files.read("/sandbox/home/nope.txt"), NotFound, "nope.txt");
    await rejectsWith(box.files.list("/sandbox/home/nodir"), NotFound, "nodir");
    await rejectsWith(box.files.write("/sandbox/home/huge.bin", new Uint8Array(64 * 1024 * 1024 + 1)), PayloadTooLarge, "");
    await rejectsWith(box.files.read("/sandbox/home/huge.bin"), NotFound, "huge.bin");
  });
});

describe("attach over the WebSocket", () => {
  test("output replayed from the start, stdin, end of input and the exit frame", T, async () => {
    const proc = await box.startProcess(["sh", "-c", "echo early; read line; echo got $line; cat; exit 7"]);
    for await (const chunk of proc.output()) if (decode(chunk.data).includes("early")) break;
    const attached = await proc.attach();
    let out = "";
    const frame = await attached.recv();
    assert.equal(frame!.type, "o");
    out += decode(frame!.payload);
    assert.equal(out, "early\n");
    await attached.writeStdin("hello\n");
    await attached.writeStdin("after\n");
    await attached.closeStdin();
    for await (const f of attached) if (f.type === "o") out += decode(f.payload);
    assert.equal(out, "early\ngot hello\nafter\n");
    assert.equal(attached.exitCode, 7);
    assert.equal(await attached.recv(), null);
  });

  test("a terminal: resize, and a signal", T, async () => {
    const proc = await box.startProcess(["sh", "-c", "stty size; read x; stty size; sleep 300"], { tty: true, rows: 30, cols: 100 });
    const attached = await box.attach(proc.pid);
    let screen = "";
    const until = async (text: string): Promise<void> => {
      while (!screen.includes(text)) {
        const f = await attached.recv();
        assert.ok(f !== null, `the stream ended before '${text}': ${screen}`);
        if (f.type === "o") screen += decode(f.payload);
      }
    };
    await until("30 100");
    await attached.resize(40, 120);
    await attached.writeStdin("\r");
    await until("40 120");
    await rejectsWith(attached.resize(0, 10), InvalidRequest, "rows");
    await attached.signal("KILL");
    for await (const _ of attached) {
      // up to the exit frame
    }
    assert.ok([-9, 137].includes(attached.exitCode!), String(attached.exitCode));
  });

  test("detaching leaves the process running; attaching to no process is NotFound", T, async () => {
    const proc = await box.startProcess(["sh", "-c", "echo up; sleep 300"]);
    const first = await proc.attach();
    assert.equal(decode((await first.recv())!.payload), "up\n");
    first.close();
    assert.equal(await first.recv(), null);
    await rejectsWith(first.writeStdin("x"), Unavailable, "closed");
    assert.equal((await proc.refresh()).info.state, "running");
    const second = await proc.attach();
    assert.equal(decode((await second.recv())!.payload), "up\n");
    second.close();
    await proc.kill();
    await rejectsWith(box.attach(999_999), NotFound, "999999");
  });

  test("a reader that does not keep up: reading stops at the buffer bound, then every byte arrives", T, async () => {
    const proc = await box.startProcess(["sh", "-c", "head -c 20000000 /dev/zero; exit 0"]);
    await waitFor(async () => (await proc.refresh()).exitCode !== null, "the 20 MB writer to exit");
    const attached = await proc.attach();
    let total = (await attached.recv())!.payload.length;
    await new Promise((resolve) => setTimeout(resolve, 3000));
    assert.ok(attached.buffered <= MAX_BUFFERED_BYTES + 2 * 1024 * 1024, `${attached.buffered} bytes held`);
    for await (const f of attached) if (f.type === "o") total += f.payload.length;
    assert.deepEqual([total, attached.exitCode], [20_000_000, 0]);
  });

  test("a cut attach stream throws Unavailable, and attaching again replays the output", T, async () => {
    // A relay between the client and the server's socket, cut while the process still runs.
    const dir = mkdtempSync(join(tmpdir(), "sbx-ts-cut-"));
    const relayPath = join(dir, "relay.sock");
    const open: Socket[] = [];
    const relay = createServer((inbound) => {
      const outbound = createConnection(resolveEndpoint(env("SBX_TEST_URL")).socketPath!);
      open.push(inbound, outbound);
      inbound.pipe(outbound).pipe(inbound);
      inbound.on("error", () => outbound.destroy());
      outbound.on("error", () => inbound.destroy());
    });
    relay.listen(relayPath);
    await once(relay, "listening");
    const viaRelay = new Client({ url: `unix://${relayPath}` });
    try {
      const proc = await box.startProcess(["sh", "-c", "echo before-cut; sleep 300"]);
      const attached = await (await viaRelay.sandboxes.get(box.id)).attach(proc.pid);
      assert.equal(decode((await attached.recv())!.payload), "before-cut\n");
      for (const socket of open) socket.destroy();
      await rejectsWith(attached.recv(), Unavailable, "ended before the process exited");
      await rejectsWith(attached.writeStdin("x"), Unavailable, "closed");
      const again = await proc.attach();
      assert.equal(decode((await again.recv())!.payload), "before-cut\n");
      again.close();
      await proc.kill();
    } finally {
      await viaRelay.close();
      relay.close();
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe("tunnels", () => {
  test("bytes to a guest port and back, half-close; a closed port is Conflict, a bad one InvalidRequest", T, async () => {
    const echo = await box.startProcess([
      "python3",
      "-c",
      "import socket\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n" +
        "s.bind(('127.0.0.1', 7070)); s.listen(); print('listening', flush=True)\n" +
        "while True:\n c, _ = s.accept(); data = b''\n" +
        " while (d := c.recv(65536)): data += d\n" +
        " c.sendall(b'got %d bytes' % len(data)); c.close()\n",
    ]);
    for await (const chunk of echo.output()) if (decode(chunk.data).includes("listening")) break;
    const tunnel = await box.tunnel(7070);
    const received: Buffer[] = [];
    tunnel.on("data", (d: Buffer) => received.push(d));
    const ended = once(tunnel, "end");
    tunnel.end(Buffer.alloc(300_000, 7));
    await ended;
    assert.equal(Buffer.concat(received).toString(), "got 300000 bytes");
    tunnel.destroy();
    await rejectsWith(box.tunnel(9), Conflict, "127.0.0.1:9");
    await rejectsWith(box.tunnel(70_000), InvalidRequest, "port");
    await echo.kill();
  });

  test("forward: a local port whose connections are tunnels; one to a closed port is closed at once", T, async () => {
    await box.files.write("/sandbox/home/fwd/a.txt", "forwarded\n");
    const web = await box.startProcess(["python3", "-u", "-m", "http.server", "8001", "--bind", "127.0.0.1"], { cwd: "/sandbox/home/fwd" });
    for await (const chunk of web.output()) if (decode(chunk.data).includes("Serving HTTP")) break;
    const forward = await box.forward(8001);
    try {
      const answers = await Promise.all([1, 2, 3].map(() => fetch(`http://127.0.0.1:${forward.port}/a.txt`).then((r) => r.text())));
      assert.deepEqual(answers, ["forwarded\n", "forwarded\n", "forwarded\n"]);
    } finally {
      await forward.close();
    }
    await assert.rejects(fetch(`http://127.0.0.1:${forward.port}/a.txt`));
    const nowhere = await box.forward(9);
    try {
      await assert.rejects(fetch(`http://127.0.0.1:${nowhere.port}/`));
    } finally {
      await nowhere.close();
    }
    await rejectsWith(box.forward(0), InvalidRequest, "port");
    await web.kill();
  });
});

describe("suspend, resume, snapshots, forks", () => {
  test("suspend and resume keep memory; suspending with a running process is Conflict", T, async () => {
    const s = await client.sandboxes.create({ labels: LABEL });
    try {
      const proc = await s.startProcess(["sleep", "300"]);
      await rejectsWith(s.suspend(), Conflict, "");
      assert.equal((await s.refresh()).state, "running");
      await proc.kill();
      await proc.wait();
      await s.files.write("/sandbox/home/kept.txt", "kept");
      assert.equal((await s.suspend()).state, "suspended");
      await rejectsWith(s.run(["true"]), Conflict, "");
      assert.equal((await s.resume()).state, "running");
      assert.equal(await s.files.readText("/sandbox/home/kept.txt"), "kept");
    } finally {
      await s.terminate();
    }
  });

  test("memory and disk snapshots, a fork of each, the snapshot list, a schedule, delete", T, async () => {
    await box.files.write("/sandbox/home/origin.txt", "from the origin");
    const memory = await box.snapshot("memory");
    assert.deepEqual([memory.sandbox, memory.kind], [box.id, "memory"]);
    const fork = await client.sandboxes.create({ snapshot_id: memory.id, labels: LABEL });
    const diskFork = await box.fork({ labels: LABEL }, "disk");
    try {
      assert.equal(await fork.files.readText("/sandbox/home/origin.txt"), "from the origin");
      assert.equal(await diskFork.files.readText("/sandbox/home/origin.txt"), "from the origin");
      assert.notEqual(fork.id, box.id);
      const listed = (await client.snapshots.list()).map((s) => s.id);
      assert.ok(listed.includes(memory.id));
      assert.equal((await box.setSnapshotSchedule(3600, 2)).info.snapshot_every_secs, 3600);
      assert.equal((await box.setSnapshotSchedule(0)).info.snapshot_every_secs, 0);
      await rejectsWith(box.snapshot("bogus" as never), InvalidRequest, "");
    } finally {
      await fork.terminate();
      await diskFork.terminate();
    }
    await client.snapshots.delete(memory.id);
    assert.ok(!(await client.snapshots.list()).some((s) => s.id === memory.id));
    await rejectsWith(client.snapshots.delete(memory.id), NotFound, "");
    await rejectsWith(client.sandboxes.create({ snapshot_id: "snap_nope" }), NotFound, "");
  });
});

describe("persistent sandboxes", () => {
  test("create needs a name; stop ends processes and keeps the disk; GET does not wake; resume and a run do", T, async () => {
    assert.equal((await client.capabilities()).capabilities["persistent"], true);
    await rejectsWith(client.sandboxes.create({ labels: LABEL, persistent: true }), InvalidRequest, "name");
    assert.equal(box.persistent, false);
    await rejectsWith(box.stop(), Conflict, "");
    assert.equal((await box.refresh()).state, "running");
    const s = await client.sandboxes.create({ name: "ts-keeper", labels: LABEL, persistent: true });
    try {
      assert.deepEqual([s.state, s.persistent, s.stoppedReason], ["running", true, null]);
      await s.files.write("/sandbox/home/kept.txt", "kept across a stop");
      const sleeper = await s.startProcess(["sleep", "600"]);
      assert.equal(await s.stop(), s);
      assert.deepEqual([s.state, s.stoppedReason], ["stopped", "request"]);
      // Reading it (by name too) and listing it leave it stopped.
      const read = await client.sandboxes.get("ts-keeper");
      assert.deepEqual([read.id, read.state, read.persistent, read.stoppedReason], [s.id, "stopped", true, "request"]);
      assert.equal((await client.sandboxes.list(LABEL)).find((x) => x.id === s.id)!.state, "stopped");
      assert.equal((await s.stop()).state, "stopped", "stop is idempotent");
      assert.deepEqual([(await s.resume()).state, s.stoppedReason], ["running", null]);
      assert.equal(await s.files.readText("/sandbox/home/kept.txt"), "kept across a stop");
      const after = await s.processes();
      assert.ok(!after.some((p) => p.pid === sleeper.pid && p.info.state === "running"), JSON.stringify(after.map((p) => p.info)));
      // A stopped one is started by the next call that needs its guest.
      assert.equal((await s.stop()).state, "stopped");
      const woken = await s.run(["cat", "/sandbox/home/kept.txt"]);
      assert.deepEqual([woken.exitCode, decode(woken.stdout)], [0, "kept across a stop"]);
      assert.equal((await s.refresh()).state, "running");
    } finally {
      await s.terminate();
    }
    assert.equal((await s.refresh()).state, "terminated");
  });

  test("the idle timeout suspends a persistent sandbox rather than terminating it; stop, then a file read wakes it", T, async () => {
    const s = await client.sandboxes.create({ name: "ts-idler", labels: { ...LABEL, kind: "idle" }, persistent: true, idle_timeout_secs: 3 });
    try {
      await s.files.write("/sandbox/home/note.txt", "before the nap");
      // The list names no sandbox, so polling it is no activity that would keep it awake.
      const state = async (): Promise<string> => (await client.sandboxes.list({ kind: "idle" })).find((x) => x.id === s.id)!.state;
      const seen = await waitFor(async () => {
        const now = await state();
        return now === "running" ? null : now;
      }, "the idle persistent sandbox leaving running", 120_000);
      assert.equal(seen, "suspended");
      assert.equal((await s.stop()).state, "stopped");
      assert.equal(await s.files.readText("/sandbox/home/note.txt"), "before the nap");
      assert.equal(await state(), "running");
    } finally {
      await s.terminate();
    }
  });
});

describe("volumes, metrics, events, images", () => {
  test("volumes: create, mount, list, Conflict while mounted, delete", T, async () => {
    const volume = await client.volumes.create("ts-vol", 16);
    assert.deepEqual([volume.name, volume.size_mb], ["ts-vol", 16]);
    await rejectsWith(client.volumes.create("ts-vol", 16), Conflict, "ts-vol");
    const s = await client.sandboxes.create({ labels: LABEL, volumes: [{ name: "ts-vol", path: "/mnt/data", read_only: false }] });
    try {
      await s.files.write("/mnt/data/a.txt", "on the volume");
      assert.equal((await client.volumes.list()).find((v) => v.name === "ts-vol")!.attached_to, s.id);
      await rejectsWith(client.volumes.delete("ts-vol"), Conflict, "ts-vol");
    } finally {
      await s.terminate();
    }
    const again = await client.sandboxes.create({ labels: LABEL, volumes: [{ name: "ts-vol", path: "/mnt/data", read_only: true }] });
    try {
      assert.equal(await again.files.readText("/mnt/data/a.txt"), "on the volume");
    } finally {
      await again.terminate();
    }
    await client.volumes.delete("ts-vol");
    await rejectsWith(client.volumes.delete("ts-vol"), NotFound, "ts-vol");
  });

  test("metrics: samples of the last hour", T, async () => {
    const metrics = await box.metrics();
    assert.ok(metrics.interval_secs > 0);
    await waitFor(async () => (await box.metrics()).samples.length > 0, "a first metrics sample", 120_000);
    const sample = (await box.metrics()).samples.at(-1)!;
    assert.ok(sample.memory_limit_bytes > 0 && typeof sample.cpu_percent === "number");
  });

  test("events: the audit trail, also by id after termination", T, async () => {
    const s = await client.sandboxes.create({ labels: LABEL });
    await s.run(["true"]);
    await s.terminate();
    const types = (await client.sandboxes.events(s.id)).events.map((e) => e["type"]);
    assert.ok(types.includes("sandbox.created") && types.includes("sandbox.terminated"), JSON.stringify(types));
    assert.ok((await box.events()).events.length > 0);
  });

  test("images: list, a pull that fails in the background, remove; errors", T, async () => {
    const images = await client.images.list();
    assert.ok(images.some((i) => i.default && i.state === "installed"), JSON.stringify(images));
    const ref = "127.0.0.1:9/sbx-ts/none:1";
    const pulled = await client.images.pull(ref);
    assert.equal(pulled.image, ref);
    const failed = await waitFor(async () => {
      const image = await client.images.get(ref);
      return image?.state === "failed" ? image : undefined;
    }, "the pull of an unreachable registry to fail", 120_000);
    assert.ok(failed.error, JSON.stringify(failed));
    assert.equal((await client.images.remove(ref)).image, ref);
    await rejectsWith(client.images.remove(ref), NotFound, "");
    await rejectsWith(client.images.pull("NOT a reference"), InvalidRequest, "");
    const defaultImage = images.find((i) => i.default)!.image;
    await rejectsWith(client.images.remove(defaultImage), Conflict, "");
  });
});

describe("HTTPS with a token", () => {
  test("the token opens the server; a wrong or missing one is Unauthorized; a foreign Origin ForbiddenOrigin", T, async () => {
    const url = env("SBX_TEST_HTTPS_URL");
    const ca = readFileSync(env("SBX_TEST_HTTPS_CA"));
    const good = new Client({ url, token: env("SBX_TEST_HTTPS_TOKEN"), ca });
    const s = await good.sandboxes.create({ labels: LABEL });
    try {
      assert.equal(decode((await s.run(["echo", "over https"])).stdout), "over https\n");
      const proc = await s.startProcess(["sh", "-c", "echo attached over wss; exit 3"]);
      const attached = await proc.attach();
      let out = "";
      for await (const f of attached) if (f.type === "o") out += decode(f.payload);
      assert.deepEqual([out, attached.exitCode], ["attached over wss\n", 3]);
      for (const token of ["wrong-token", ""]) {
        const bad = new Client({ url, token, ca });
        await rejectsWith(bad.sandboxes.list(), Unauthorized, "");
        const path = `/v1/sandboxes/${s.id}/processes/${proc.pid}/attach/websocket`;
        await rejectsWith(openAttachment(bad.endpoint, path, proc.pid, { ca }), Unauthorized, "");
        await bad.close();
      }
    } finally {
      await s.terminate();
      await good.close();
    }
    const untrusted = new Client({ url, token: env("SBX_TEST_HTTPS_TOKEN") });
    await rejectsWith(untrusted.capabilities(), Unavailable, "certificate");
    const foreign = new Client({
      transport: new NodeTransport(resolveEndpoint(url, env("SBX_TEST_HTTPS_TOKEN")), { ca, headers: { Origin: "https://evil.example" } }),
    });
    await rejectsWith(foreign.capabilities(), ForbiddenOrigin, "evil.example");
  });
});

describe("the examples of docs/sdk-typescript.md", () => {
  const local = (): Record<string, string> => ({ SANDBOX_URL: env("SBX_TEST_URL") });

  test("quickstart", T, async () => {
    assert.equal(await runExample("quickstart", local()), "0 HELLO\ntodo.txt 15\nwrite the docs\n\n");
  });

  test("processes", T, async () => {
    assert.equal(
      await runExample("processes", local()),
      "[stdout] tick 1\n[stdout] tick 2\n[stdout] tick 3\nexit code 2\nstopped by TERM: true\n",
    );
  });

  test("attach", T, async () => {
    assert.equal(await runExample("attach", local()), "resized to 50 x 132\nexit code 3\n");
  });

  test("tunnel", T, async () => {
    assert.equal(await runExample("tunnel", local()), "200 <h1>inside the sandbox</h1>\nHTTP/1.0 200 OK\n");
  });

  test("persistent", T, async () => {
    assert.equal(await runExample("persistent", local()), "stopped request\nstopped\nkept across a stop running\n");
  });

  test("errors", T, async () => {
    assert.equal(await runExample("errors", local()), "404 not_found - no sandbox 'no-such-sandbox' on this node\n409 conflict\n");
  });
});
