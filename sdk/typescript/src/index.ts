/**
 * The TypeScript SDK of sbx (docs/sdk-typescript.md): a client of a sandboxd node or a sandbox-gateway, in Node 18+
 * (unix socket or http(s)) and in browsers (http(s)).
 */
export { Client, type ClientOptions } from "./client.js";
export {
  Sandbox,
  Sandboxes,
  Process,
  Files,
  sandboxPath,
  TUNNEL_PROTOCOL,
  type Forward,
  type RunOptions,
  type ProcessOptions,
} from "./sandbox.js";
export { Attachment, MAX_BUFFERED_BYTES, openAttachment, type AttachOptions, type WebSocketClass } from "./attach.js";
export { Images, Snapshots, Volumes } from "./resources.js";
export { Ports, MAX_PORT_TOKEN_TTL_SECS } from "./ports.js";
export { Services, Jobs, Secrets, Ssh, Keys } from "./gateway.js";
export * from "./errors.js";
export * as frames from "./frames.js";
export type { Frame } from "./frames.js";
export { resolveEndpoint, displayEndpoint, DEFAULT_SOCKET, ENV_URL, ENV_TOKEN, type Endpoint } from "./endpoint.js";
export {
  NodeTransport,
  FetchTransport,
  defaultTransport,
  translateError,
  CONNECT_TIMEOUT_MS,
  type Transport,
  type TransportOptions,
  type HttpRequest,
  type HttpResponse,
  type Query,
} from "./transport.js";
export { toBase64, fromBase64, text } from "./bytes.js";
export type * from "./types.js";
