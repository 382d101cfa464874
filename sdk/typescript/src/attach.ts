/**
 * Attach to a process over the WebSocket form of `sbx-stream/1` (capability `websocket_attach`): its output is
 * replayed from the start, then followed; stdin, signals and terminal resizes go the other way.
 *
 * Node uses the `ws` package (Node 18 has no WebSocket) and sends the key in the `Authorization` header; a browser
 * uses its own WebSocket and offers the key as the subprotocol `bearer.<key>` (a browser cannot set headers on a
 * WebSocket). Either way the key is never part of the URL, and the server never echoes it.
 */
import { type Endpoint, displayEndpoint } from "./endpoint.js";
import { InvalidRequest, Unavailable, errorFromAnswer, type SandboxError } from "./errors.js";
import {
  END_OF_INPUT,
  EXIT,
  type Frame,
  FrameDecoder,
  SERVER_TYPES,
  STDIN,
  WEBSOCKET_BEARER_PREFIX,
  WEBSOCKET_ORG_PREFIX,
  WEBSOCKET_PROTOCOL,
  decodeExit,
  encodeChunks,
  encodeFrame,
  resizeFrame,
  signalFrame,
} from "./frames.js";
import { asBytes, concat } from "./bytes.js";
import { CONNECT_TIMEOUT_MS, translateError } from "./transport.js";

/** What the attachment needs of a WebSocket, in Node (`ws`) or a browser. */
interface Socket {
  send(data: Uint8Array): Promise<void>;
  close(): void;
  /** Stop and restart reading (Node's `ws`; a browser's WebSocket cannot). */
  pause?(): void;
  resume?(): void;
}

/** Received bytes held for a reader that does not keep up before reading from the connection stops (4 MiB). */
export const MAX_BUFFERED_BYTES = 4 << 20;

type Event = { kind: "data"; data: Uint8Array } | { kind: "closed"; code: number; reason: string } | { kind: "error"; error: SandboxError };

/**
 * A process attached over the WebSocket: receive its frames (`o` stdout, `E` stderr, `x` exit), send input.
 *
 * `recv()` gives the next frame, or `null` once the stream ended after the exit (or after `close()`);
 * `for await (const frame of attachment)` does the same. After the `x` frame `exitCode` holds the exit code.
 * A stream that ends before the exit (the connection cut, the server gone) throws `Unavailable`: attach again,
 * the output is replayed from the start. Closing detaches and never stops the process.
 */
export class Attachment implements AsyncIterable<Frame> {
  /** The process's handle. */
  readonly pid: number;
  /** The exit code once the `x` frame arrived, else `null`. */
  exitCode: number | null = null;
  private readonly socket: Socket;
  private readonly decoder = new FrameDecoder(SERVER_TYPES);
  private readonly ready: Frame[] = [];
  private readonly events: Event[] = [];
  private wake: (() => void) | null = null;
  private closedByUs = false;
  private ended = false;
  private bufferedBytes = 0;
  private paused = false;

  /** @internal use `Sandbox.attach` or `Process.attach`. */
  constructor(pid: number, open: (push: (e: Event) => void) => Socket) {
    this.pid = pid;
    this.socket = open((event) => {
      this.events.push(event);
      if (event.kind === "data") {
        // A reader that does not keep up: stop reading, so the server's output waits there, not here.
        this.bufferedBytes += event.data.length;
        if (this.bufferedBytes > MAX_BUFFERED_BYTES && !this.paused && this.socket?.pause) {
          this.paused = true;
          this.socket.pause();
        }
      }
      this.wake?.();
    });
  }

  /** Bytes received and not yet read (at most about `MAX_BUFFERED_BYTES`: past it, reading stops). */
  get buffered(): number {
    return this.bufferedBytes;
  }

  /** Send one frame of `type` (a payload over 1 MiB goes as several frames). */
  async send(type: string, payload: Uint8Array = new Uint8Array()): Promise<void> {
    await this.sendRaw(concat(encodeChunks(type, payload)));
  }

  /** Send `data` (a string as UTF-8) to the process's stdin. */
  async writeStdin(data: Uint8Array | string): Promise<void> {
    const bytes = asBytes(data);
    if (bytes.length) await this.send(STDIN, bytes);
  }

  /** End the input: stdin is closed; a terminal gets ^D. */
  async closeStdin(): Promise<void> {
    await this.sendRaw(encodeFrame(END_OF_INPUT));
  }

