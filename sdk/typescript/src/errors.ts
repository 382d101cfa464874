/**
 * The one error tree of sbx, as the Python SDK has it (`sbx.api.errors`): one class per (HTTP status, code) pair
 * of the spec's Errors table. Every failure the SDK reports is a `SandboxError`; failing to reach the server is
 * `Unavailable`.
 *
 *     SandboxError                      (base; never thrown itself)
 *     ├── InvalidRequest     400 invalid_request
 *     ├── Unauthorized       401 unauthorized
 *     ├── Refused            403 refused
 *     ├── ForbiddenOrigin    403 forbidden_origin
 *     ├── NotFound           404 not_found
 *     │   └── NotServed      404 unsupported      (gateway) SSH endpoints of a gateway serving no SSH
 *     ├── Conflict           409 conflict
 *     ├── PayloadTooLarge    413 invalid_request
 *     ├── Unsupported        501 unsupported
 *     ├── Unavailable        503 unavailable
 *     ├── BadGateway         502 internal         (gateway) the node did not answer
 *     │   └── GatewayTimeout 504 internal
 *     └── Internal           500 internal
 */

/** Root of every error the service (or the SDK on its behalf) reports. */
export class SandboxError extends Error {
  /** The HTTP status of the class; an instance may carry another one (`errorFromWire`). */
  static readonly status: number = 500;
  /** The wire code of the class (`invalid_request`, `not_found`, ...). */
  static readonly code: string = "internal";
  /** The HTTP status of this error. */
  status: number;
  /** The spec's error code of this error. */
  code: string;

  constructor(message: string) {
    super(message);
    const cls = new.target as unknown as { status: number; code: string; name: string };
    this.name = cls.name;
    this.status = cls.status;
    this.code = cls.code;
  }

  /** The wire body `{"error": {"code", "message"}}`. */
  toBody(): { error: { code: string; message: string } } {
    return { error: { code: this.code, message: this.message } };
  }

  override toString(): string {
    return `${this.code}: ${this.message}`;
  }
}

/** Malformed request, unknown field, or a field out of range (400). */
export class InvalidRequest extends SandboxError {
  static override readonly status: number = 400;
  static override readonly code: string = "invalid_request";
}
/** Missing or wrong token or key (401). */
export class Unauthorized extends SandboxError {
  static override readonly status: number = 401;
  static override readonly code: string = "unauthorized";
}
/** Well-formed but refused by policy; retrying will not help (403). */
export class Refused extends SandboxError {
  static override readonly status: number = 403;
  static override readonly code: string = "refused";
}
/** The request guard refused the Host or Origin header (403). */
export class ForbiddenOrigin extends SandboxError {
  static override readonly status: number = 403;
  static override readonly code: string = "forbidden_origin";
}
/** No such sandbox, process, file or endpoint (404). */
export class NotFound extends SandboxError {
  static override readonly status: number = 404;
  static override readonly code: string = "not_found";
}
/** (gateway) The SSH endpoints of a gateway that serves no SSH (404 with code unsupported). */
export class NotServed extends NotFound {
  static override readonly code: string = "unsupported";
}
/** A name in use, or a sandbox in the wrong state (409). */
export class Conflict extends SandboxError {
  static override readonly status: number = 409;
  static override readonly code: string = "conflict";
}
/** A request body over its cap (413, code invalid_request). */
export class PayloadTooLarge extends SandboxError {
  static override readonly status: number = 413;
  static override readonly code: string = "invalid_request";
}
/** The endpoint lacks the capability the request needs (501). */
export class Unsupported extends SandboxError {
  static override readonly status: number = 501;
  static override readonly code: string = "unsupported";
}
/** The server cannot serve now, is cordoned, or could not be reached (503). */
export class Unavailable extends SandboxError {
  static override readonly status: number = 503;
  static override readonly code: string = "unavailable";
}
/** (gateway) The node did not answer this request (502). */
export class BadGateway extends SandboxError {
  static override readonly status: number = 502;
  static override readonly code: string = "internal";
}
/** (gateway) A service's replica did not begin its answer in time (504). */
export class GatewayTimeout extends BadGateway {
  static override readonly status: number = 504;
}
/** A bug; the message is safe to show (500). */
export class Internal extends SandboxError {
  static override readonly status: number = 500;
  static override readonly code: string = "internal";
}

type ErrorClass = (new (message: string) => SandboxError) & { status: number; code: string };

/** Every class of the tree, in the order of the spec's table. */
export const ERROR_CLASSES: readonly ErrorClass[] = [
  InvalidRequest,
  Unauthorized,
  Refused,
  ForbiddenOrigin,
  NotFound,
  NotServed,
  Conflict,
  PayloadTooLarge,
  Unsupported,
  Unavailable,
  BadGateway,
  GatewayTimeout,
  Internal,
];

const BY_STATUS_AND_CODE = new Map<string, ErrorClass>(ERROR_CLASSES.map((cls) => [`${cls.status} ${cls.code}`, cls]));

/**
 * The error of an HTTP status and a decoded error body. An unknown pair keeps its status and code on the class of
 * the same code (else `Internal`), so whoever passes it on passes on what was sent.
 */
export function errorFromWire(status: number, body: unknown): SandboxError {
  let code = "internal";
  let message = `HTTP ${status}`;
  const detail = (body as { error?: unknown } | null)?.error;
  if (typeof detail === "object" && detail !== null) {
    const d = detail as { code?: unknown; message?: unknown };
    if (d.code !== undefined) code = String(d.code);
    if (d.message !== undefined) message = String(d.message);
  }
  const cls = BY_STATUS_AND_CODE.get(`${status} ${code}`);
  if (cls !== undefined) return new cls(message);
  const sameCode = ERROR_CLASSES.find((c) => c.code === code) ?? Internal;
  const error = new sameCode(message);
  error.status = status;
  error.code = code;
  return error;
}

/** The error of a non-2xx answer from its raw body; a body that is not the error JSON still names the status. */
export function errorFromAnswer(status: number, body: Uint8Array): SandboxError {
  let decoded: unknown = null;
  try {
    decoded = body.length ? JSON.parse(new TextDecoder().decode(body)) : null;
  } catch {
    decoded = null;
  }
  return errorFromWire(status, decoded);
}
