/**
 * The `sbx-stream/1` framing of an attached process (the spec's "Attach"): one type byte, a big-endian uint32
 * payload length, the payload. Client to server: `i` stdin, `e` end of input, `s` a signal name, `r` a resize
 * (rows, cols: big-endian uint16 each). Server to client: `o` stdout, `E` stderr, `x` the exit (big-endian int32,
 * the last frame). Over the WebSocket form each binary message holds one or more whole frames.
 */
import { InvalidRequest } from "./errors.js";

export const STDIN = "i";
export const END_OF_INPUT = "e";
export const SIGNAL = "s";
export const RESIZE = "r";
export const STDOUT = "o";
export const STDERR = "E";
export const EXIT = "x";
/** Types a server sends. */
export const SERVER_TYPES: ReadonlySet<string> = new Set([STDOUT, STDERR, EXIT]);
/** Signal names an `s` frame may carry. */
export const SIGNALS = ["INT", "TERM", "KILL", "HUP"] as const;
export type SignalName = (typeof SIGNALS)[number];
/** Largest payload of one frame, in bytes (1 MiB). */
export const MAX_PAYLOAD_BYTES = 1 << 20;
/** The upgrade token of the raw attach stream. */
export const PROTOCOL = "sbx-stream/1";
/** The WebSocket subprotocol of the attach stream's WebSocket form. */
export const WEBSOCKET_PROTOCOL = "sbx-stream.v1";
/** Prefix of the offered subprotocol carrying the bearer token (browsers, which cannot set Authorization). */
export const WEBSOCKET_BEARER_PREFIX = "bearer.";
/** Prefix of the offered subprotocol carrying the gateway organisation. */
export const WEBSOCKET_ORG_PREFIX = "org.";

/** One decoded frame: its type (one ASCII character) and payload. */
export interface Frame {
  type: string;
  payload: Uint8Array;
}

/** The wire bytes of one frame; a payload over 1 MiB is `InvalidRequest` (use `encodeChunks`). */
export function encodeFrame(type: string, payload: Uint8Array = new Uint8Array()): Uint8Array {
  if (type.length !== 1 || type.charCodeAt(0) > 127) throw new InvalidRequest(`a frame type is one ASCII byte, not '${type}'`);
  if (payload.length > MAX_PAYLOAD_BYTES) {
    throw new InvalidRequest(`a frame payload is at most ${MAX_PAYLOAD_BYTES} bytes, not ${payload.length}: split the data`);
  }
  const out = new Uint8Array(5 + payload.length);
  const view = new DataView(out.buffer);
  out[0] = type.charCodeAt(0);
  view.setUint32(1, payload.length);
  out.set(payload, 5);
  return out;
}

/** `data` as as many `type` frames as it needs (at least one). */
export function encodeChunks(type: string, data: Uint8Array): Uint8Array[] {
  if (data.length === 0) return [encodeFrame(type)];
  const out: Uint8Array[] = [];
  for (let start = 0; start < data.length; start += MAX_PAYLOAD_BYTES) {
    out.push(encodeFrame(type, data.subarray(start, start + MAX_PAYLOAD_BYTES)));
  }
  return out;
}

/** An `s` frame; `SIGTERM` and `TERM` alike, any other name is `InvalidRequest`. */
export function signalFrame(name: string): Uint8Array {
  return encodeFrame(SIGNAL, new TextEncoder().encode(signalName(name)));
}

/** The bare signal name (`TERM` for `SIGTERM`); `InvalidRequest` for one the spec does not list. */
export function signalName(name: string): SignalName {
  const bare = name.toUpperCase().replace(/^SIG/, "");
  if (!(SIGNALS as readonly string[]).includes(bare)) {
    throw new InvalidRequest(`signal '${name}' is not one of ${SIGNALS.join(", ")}`);
  }
  return bare as SignalName;
}

/** An `r` frame: `rows` x `cols` characters, each 1 to 65535. */
export function resizeFrame(rows: number, cols: number): Uint8Array {
  for (const [what, n] of [["rows", rows], ["cols", cols]] as const) {
    if (!Number.isInteger(n) || n < 1 || n > 65535) throw new InvalidRequest(`${what} ${n}: give 1 to 65535`);
  }
  const payload = new Uint8Array(4);
  const view = new DataView(payload.buffer);
  view.setUint16(0, rows);
  view.setUint16(2, cols);
  return encodeFrame(RESIZE, payload);
}

/** The exit code of an `x` frame's payload. */
export function decodeExit(payload: Uint8Array): number {
  if (payload.length !== 4) throw new InvalidRequest(`an exit frame holds 4 bytes, not ${payload.length}`);
  return new DataView(payload.buffer, payload.byteOffset, 4).getInt32(0);
}

/**
 * Turns a byte stream into frames however it is split: `feed` what arrived, get the frames it completed. A type
 * outside `types` or a payload over the limit throws `InvalidRequest` (the stream cannot resynchronise after it).
 */
export class FrameDecoder {
  private buffer = new Uint8Array();

  constructor(
    private readonly types: ReadonlySet<string> | null = null,
    private readonly maxPayloadBytes = MAX_PAYLOAD_BYTES,
  ) {}

  /** Bytes received but not yet part of a complete frame (0 at a frame boundary). */
  get pendingBytes(): number {
    return this.buffer.length;
  }

  feed(data: Uint8Array): Frame[] {
    const joined = new Uint8Array(this.buffer.length + data.length);
    joined.set(this.buffer);
    joined.set(data, this.buffer.length);
    const view = new DataView(joined.buffer);
    const frames: Frame[] = [];
    let offset = 0;
    while (joined.length - offset >= 5) {
      const type = String.fromCharCode(joined[offset]!);
      const length = view.getUint32(offset + 1);
      if (this.types !== null && !this.types.has(type)) {
        throw new InvalidRequest(`unexpected frame type '${type}': expected one of ${[...this.types].join(", ")}`);
      }
      if (length > this.maxPayloadBytes) {
        throw new InvalidRequest(`frame '${type}' declares ${length} payload bytes; the limit is ${this.maxPayloadBytes}`);
      }
      const end = offset + 5 + length;
      if (end > joined.length) break;
      frames.push({ type, payload: joined.slice(offset + 5, end) });
      offset = end;
    }
    this.buffer = joined.slice(offset);
    return frames;
  }
}
