/**
 * `Sandbox`: one sandbox and everything done in it; `client.sandboxes`: finding and making them.
 *
 *     const sandbox = await client.sandboxes.create({ image: "default", labels: { app: "demo" } });
 *     const result = await sandbox.run(["python3", "-c", "print(1)"]);
 *     await sandbox.files.write("/sandbox/home/a.txt", "hi");
 *     await sandbox.terminate();
 *
 * A `Sandbox` keeps the server's last answer in `info`; `refresh()` fetches it again. Calls address the sandbox by
 * id, so a rename does not break a held object.
 */
import type { Duplex } from "node:stream";

import { type Attachment, openAttachment } from "./attach.js";
import { asBytes, fromBase64, text, toBase64 } from "./bytes.js";
import type { Client } from "./client.js";
import { InvalidRequest, Unavailable as UnavailableError, Unsupported } from "./errors.js";
import { signalName } from "./frames.js";
import { Ports } from "./ports.js";
import type {
  CreateRequest,
  DirEntry,
  EventList,
  OutputChunk,
  PatchRequest,
  ProcessInfo,
  RunResult,
  SandboxInfo,
  SandboxMetrics,
  SandboxState,
  Snapshot,
  StoppedReason,
} from "./types.js";

/** `/v1/sandboxes/{ref}` with `ref` quoted, so a name never reaches another route. */
export function sandboxPath(ref: string): string {
  return `/v1/sandboxes/${encodeURIComponent(ref)}`;
}

/** Options of `Sandbox.run`. */
export interface RunOptions {
  /** Merged over the sandbox's own environment. */
  env?: Record<string, string>;
  /** Working directory (default `/sandbox/home`). */
  cwd?: string;
  /** Fed to the command's stdin, then closed (a string as UTF-8). */
  stdin?: Uint8Array | string;
  /** Seconds after which the command is killed (`timedOut`, `exitCode` -1); default: the server's. */
  timeoutSecs?: number;
}

/** Options of `Sandbox.startProcess`. */
export interface ProcessOptions {
  env?: Record<string, string>;
  cwd?: string;
  /** Written to stdin first; stdin stays open (`writeStdin` more, or `closeStdin`). */
  stdin?: Uint8Array | string;
  /** Run on a terminal (one output stream) of `rows` x `cols` (server defaults 24 x 80). */
  tty?: boolean;
  rows?: number;
  cols?: number;
}

/** `client.sandboxes`: create, list, get and terminate sandboxes. */
export class Sandboxes {
  constructor(private readonly client: Client) {}

  /**
   * `POST /v1/sandboxes` with the spec's create fields, all optional: `name`, `image`, `cpus`, `memory_mb`,
   * `disk_mb`, `env`, `secret_env`, `network`, `labels`, `idle_timeout_secs`, `volumes`, `snapshot_id` (a fork),
   * `persistent` (capability `persistent`: suspended rather than terminated at its idle timeout, and `stop()`able;
   * needs a `name`), ...; an unknown field or a wrong type is `InvalidRequest`.
   */
  async create(request: CreateRequest = {}): Promise<Sandbox> {
    return new Sandbox(this.client, await this.client.call<SandboxInfo>("POST", "/v1/sandboxes", { json: request }));
  }

  /** `GET /v1/sandboxes`, newest first; only those carrying every label in `labels`. */
  async list(labels: Record<string, string> = {}): Promise<Sandbox[]> {
    const query = Object.entries(labels).map(([k, v]) => ["label", `${k}=${v}`] as const);
    const listing = await this.client.call<{ sandboxes: SandboxInfo[] }>("GET", "/v1/sandboxes", { query });
    return listing.sandboxes.map((info) => new Sandbox(this.client, info));
  }

  /** `GET /v1/sandboxes/{ref}`: the sandbox named by id or name. */
  async get(ref: string): Promise<Sandbox> {
    return new Sandbox(this.client, await this.client.call<SandboxInfo>("GET", sandboxPath(ref)));
  }

