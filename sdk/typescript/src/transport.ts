/**
 * How requests travel. `NodeTransport` (node:http / node:https, Node 18+) reaches a unix socket or an http(s)
 * address; `FetchTransport` (the global `fetch`) is what a browser uses, http(s) only. Both send the token in the
 * `Authorization` header only and raise only `SandboxError`s: failing to reach the server is `Unavailable`.
 */
import type { ClientRequest, IncomingMessage } from "node:http";
import type { Duplex } from "node:stream";

import { concat } from "./bytes.js";
import { type Endpoint, displayEndpoint } from "./endpoint.js";
import { Internal, InvalidRequest, SandboxError, Unavailable, Unsupported, errorFromAnswer } from "./errors.js";

/** Milliseconds to wait for a connection (10 s); a request itself has no overall limit unless asked. */
export const CONNECT_TIMEOUT_MS = 10_000;

/** Query parameters: a record, or pairs when a name repeats (`label=k=v` twice). */
export type Query = Record<string, string> | ReadonlyArray<readonly [string, string]>;

/** One request: `json` is sent as JSON, `body` as `application/octet-stream`. */
export interface HttpRequest {
  method: string;
  path: string;
  query?: Query;
  json?: unknown;
  body?: Uint8Array;
}

/** A server answer: status, content type (without parameters) and the raw body. */
export interface HttpResponse {
  status: number;
  contentType: string;
  body: Uint8Array;
}

/** Talks to one server; throws only `SandboxError`s. */
export interface Transport {
  readonly endpoint: Endpoint;
  /** Any answer, 2xx or not (the client maps statuses to errors). */
  request(req: HttpRequest): Promise<HttpResponse>;
  /** A 2xx answer's body as it arrives; the error of any other answer. Breaking out of the loop ends the request. */
  stream(req: HttpRequest): AsyncIterable<Uint8Array>;
  /** Switch `GET path` to `protocol` and hand back the raw byte stream (Node only; tunnels). */
  upgrade(path: string, protocol: string, query?: Query): Promise<Duplex>;
  /** Close idle connections; the transport is not used afterwards. */
  close(): Promise<void>;
}

/** Extra options of the transports. */
export interface TransportOptions {
  /** Extra headers on every request (e.g. `X-Sandbox-Org`). */
  headers?: Record<string, string>;
  /** Milliseconds a plain request may last (default: no limit, a run lasts as long as its command). */
  timeoutMs?: number;
  /** (Node) PEM certificate(s) to trust for https besides the system's (a self-signed server's). */
  ca?: string | Uint8Array;
}

/** `path` with `query` appended. */
export function withQuery(path: string, query?: Query): string {
  if (query === undefined) return path;
  const pairs = Array.isArray(query) ? query : Object.entries(query);
  if (pairs.length === 0) return path;
  return `${path}?${new URLSearchParams(pairs.map(([k, v]) => [k, v])).toString()}`;
}

function baseHeaders(endpoint: Endpoint, extra?: Record<string, string>): Record<string, string> {
  const headers: Record<string, string> = { Accept: "application/json", ...extra };
  if (endpoint.token) headers["Authorization"] = `Bearer ${endpoint.token}`;
  return headers;
}

function encodeBody(req: HttpRequest): { body?: Uint8Array; contentType?: string } {
  if (req.json !== undefined) return { body: new TextEncoder().encode(JSON.stringify(req.json)), contentType: "application/json" };
  if (req.body !== undefined) return { body: req.body, contentType: "application/octet-stream" };
  return {};
}

/**
 * The SDK's error for a failure to talk to `endpoint` (connect, disconnect, timeout, TLS): the one place
 * foreign errors become the project's.
 */