  /** Send `INT`, `TERM`, `KILL` or `HUP` (a `SIG` prefix is accepted). */
  async signal(name: string): Promise<void> {
    await this.sendRaw(signalFrame(name));
  }

  /** Resize the process's terminal to `rows` x `cols` characters. */
  async resize(rows: number, cols: number): Promise<void> {
    await this.sendRaw(resizeFrame(rows, cols));
  }

  /** The next frame, or `null` once the stream ended after the exit or after `close()`. */
  async recv(): Promise<Frame | null> {
    while (this.ready.length === 0) {
      if (this.ended) return null;
      const event = this.events.shift();
      if (event === undefined) {
        await new Promise<void>((resolve) => (this.wake = resolve));
        this.wake = null;
        continue;
      }
      if (event.kind === "error") {
        this.ended = true;
        if (this.closedByUs || this.exitCode !== null) return null;
        throw event.error;
      }
      if (event.kind === "closed") {
        this.ended = true;
        if (this.closedByUs || this.exitCode !== null) return null;
        throw new Unavailable(
          `the attach stream of process ${this.pid} ended before the process exited` +
            (event.reason ? ` (${event.reason})` : ` (close code ${event.code})`) +
            "; attach again: its output is replayed from the start",
        );
      }
      this.bufferedBytes -= event.data.length;
      if (this.paused && this.bufferedBytes <= MAX_BUFFERED_BYTES / 2) {
        this.paused = false;
        this.socket.resume?.();
      }
      try {
        this.ready.push(...this.decoder.feed(event.data));
      } catch (err) {
        this.ended = true;
        this.socket.close();
        throw new Unavailable(`the server sent a malformed frame: ${(err as Error).message}`);
      }
    }
    const frame = this.ready.shift()!;
    if (frame.type === EXIT) this.exitCode = decodeExit(frame.payload);
    return frame;
  }

  async *[Symbol.asyncIterator](): AsyncIterator<Frame> {
    for (;;) {
      const frame = await this.recv();
      if (frame === null) return;
      yield frame;
    }
  }

  /** Detach: close the connection (the process keeps running). */
  close(): void {
    this.closedByUs = true;
    this.socket.close();
    this.events.push({ kind: "closed", code: 1000, reason: "" });
    this.wake?.();
  }

  private async sendRaw(wire: Uint8Array): Promise<void> {
    if (this.ended || this.closedByUs) {
      throw new Unavailable(`the attach stream of process ${this.pid} is closed: attach again`);
    }
    await this.socket.send(wire);
  }
}

/** A WebSocket class with the browser's interface (the standard `WebSocket`). */
export type WebSocketClass = new (url: string, protocols: string[]) => WebSocket;

/** Extra options of an attachment. */
export interface AttachOptions {
  /**
   * The WebSocket class to use the browser's way (the key offered as a subprotocol, no headers). Default: the
   * runtime's own `WebSocket` in a browser; under Node the `ws` package with the key in `Authorization`.
   */
  WebSocket?: WebSocketClass;
  /**
   * Called when a browser-style WebSocket fails to open (a browser hides the refusal's status and body): a plain
   * request that throws the server's error for the same resource, so the caller gets `Unauthorized`, `NotFound`,
   * ... rather than a bare `Unavailable`.
   */
  diagnose?: () => Promise<unknown>;
  /** The gateway organisation to act in (as `X-Sandbox-Org`). */
  org?: string;
  /** (Node) PEM certificate(s) to trust for wss besides the system's. */
  ca?: string | Uint8Array;
}