  /** `DELETE /v1/sandboxes/{ref}`: terminate it (idempotent). */
  async terminate(ref: string): Promise<void> {
    await this.client.call("DELETE", sandboxPath(ref));
  }

  /** `GET /v1/sandboxes/{ref}/events` by id, also for a terminated sandbox (capability `audit`). */
  events(ref: string): Promise<EventList> {
    return this.client.call("GET", `${sandboxPath(ref)}/events`);
  }
}

/** One sandbox. */
export class Sandbox {
  readonly id: string;
  /** The Sandbox object as last answered. */
  info: SandboxInfo;
  /** Guest files as the sandbox user. */
  readonly files: Files;
  /** Its TCP ports on URLs of their own (a gateway with capability `exposed_ports`). */
  readonly ports: Ports;

  /** @internal use `client.sandboxes`. */
  constructor(
    private readonly client: Client,
    info: SandboxInfo,
  ) {
    this.info = info;
    this.id = info.id;
    this.files = new Files(client, this.id);
    this.ports = new Ports(client, sandboxPath(this.id));
  }

  /** The sandbox's name, `""` when it has none. */
  get name(): string {
    return this.info.name ?? "";
  }

  /** `pending`, `running`, `suspended`, `stopped` (a persistent sandbox), `terminated`, as last read. */
  get state(): SandboxState {
    return this.info.state;
  }

  /** Created with `persistent: true`: its idle timeout suspends it rather than terminating it. */
  get persistent(): boolean {
    return this.info.persistent === true;
  }

  /** Why it is stopped (`request`, `restore_failed`, `crash`, `suspend_failed`) while `state` is `stopped`, else `null`. */
  get stoppedReason(): StoppedReason | null {
    return this.info.stopped_reason ?? null;
  }

  private get path(): string {
    return sandboxPath(this.id);
  }

  private async update_(method: string, suffix = "", json?: unknown): Promise<this> {
    this.info = await this.client.call<SandboxInfo>(method, this.path + suffix, { json });
    return this;
  }

  /** Fetch the sandbox again into `info`. */
  refresh(): Promise<this> {
    return this.update_("GET");
  }

  /** `PATCH`: any of `network`, `name`, `labels`, `idle_timeout_secs`; omitted fields stay as they are. */
  update(fields: PatchRequest): Promise<this> {
    return this.update_("PATCH", "", fields);
  }

  /** Terminate: its processes stop and its disk is discarded (idempotent). */
  async terminate(): Promise<void> {
    await this.client.call("DELETE", this.path);
  }

  /** Save and stop it (memory, processes, disk kept; capability `suspend`); `Conflict` while a process runs. */
  suspend(): Promise<this> {
    return this.update_("POST", "/suspend");
  }

  /**
   * Bring a suspended sandbox back as it was, or start a stopped persistent one from its disk (new processes, every
   * file kept; `Unavailable` when the node has no room for it now, and it stays stopped).
   */
  resume(): Promise<this> {
    return this.update_("POST", "/resume");
  }

  /**
   * Stop a persistent sandbox (capability `persistent`): its processes end and its memory is freed; its disk,
   * volumes, name, labels and network are kept, and `state` is `stopped`. Idempotent. `resume()`, or any call that
   * needs the guest (run, processes, files, attach, tunnel), starts it again. `Conflict` for a sandbox that is not
   * persistent.
   */
  stop(): Promise<this> {
    return this.update_("POST", "/stop");
  }

  /** Take a `memory` (everything, processes running) or `disk` (files only) snapshot. Fork it with `sandboxes.create({ snapshot_id })`. */
  snapshot(kind: "memory" | "disk" = "memory"): Promise<Snapshot> {
    return this.client.call("POST", `${this.path}/snapshots`, { json: { kind } });
  }

