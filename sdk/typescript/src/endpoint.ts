/**
 * Where the server is. An endpoint is chosen as: the option, then `SANDBOX_URL` / `SANDBOX_TOKEN` (Node only),
 * then the default unix socket `/run/sandboxd.sock`, as the Python SDK and the CLI do. Accepted addresses:
 * `unix:///path/to/sandboxd.sock` or a bare absolute path (Node only), `http://host:port`, `https://host:port`
 * (an optional path prefix is kept).
 */
import { InvalidRequest } from "./errors.js";

export const DEFAULT_SOCKET = "/run/sandboxd.sock";
export const ENV_URL = "SANDBOX_URL";
export const ENV_TOKEN = "SANDBOX_TOKEN";

/** A resolved server address: a unix socket or an http(s) base URL, and the token (never part of a URL). */
export interface Endpoint {
  /** `http://localhost` for a unix socket, else the base URL without a trailing slash. */
  readonly baseUrl: string;
  readonly socketPath?: string;
  readonly token?: string;
}

/** The address as a user would write it, for messages (never with the token). */
export function displayEndpoint(endpoint: Endpoint): string {
  return endpoint.socketPath !== undefined ? `unix://${endpoint.socketPath}` : endpoint.baseUrl;
}

function processEnv(): Record<string, string | undefined> {
  const proc = (globalThis as { process?: { env?: Record<string, string | undefined> } }).process;
  return proc?.env ?? {};
}

/**
 * The endpoint of `url` and `token`, else of `SANDBOX_URL` / `SANDBOX_TOKEN` in `env` (default: the process's
 * environment), else the default socket. An empty string counts as not given. Throws `InvalidRequest` naming the
 * accepted forms for any other address, and for a URL with credentials, a query or a fragment (the key goes in
 * `token`, never in a URL).
 */
export function resolveEndpoint(
  url?: string,
  token?: string,
  env: Record<string, string | undefined> = processEnv(),
): Endpoint {
  const address = url || env[ENV_URL] || `unix://${DEFAULT_SOCKET}`;
  const secret = token || env[ENV_TOKEN] || undefined;
  const withToken = (e: { baseUrl: string; socketPath?: string }): Endpoint =>
    secret === undefined ? e : { ...e, token: secret };
  if (address.startsWith("unix:")) {
    const path = address.slice("unix:".length).replace(/^\/\//, "");
    if (!path) throw new InvalidRequest(`'${address}' names no socket: write unix:///path/to/sandboxd.sock`);
    return withToken({ baseUrl: "http://localhost", socketPath: path });
  }
  if (address.startsWith("/")) return withToken({ baseUrl: "http://localhost", socketPath: address });
  let parsed: URL;
  try {
    parsed = new URL(address);
  } catch {
    parsed = new URL("invalid://");
  }
  if (parsed.username || parsed.password) {
    throw new InvalidRequest("a server address takes no credentials: pass the key as the token option or SANDBOX_TOKEN");
  }
  if ((parsed.protocol !== "http:" && parsed.protocol !== "https:") || !parsed.host) {
    throw new InvalidRequest(
      `'${address}' is not a sandboxd address: use unix:///path/to/sandboxd.sock, http://host:port or https://host:port`,
    );
  }
  if (parsed.search || parsed.hash) {
    throw new InvalidRequest(`'${address}': a server address takes no query or fragment`);
  }
  return withToken({ baseUrl: address.replace(/\/+$/, "") });
}
