/**
 * `sandbox.ports`: a sandbox's TCP ports on URLs of their own (capability `exposed_ports`: a gateway run with
 * `--ports-domain`; docs/ports.md). A gateway without it, and a plain node, answer `Unsupported`.
 *
 *     for (const port of await sandbox.ports.list()) console.log(port.port, port.url, port.public, port.listening);
 *     const link = await sandbox.ports.token(8000, 600);   // a URL a browser opens without a key
 *     await sandbox.ports.public(8000, true);              // anyone may open it now
 */
import type { Client } from "./client.js";
import { InvalidRequest } from "./errors.js";
import type { Port, PortToken } from "./types.js";

/** The longest lifetime of a port token, in seconds (the default is 3600). */
export const MAX_PORT_TOKEN_TTL_SECS = 86400;

function checkPort(port: number): number {
  if (!Number.isInteger(port) || port < 1 || port > 65535) {
    throw new InvalidRequest(`port ${JSON.stringify(port)}: give a TCP port number, 1 to 65535`);
  }
  return port;
}

/** The ports of one sandbox. A private port (the default) opens with the owner's key or a port token; a public one for anyone. */
export class Ports {
  private readonly path: string;

  /** @internal use `sandbox.ports`. */
  constructor(
    private readonly client: Client,
    sandboxPath: string,
  ) {
    this.path = `${sandboxPath}/ports`;
  }

  /** `GET .../ports`: every port the guest listens on and every public one, by number. */
  async list(): Promise<Port[]> {
    return (await this.client.call<{ ports: Port[] }>("GET", this.path)).ports;
  }

  /** `GET .../ports/{port}`: one port (any 1 to 65535, listened on or not). */
  async get(port: number): Promise<Port> {
    return this.client.call("GET", `${this.path}/${checkPort(port)}`);
  }

  /** The URL of `port` (`http(s)://<label>.<ports domain>/`): the owner's key opens it, anyone once public; for a browser use `token()`. */
  async url(port: number): Promise<string> {
    return (await this.get(port)).url;
  }

  /** `PUT .../ports/{port}`: `true` makes it public (anyone with the URL may open it), `false` private again. Scope `sandbox:create`. */
  async public(port: number, isPublic = true): Promise<Port> {
    if (typeof isPublic !== "boolean") {
      throw new InvalidRequest(`public ${JSON.stringify(isPublic)}: give true (anyone may open it) or false (private)`);
    }
    return this.client.call("PUT", `${this.path}/${checkPort(port)}`, { json: { public: isPublic } });
  }

  /**
   * `POST .../ports/{port}/tokens`: a port token good for `ttlSecs` (1 to 86400; the server's default 3600 when left
   * out). Its `url` opens that one port in a browser without a key (the token becomes a cookie of that host) until
   * `expires_at`, or until the key that made it is revoked or the sandbox ends. Whoever holds the URL can use it.
   */
  async token(port: number, ttlSecs?: number): Promise<PortToken> {
    checkPort(port);
    if (ttlSecs !== undefined && (!Number.isInteger(ttlSecs) || ttlSecs < 1 || ttlSecs > MAX_PORT_TOKEN_TTL_SECS)) {
      throw new InvalidRequest(`ttlSecs ${JSON.stringify(ttlSecs)}: give 1 to ${MAX_PORT_TOKEN_TTL_SECS} seconds (default 3600)`);
    }
    const json = ttlSecs === undefined ? {} : { ttl_secs: ttlSecs };
    return this.client.call("POST", `${this.path}/${port}/tokens`, { json });
  }
}