  /** A new sandbox started from a fresh snapshot of this one (`kind` default `memory`), with `request`'s fields. */
  async fork(request: CreateRequest = {}, kind: "memory" | "disk" = "memory"): Promise<Sandbox> {
    const snapshot = await this.snapshot(kind);
    return new Sandboxes(this.client).create({ ...request, snapshot_id: snapshot.id });
  }

  /** Snapshot every `everySecs` seconds keeping the newest `keep` (default 1); `everySecs` 0 stops it. */
  setSnapshotSchedule(everySecs: number, keep = 1): Promise<this> {
    return this.update_("PUT", "/snapshot-schedule", { every_secs: everySecs, keep });
  }

  /** The last hour of usage samples (capability `metrics`). */
  metrics(): Promise<SandboxMetrics> {
    return this.client.call("GET", `${this.path}/metrics`);
  }

  /** Its audit events, oldest first (capability `audit`). */
  events(): Promise<EventList> {
    return this.client.call("GET", `${this.path}/events`);
  }

  /**
   * Run `argv` to completion and return its output (each stream kept up to 8 MiB). `argv` runs directly (no shell
   * unless `argv[0]` is one).
   */
  async run(argv: readonly string[], options: RunOptions = {}): Promise<RunResult> {
    checkArgv(argv);
    const body: Record<string, unknown> = { argv };
    if (options.env !== undefined) body["env"] = options.env;
    if (options.cwd !== undefined) body["cwd"] = options.cwd;
    if (options.stdin !== undefined) body["stdin"] = toBase64(asBytes(options.stdin));
    if (options.timeoutSecs !== undefined) body["timeout_secs"] = options.timeoutSecs;
    const wire = await this.client.call<{ exit_code: number; stdout: string; stderr: string; truncated: boolean; timed_out: boolean }>(
      "POST",
      `${this.path}/run`,
      { json: body },
    );
    return {
      exitCode: wire.exit_code,
      stdout: fromBase64(wire.stdout),
      stderr: fromBase64(wire.stderr),
      truncated: wire.truncated,
      timedOut: wire.timed_out,
    };
  }

  /** Start `argv` in the background and return its `Process` at once. */
  async startProcess(argv: readonly string[], options: ProcessOptions = {}): Promise<Process> {
    checkArgv(argv);
    if ((options.rows !== undefined || options.cols !== undefined) && !options.tty) {
      throw new InvalidRequest("rows and cols size a terminal: pass tty: true as well");
    }
    const body: Record<string, unknown> = { argv };
    if (options.env !== undefined) body["env"] = options.env;
    if (options.cwd !== undefined) body["cwd"] = options.cwd;
    if (options.stdin !== undefined) body["stdin"] = toBase64(asBytes(options.stdin));
    if (options.tty) body["tty"] = true;
    if (options.rows !== undefined) body["rows"] = options.rows;
    if (options.cols !== undefined) body["cols"] = options.cols;
    const info = await this.client.call<ProcessInfo>("POST", `${this.path}/processes`, { json: body });
    return new Process(this.client, this.id, info);
  }

  /** Its processes, running and exited. */
  async processes(): Promise<Process[]> {
    const listing = await this.client.call<{ processes: ProcessInfo[] }>("GET", `${this.path}/processes`);
    return listing.processes.map((info) => new Process(this.client, this.id, info));
  }

  /** The process with handle `pid`. */
  async getProcess(pid: number): Promise<Process> {
    return new Process(this.client, this.id, await this.client.call<ProcessInfo>("GET", `${this.path}/processes/${checkPid(pid)}`));
  }

  /** Attach to process `pid` over the WebSocket (its output replayed from the start). Close to detach. */
  attach(pid: number): Promise<Attachment> {
    const process = `${this.path}/processes/${checkPid(pid)}`;
    return openAttachment(this.client.endpoint, `${process}/attach/websocket`, pid, {
      org: this.client.options.org,
      ca: this.client.options.ca,
      WebSocket: this.client.options.WebSocket,
      diagnose: () => this.client.call("GET", process),
    });
  }