/** Open the WebSocket attach of `path` (`.../processes/{pid}/attach/websocket`) on `endpoint`. */
export async function openAttachment(endpoint: Endpoint, path: string, pid: number, options: AttachOptions = {}): Promise<Attachment> {
  const isNode = typeof (globalThis as { process?: { versions?: { node?: string } } }).process?.versions?.node === "string";
  const NativeWebSocket = options.WebSocket ?? (isNode ? undefined : (globalThis as { WebSocket?: WebSocketClass }).WebSocket);
  let opened!: Promise<void>;
  let attachment: Attachment;
  if (NativeWebSocket === undefined && isNode) {
    const { WebSocket: NodeWebSocket } = await import("ws");
    const base = new URL(endpoint.baseUrl);
    const fullPath = base.pathname.replace(/\/$/, "") + path;
    const url =
      endpoint.socketPath !== undefined
        ? `ws+unix:${endpoint.socketPath}:${fullPath}`
        : `${base.protocol === "https:" ? "wss:" : "ws:"}//${base.host}${fullPath}`;
    const headers: Record<string, string> = {};
    if (endpoint.token) headers["Authorization"] = `Bearer ${endpoint.token}`;
    if (options.org) headers["X-Sandbox-Org"] = options.org;
    // Over a unix socket the request guard wants a loopback Host.
    if (endpoint.socketPath !== undefined) headers["Host"] = "localhost";
    attachment = new Attachment(pid, (push) => {
      const ws = new NodeWebSocket(url, [WEBSOCKET_PROTOCOL], {
        headers,
        handshakeTimeout: CONNECT_TIMEOUT_MS,
        perMessageDeflate: false,
        ...(options.ca !== undefined ? { ca: options.ca } : {}),
      });
      opened = new Promise<void>((resolve, reject) => {
        let settled = false;
        ws.once("open", () => {
          settled = true;
          resolve();
        });
        ws.once("unexpected-response", (_req, res) => {
          const parts: Uint8Array[] = [];
          res.on("data", (chunk: Uint8Array) => parts.push(chunk));
          res.on("end", () => {
            settled = true;
            reject(errorFromAnswer(res.statusCode ?? 0, concat(parts)));
          });
          res.on("error", (err) => reject(translateError(err, endpoint)));
        });
        ws.on("error", (err) => {
          const error = translateError(err, endpoint);
          if (!settled) {
            settled = true;
            reject(
              /timed out/i.test(err.message)
                ? new Unavailable(`sandboxd at ${displayEndpoint(endpoint)} did not answer the attach in time`)
                : error,
            );
          } else {
            push({
              kind: "error",
              error: new Unavailable(
                `the attach stream of process ${pid} ended before the process exited (${error.message}); ` +
                  "attach again: its output is replayed from the start",
              ),
            });
          }
        });
      });
      ws.on("message", (data: Buffer | ArrayBuffer | Buffer[]) => {
        const bytes = Array.isArray(data) ? concat(data) : new Uint8Array(data as ArrayBuffer);
        push({ kind: "data", data: bytes });
      });
      ws.on("close", (code: number, reason: Buffer) => push({ kind: "closed", code, reason: reason.toString() }));
      return {
        send: (data) =>
          new Promise<void>((resolve, reject) =>
            ws.send(data, { binary: true }, (err) =>
              err ? reject(new Unavailable(`the attach stream of process ${pid} broke: ${err.message}`)) : resolve(),
            ),
          ),
        close: () => ws.close(1000),
        pause: () => ws.pause(),
        resume: () => ws.resume(),
      };
    });
  } else {
    if (NativeWebSocket === undefined) throw new InvalidRequest("this runtime has no WebSocket");
    if (endpoint.socketPath !== undefined) throw new InvalidRequest("a unix socket needs Node");
    const base = new URL(endpoint.baseUrl);
    const url = `${base.protocol === "https:" ? "wss:" : "ws:"}//${base.host}${base.pathname.replace(/\/$/, "")}${path}`;
    const protocols = [WEBSOCKET_PROTOCOL];
    if (endpoint.token) protocols.push(WEBSOCKET_BEARER_PREFIX + endpoint.token);
    if (options.org) protocols.push(WEBSOCKET_ORG_PREFIX + options.org);
    attachment = new Attachment(pid, (push) => {
      const ws = new NativeWebSocket(url, protocols);
      ws.binaryType = "arraybuffer";
      opened = new Promise<void>((resolve, reject) => {
        ws.onopen = () => resolve();
        ws.onerror = () => {
          const refused = new Unavailable(`the attach of process ${pid} at ${displayEndpoint(endpoint)} was refused or could not connect`);
          if (options.diagnose === undefined) reject(refused);
          else options.diagnose().then(() => reject(refused), reject);
        };
      });
      ws.onmessage = (event: MessageEvent) => push({ kind: "data", data: new Uint8Array(event.data as ArrayBuffer) });
      ws.onclose = (event: CloseEvent) => push({ kind: "closed", code: event.code, reason: event.reason });
      return {
        send: async (data) => ws.send(data),
        close: () => ws.close(1000),
      };
    });
  }
  await opened;
  return attachment;
}