export function translateError(err: unknown, endpoint: Endpoint): SandboxError {
  if (err instanceof SandboxError) return err;
  const where = displayEndpoint(endpoint);
  const hint =
    endpoint.socketPath !== undefined
      ? "start it with `sandboxd` or point SANDBOX_URL at a running one"
      : "check that the server listens there and SANDBOX_URL is right";
  const e = err as { code?: string; message?: string } | undefined;
  const code = e?.code ?? "";
  if (code === "EACCES" || code === "EPERM") {
    return new Unavailable(`cannot reach sandboxd at ${where}: permission denied; run as the user that owns the socket`);
  }
  if (["ECONNREFUSED", "ENOENT", "ENOTFOUND", "EAI_AGAIN", "EHOSTUNREACH", "ENETUNREACH"].includes(code)) {
    return new Unavailable(`cannot reach sandboxd at ${where} (${code}): ${hint}`);
  }
  if (code === "SBX_CONNECT_TIMEOUT") return new Unavailable(`cannot reach sandboxd at ${where}: connecting took over ${CONNECT_TIMEOUT_MS / 1000} s`);
  if (code === "SBX_TIMEOUT") return new Unavailable(`sandboxd at ${where} did not answer in time`);
  if (code.includes("CERT") || code.startsWith("ERR_TLS") || code.startsWith("ERR_SSL")) {
    return new Unavailable(
      `the TLS certificate of ${where} is not trusted (${code}): pass its CA as the ca option or in NODE_EXTRA_CA_CERTS`,
    );
  }
  if (code === "ECONNRESET" || code === "EPIPE" || e?.message === "socket hang up" || code === "ERR_STREAM_PREMATURE_CLOSE") {
    return new Unavailable(`sandboxd at ${where} closed the connection before answering; it may have stopped`);
  }
  if (err instanceof TypeError && (err as { cause?: unknown }).cause !== undefined) {
    // fetch reports every network failure as a TypeError with the reason in `cause`.
    return translateError((err as { cause?: unknown }).cause, endpoint);
  }
  if (err instanceof TypeError && /fetch/i.test(err.message)) {
    return new Unavailable(`cannot reach sandboxd at ${where}: ${err.message}`);
  }
  if (code.startsWith("UND_ERR_SOCKET") || code === "UND_ERR_CLOSED") {
    return new Unavailable(`sandboxd at ${where} closed the connection in the middle of an answer; it may have stopped`);
  }
  if (/^(E[A-Z]+|UND_ERR_[A-Z_]+)$/.test(code)) {
    // Any other system or network error: the connection, not the request, failed.
    return new Unavailable(`talking to sandboxd at ${where} failed (${code}): ${e?.message ?? ""}`);
  }
  return new Internal(`unexpected error talking to sandboxd at ${where}: ${e?.message ?? String(err)}`);
}

function timeoutError(code: string): Error & { code: string } {
  return Object.assign(new Error(code), { code });
}

type NodeHttp = typeof import("node:http");

/** The transport of Node: node:http over a unix socket or TCP, node:https for https. Keep-alive connections. */
export class NodeTransport implements Transport {
  readonly endpoint: Endpoint;
  private readonly options: TransportOptions;
  private modules?: Promise<{ mod: NodeHttp; agent: import("node:http").Agent }>;

  constructor(endpoint: Endpoint, options: TransportOptions = {}) {
    this.endpoint = endpoint;
    this.options = options;
  }

  private load(): Promise<{ mod: NodeHttp; agent: import("node:http").Agent }> {
    this.modules ??= (async () => {
      const tls = this.endpoint.socketPath === undefined && this.endpoint.baseUrl.startsWith("https:");
      const mod = (tls ? await import("node:https") : await import("node:http")) as unknown as NodeHttp;
      const agentOptions: Record<string, unknown> = { keepAlive: true };
      if (tls && this.options.ca !== undefined) agentOptions["ca"] = this.options.ca;
      const Agent = mod.Agent as unknown as new (o: Record<string, unknown>) => import("node:http").Agent;
      return { mod, agent: new Agent(agentOptions) };
    })();
    return this.modules;
  }