  /**
   * (Node) A TCP connection to `127.0.0.1:port` inside the sandbox (capability `tunnel`), as a Node `Duplex`
   * (a `net.Socket`): pipe it, or serve it on a local port. A browser cannot open one: `Unsupported`.
   */
  async tunnel(port: number): Promise<Duplex> {
    if (!Number.isInteger(port) || port < 1 || port > 65535) throw new InvalidRequest(`port ${port}: give 1 to 65535`);
    return this.client.transport.upgrade(`${this.path}/tunnel`, TUNNEL_PROTOCOL, { port: String(port) });
  }

  /**
   * (Node) Listen on a local port (`localPort`, default any free one, on `host` default `127.0.0.1`) and forward
   * each connection through its own tunnel to `127.0.0.1:port` inside the sandbox, like `ssh -L`. A connection
   * whose tunnel is refused (nothing listens in the sandbox) is closed at once. `close()` ends it all.
   */
  async forward(port: number, options: { localPort?: number; host?: string } = {}): Promise<Forward> {
    if (!Number.isInteger(port) || port < 1 || port > 65535) throw new InvalidRequest(`port ${port}: give 1 to 65535`);
    if (typeof (globalThis as { process?: { versions?: { node?: string } } }).process?.versions?.node !== "string") {
      throw new Unsupported("a browser cannot listen on a port: forward from Node");
    }
    const net = await import("node:net");
    const open = new Set<import("node:net").Socket | Duplex>();
    const server = net.createServer((local) => {
      open.add(local);
      local.on("close", () => open.delete(local));
      local.on("error", () => local.destroy());
      local.pause();
      this.tunnel(port).then(
        (remote) => {
          open.add(remote);
          remote.on("close", () => open.delete(remote));
          remote.on("error", () => local.destroy());
          local.on("error", () => remote.destroy());
          local.pipe(remote).pipe(local);
          local.resume();
        },
        () => local.destroy(),
      );
    });
    const host = options.host ?? "127.0.0.1";
    await new Promise<void>((resolve, reject) => {
      server.once("error", (err) => reject(new InvalidRequest(`cannot listen on ${host}:${options.localPort ?? 0}: ${err.message}`)));
      server.listen(options.localPort ?? 0, host, () => resolve());
    });
    const address = server.address() as import("node:net").AddressInfo;
    return {
      host,
      port: address.port,
      close: () =>
        new Promise<void>((resolve) => {
          for (const socket of open) socket.destroy();
          server.close(() => resolve());
        }),
    };
  }
}

/** A local port forwarded into a sandbox (`Sandbox.forward`). */
export interface Forward {
  /** The local address's host (`127.0.0.1` unless asked otherwise). */
  readonly host: string;
  /** The local port (chosen by the system unless asked). */
  readonly port: number;
  /** Stop listening and close every forwarded connection. */
  close(): Promise<void>;
}

/** The upgrade token of a tunnel. */
export const TUNNEL_PROTOCOL = "sbx-tunnel/1";

/** A background process (from `sandbox.startProcess`). `pid` is the server's handle, not the guest kernel's. */
export class Process {
  readonly pid: number;
  readonly sandboxId: string;
  /** The Process object as last read. */
  info: ProcessInfo;
  private readonly path: string;

  /** @internal */
  constructor(
    private readonly client: Client,
    sandboxId: string,
    info: ProcessInfo,
  ) {
    this.sandboxId = sandboxId;
    this.info = info;
    this.pid = info.pid;
    this.path = `${sandboxPath(sandboxId)}/processes/${info.pid}`;
  }

  /** The exit code once known (negative: killed by that signal), else `null`. */
  get exitCode(): number | null {
    return this.info.exit_code;
  }

  /** Fetch the process again into `info`. */
  async refresh(): Promise<this> {
    this.info = await this.client.call<ProcessInfo>("GET", this.path);
    return this;
  }

