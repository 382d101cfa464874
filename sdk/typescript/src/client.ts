/**
 * `Client`: one server (a sandboxd node or a sandbox-gateway), its resource namespaces and the raw calls under them.
 *
 *     const client = new Client();            // SANDBOX_URL / SANDBOX_TOKEN, else unix:///run/sandboxd.sock
 *     const sandbox = await client.sandboxes.create({ image: "default" });
 *     ...
 *     await client.close();
 *
 * Every non-2xx answer throws the matching `SandboxError` subclass (`NotFound`, `Conflict`, ...); failing to reach
 * the server throws `Unavailable`.
 */
import { resolveEndpoint, type Endpoint } from "./endpoint.js";
import { Internal, errorFromAnswer } from "./errors.js";
import type { WebSocketClass } from "./attach.js";
import { Images, Snapshots, Volumes } from "./resources.js";
import { Keys, Jobs, Secrets, Services, Ssh } from "./gateway.js";
import { Sandboxes } from "./sandbox.js";
import { type HttpRequest, type HttpResponse, type Query, type Transport, defaultTransport } from "./transport.js";
import type { Capabilities, Health, NodeStatus, Whoami } from "./types.js";

/** Options of a `Client`; all optional. */
export interface ClientOptions {
  /** The server: `unix:///path.sock` or an absolute path (Node), `http(s)://host:port`. Default `SANDBOX_URL`, else `/run/sandboxd.sock`. */
  url?: string;
  /** The token or gateway key, sent as `Authorization: Bearer` only. Default `SANDBOX_TOKEN`. */
  token?: string;
  /** (gateway) The organisation to act in (`X-Sandbox-Org`). */
  org?: string;
  /** Milliseconds a plain request may last (default none: a run lasts as long as its command). Streams are never bounded. */
  timeoutMs?: number;
  /** (Node) PEM certificate(s) to trust for https/wss besides the system's (`NODE_EXTRA_CA_CERTS` works too). */
  ca?: string | Uint8Array;
  /** Replaces the network (tests, custom agents). */
  transport?: Transport;
  /** A browser-style WebSocket class for attach (default: the browser's own; under Node the `ws` package). */
  WebSocket?: WebSocketClass;
}

/** A client of one server. Call `close()` when done (it ends idle keep-alive connections). */
export class Client {
  /** Where the client talks to (with the token; never print it whole: use `displayEndpoint`). */
  readonly endpoint: Endpoint;
  readonly sandboxes: Sandboxes;
  readonly images: Images;
  readonly snapshots: Snapshots;
  readonly volumes: Volumes;
  /** (gateway) Services: replicas kept healthy behind one address. */
  readonly services: Services;
  /** (gateway) Jobs and agent runs. */
  readonly jobs: Jobs;
  /** (gateway) The caller's secrets (names only come back). */
  readonly secrets: Secrets;
  /** (gateway) SSH: the server's host keys, the caller's public keys, short-lived access. */
  readonly ssh: Ssh;
  /** (gateway) API keys (tokens): list, create, revoke (admin). */
  readonly keys: Keys;
  /** @internal */
  readonly transport: Transport;
  /** @internal */
  readonly options: ClientOptions;

  constructor(options: ClientOptions = {}) {
    this.options = options;
    this.endpoint = options.transport?.endpoint ?? resolveEndpoint(options.url, options.token);
    this.transport =
      options.transport ??
      defaultTransport(this.endpoint, {
        headers: options.org ? { "X-Sandbox-Org": options.org } : undefined,
        timeoutMs: options.timeoutMs,
        ca: options.ca,
      });
    this.sandboxes = new Sandboxes(this);
    this.images = new Images(this);
    this.snapshots = new Snapshots(this);
    this.volumes = new Volumes(this);
    this.services = new Services(this);
    this.jobs = new Jobs(this);
    this.secrets = new Secrets(this);
    this.ssh = new Ssh(this);
    this.keys = new Keys(this);
  }

  /** Close idle connections; the client is not used afterwards. */
  async close(): Promise<void> {
    await this.transport.close();
  }

  /** `GET /v1/capabilities`: API version, backend, capability flags, limits, network. */
  capabilities(): Promise<Capabilities> {
    return this.call("GET", "/v1/capabilities");
  }

  /** `GET /v1/health` (gateway): whether it is up (no key needed). */
  health(): Promise<Health> {
    return this.call("GET", "/v1/health");
  }

  /** `GET /v1/node`: the node's status (a sandboxd only; a gateway answers 404). */
  node(): Promise<NodeStatus> {
    return this.call("GET", "/v1/node");
  }

  /** `POST /v1/node/cordon`: stop (`true`) or resume (`false`) taking new sandboxes (a sandboxd only). */
  cordon(cordoned = true): Promise<NodeStatus> {
    return this.call("POST", "/v1/node/cordon", { json: { cordoned } });
  }

  /** `GET /v1/whoami` (gateway): the key's user, tenant and scopes. */
  whoami(): Promise<Whoami> {
    return this.call("GET", "/v1/whoami");
  }

  // -- raw calls (what the resource objects are made of) -------------------------------------------------------

  /** Send one request and return its decoded JSON answer (`undefined` for 204); a non-2xx answer throws. */
  async call<T>(method: string, path: string, options: { json?: unknown; query?: Query } = {}): Promise<T> {
    const resp = await this.send({ method, path, ...options });
    if (resp.status === 204 || resp.body.length === 0) return undefined as T;
    try {
      return JSON.parse(new TextDecoder().decode(resp.body)) as T;
    } catch (err) {
      throw new Internal(`the server sent invalid JSON (HTTP ${resp.status} of ${method} ${path}): ${(err as Error).message}`);
    }
  }

  /** Send one request and return the raw bytes of its 2xx answer. */
  async raw(method: string, path: string, options: { body?: Uint8Array; query?: Query; json?: unknown } = {}): Promise<Uint8Array> {
    return (await this.send({ method, path, ...options })).body;
  }

  /** Follow an ndjson answer: one decoded object per line, as the server flushes them. */
  async *streamLines(method: string, path: string, options: { query?: Query } = {}): AsyncIterable<Record<string, unknown>> {
    const decoder = new TextDecoder();
    let pending = "";
    for await (const chunk of this.transport.stream({ method, path, ...options })) {
      pending += decoder.decode(chunk, { stream: true });
      const lines = pending.split("\n");
      pending = lines.pop()!;
      for (const line of lines) if (line.trim()) yield decodeLine(line);
    }
    pending += decoder.decode();
    if (pending.trim()) yield decodeLine(pending);
  }

  private async send(req: HttpRequest): Promise<HttpResponse> {
    const resp = await this.transport.request(req);
    if (resp.status < 200 || resp.status >= 300) throw errorFromAnswer(resp.status, resp.body);
    return resp;
  }
}

function decodeLine(line: string): Record<string, unknown> {
  let value: unknown;
  try {
    value = JSON.parse(line);
  } catch (err) {
    throw new Internal(`the server sent an invalid ndjson line: ${(err as Error).message}`);
  }
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    throw new Internal(`the server sent an ndjson line that is not an object: ${line.slice(0, 80)}`);
  }
  return value as Record<string, unknown>;
}