  private async open(
    req: HttpRequest,
    extraHeaders: Record<string, string> = {},
    timeoutMs?: number,
  ): Promise<{ request: ClientRequest; response: Promise<IncomingMessage>; upgrade: Promise<[IncomingMessage, Duplex, Uint8Array]> }> {
    const { mod, agent } = await this.load();
    const base = new URL(this.endpoint.baseUrl);
    const { body, contentType } = encodeBody(req);
    const headers = baseHeaders(this.endpoint, { ...this.options.headers, ...extraHeaders });
    if (contentType !== undefined) headers["Content-Type"] = contentType;
    if (body !== undefined) headers["Content-Length"] = String(body.length);
    const path = base.pathname.replace(/\/$/, "") + withQuery(req.path, req.query);
    const upgrading = "Upgrade" in extraHeaders;
    const request = mod.request({
      agent: upgrading ? false : agent,
      ...(this.endpoint.socketPath !== undefined
        ? { socketPath: this.endpoint.socketPath, host: "localhost" }
        : { host: base.hostname.replace(/^\[|\]$/g, ""), port: base.port || undefined }),
      ...(upgrading && this.options.ca !== undefined ? { ca: this.options.ca } : {}),
      method: req.method,
      path,
      headers,
    } as import("node:http").RequestOptions);
    let overall: ReturnType<typeof setTimeout> | undefined;
    if (timeoutMs !== undefined) overall = setTimeout(() => request.destroy(timeoutError("SBX_TIMEOUT")), timeoutMs);
    request.on("socket", (socket) => {
      if (!(socket as { connecting?: boolean }).connecting) return;
      const timer = setTimeout(() => request.destroy(timeoutError("SBX_CONNECT_TIMEOUT")), CONNECT_TIMEOUT_MS);
      socket.once("connect", () => clearTimeout(timer));
      socket.once("close", () => clearTimeout(timer));
    });
    const failed = new Promise<never>((_, reject) => {
      request.on("error", (err) => reject(translateError(err, this.endpoint)));
    });
    failed.catch(() => undefined);
    const response = Promise.race([
      new Promise<IncomingMessage>((resolve) => request.on("response", resolve)),
      failed,
    ]);
    const upgrade = Promise.race([
      new Promise<[IncomingMessage, Duplex, Uint8Array]>((resolve) =>
        request.on("upgrade", (res, socket, head) => resolve([res, socket, new Uint8Array(head)])),
      ),
      failed,
    ]);
    response.catch(() => undefined);
    upgrade.catch(() => undefined);
    request.on("close", () => clearTimeout(overall));
    request.end(body);
    return { request, response, upgrade };
  }

  private async readAll(res: IncomingMessage): Promise<Uint8Array> {
    const parts: Uint8Array[] = [];
    try {
      for await (const chunk of res) parts.push(chunk as Uint8Array);
    } catch (err) {
      throw translateError(err, this.endpoint);
    }
    if (!res.complete) {
      throw new Unavailable(`sandboxd at ${displayEndpoint(this.endpoint)} closed the connection in the middle of an answer`);
    }
    return concat(parts);
  }

  async request(req: HttpRequest): Promise<HttpResponse> {
    const { response } = await this.open(req, {}, this.options.timeoutMs);
    const res = await response;
    const body = await this.readAll(res);
    return { status: res.statusCode ?? 0, contentType: contentTypeOf(res.headers["content-type"]), body };
  }

  async *stream(req: HttpRequest): AsyncIterable<Uint8Array> {
    const { request, response } = await this.open(req);
    try {
      const res = await response;
      const status = res.statusCode ?? 0;
      if (status < 200 || status >= 300) throw errorFromAnswer(status, await this.readAll(res));
      try {
        for await (const chunk of res) yield chunk as Uint8Array;
      } catch (err) {
        throw translateError(err, this.endpoint);
      }
      if (!res.complete) {
        throw new Unavailable(`sandboxd at ${displayEndpoint(this.endpoint)} cut the stream of ${req.path}`);
      }
    } finally {
      request.destroy();
    }
  }