  /**
   * Its output from the beginning, following until it exits; then `exitCode` is set. Throws `Unavailable` if the
   * stream ends without the exit (the server went away).
   */
  async *output(): AsyncIterable<OutputChunk> {
    for await (const line of this.client.streamLines("GET", `${this.path}/output`)) {
      if ("exit_code" in line) {
        this.info = { ...this.info, state: "exited", exit_code: Number(line["exit_code"]) };
        return;
      }
      yield { stream: line["stream"] as OutputChunk["stream"], data: fromBase64(String(line["data"])) };
    }
    throw new UnavailableError(`the output stream of process ${this.pid} ended before the process did`);
  }

  /** Wait until it exits and return the exit code (reads and drops the rest of its output). */
  async wait(): Promise<number> {
    if (this.exitCode !== null) return this.exitCode;
    for await (const _ of this.output()) {
      // drained: only the exit matters here
    }
    return this.exitCode!;
  }

  /** Send `data` (a string as UTF-8) to its stdin; `close` closes stdin afterwards. */
  async writeStdin(data: Uint8Array | string, close = false): Promise<void> {
    await this.client.raw("POST", `${this.path}/stdin`, { body: asBytes(data), query: close ? { close: "1" } : undefined });
  }

  /** Close its stdin (the process reads EOF). */
  closeStdin(): Promise<void> {
    return this.writeStdin(new Uint8Array(), true);
  }

  /** Send `INT`, `TERM`, `KILL` or `HUP` (a `SIG` prefix is accepted). */
  async signal(name: string): Promise<void> {
    await this.client.call("POST", `${this.path}/signal`, { json: { signal: signalName(name) } });
  }

  /** Send `KILL`. */
  kill(): Promise<void> {
    return this.signal("KILL");
  }

  /** Attach over the WebSocket (see `Sandbox.attach`). */
  attach(): Promise<Attachment> {
    return openAttachment(this.client.endpoint, `${this.path}/attach/websocket`, this.pid, {
      org: this.client.options.org,
      ca: this.client.options.ca,
      WebSocket: this.client.options.WebSocket,
      diagnose: () => this.client.call("GET", this.path),
    });
  }
}

/** `sandbox.files`: guest files as the sandbox user; paths are absolute guest paths. */
export class Files {
  private readonly path: string;

  /** @internal */
  constructor(
    private readonly client: Client,
    sandboxId: string,
  ) {
    this.path = sandboxPath(sandboxId);
  }

  /** The file's bytes; `NotFound` if absent. */
  read(path: string): Promise<Uint8Array> {
    return this.client.raw("GET", `${this.path}/files`, { query: { path } });
  }

  /** The file decoded as UTF-8 text. */
  async readText(path: string): Promise<string> {
    return text(await this.read(path));
  }

  /** Write the whole file (parents created); a string is written as UTF-8. At most 64 MiB. */
  async write(path: string, data: Uint8Array | string): Promise<void> {
    await this.client.raw("PUT", `${this.path}/files`, { body: asBytes(data), query: { path } });
  }

  /** The entries of a guest directory, by name. */
  async list(path: string): Promise<DirEntry[]> {
    return (await this.client.call<{ entries: DirEntry[] }>("GET", `${this.path}/dirs`, { query: { path } })).entries;
  }

  /** Remove a file or an empty directory. */
  async remove(path: string): Promise<void> {
    await this.client.call("DELETE", `${this.path}/files`, { query: { path } });
  }
}

function checkArgv(argv: readonly string[]): void {
  if (!Array.isArray(argv) || argv.length === 0 || argv.some((a) => typeof a !== "string")) {
    // A lone string would be one program name with spaces in it.
    throw new InvalidRequest("argv is a non-empty array of strings, e.g. ['ls', '-l'], not one string");
  }
}

function checkPid(pid: number): number {
  if (!Number.isInteger(pid) || pid < 0) throw new InvalidRequest(`pid ${pid}: give a process handle (a whole number)`);
  return pid;
}