  async upgrade(path: string, protocol: string, query?: Query): Promise<Duplex> {
    const { request, response, upgrade } = await this.open(
      { method: "GET", path, query },
      { Connection: "Upgrade", Upgrade: protocol },
    );
    const timer = setTimeout(() => request.destroy(timeoutError("SBX_CONNECT_TIMEOUT")), CONNECT_TIMEOUT_MS);
    try {
      const outcome = await Promise.race([upgrade, response]);
      if (Array.isArray(outcome)) {
        const [res, socket, head] = outcome;
        if ((res.headers["upgrade"] ?? "").toLowerCase() !== protocol.toLowerCase()) {
          socket.destroy();
          throw new Internal(`the server switched to '${res.headers["upgrade"]}' instead of '${protocol}'`);
        }
        if (head.length) socket.unshift(head);
        return socket;
      }
      throw errorFromAnswer(outcome.statusCode ?? 0, await this.readAll(outcome));
    } finally {
      clearTimeout(timer);
    }
  }

  async close(): Promise<void> {
    if (this.modules !== undefined) (await this.modules).agent.destroy();
  }
}

function contentTypeOf(value: string | null | undefined): string {
  return (value ?? "").split(";")[0]!.trim().toLowerCase();
}

/** The transport of browsers (and any runtime with `fetch`): http(s) only, no unix socket, no tunnel. */
export class FetchTransport implements Transport {
  readonly endpoint: Endpoint;
  private readonly options: TransportOptions;

  constructor(endpoint: Endpoint, options: TransportOptions = {}) {
    if (endpoint.socketPath !== undefined) {
      throw new InvalidRequest("a unix socket needs Node: in a browser give an http(s) address");
    }
    this.endpoint = endpoint;
    this.options = options;
  }

  private async send(req: HttpRequest, signal?: AbortSignal): Promise<Response> {
    const { body, contentType } = encodeBody(req);
    const headers = baseHeaders(this.endpoint, this.options.headers);
    if (contentType !== undefined) headers["Content-Type"] = contentType;
    try {
      return await fetch(this.endpoint.baseUrl + withQuery(req.path, req.query), {
        method: req.method,
        headers,
        body: body as BodyInit | undefined,
        signal,
        // The key travels in Authorization only; never a cookie of the page.
        credentials: "omit",
      });
    } catch (err) {
      if ((err as { name?: string }).name === "AbortError") throw translateError(timeoutError("SBX_TIMEOUT"), this.endpoint);
      throw translateError(err, this.endpoint);
    }
  }

  async request(req: HttpRequest): Promise<HttpResponse> {
    const controller = new AbortController();
    const timer = this.options.timeoutMs !== undefined ? setTimeout(() => controller.abort(), this.options.timeoutMs) : undefined;
    try {
      const res = await this.send(req, controller.signal);
      let body: Uint8Array;
      try {
        body = new Uint8Array(await res.arrayBuffer());
      } catch (err) {
        throw translateError(err, this.endpoint);
      }
      return { status: res.status, contentType: contentTypeOf(res.headers.get("content-type")), body };
    } finally {
      clearTimeout(timer);
    }
  }

  async *stream(req: HttpRequest): AsyncIterable<Uint8Array> {
    const controller = new AbortController();
    const res = await this.send(req, controller.signal);
    try {
      if (res.status < 200 || res.status >= 300) throw errorFromAnswer(res.status, new Uint8Array(await res.arrayBuffer()));
      if (res.body === null) return;
      const reader = res.body.getReader();
      for (;;) {
        let chunk: ReadableStreamReadResult<Uint8Array>;
        try {
          chunk = await reader.read();
        } catch (err) {
          throw translateError(err, this.endpoint);
        }
        if (chunk.done) return;
        yield chunk.value;
      }
    } finally {
      controller.abort();
    }
  }

  async upgrade(): Promise<Duplex> {
    throw new Unsupported("a browser cannot open raw upgraded connections (tunnels): use Node");
  }

  async close(): Promise<void> {}
}

/** The default transport of this runtime: `NodeTransport` under Node, else `FetchTransport`. */
export function defaultTransport(endpoint: Endpoint, options: TransportOptions = {}): Transport {
  const isNode = typeof (globalThis as { process?: { versions?: { node?: string } } }).process?.versions?.node === "string";
  return isNode ? new NodeTransport(endpoint, options) : new FetchTransport(endpoint, options);
}
