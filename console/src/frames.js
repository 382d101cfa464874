// The sbx-stream/1 frames (docs/node-api.md, Attach): one type byte, a big-endian uint32 length, the payload.
// Over the WebSocket form of attach every binary message holds one or more whole frames, both ways.

export const STDIN = 0x69; // "i"
export const END_OF_INPUT = 0x65; // "e"
export const SIGNAL = 0x73; // "s"
export const RESIZE = 0x72; // "r"
export const STDOUT = 0x6f; // "o"
export const STDERR = 0x45; // "E"
export const EXIT = 0x78; // "x"
export const PROTOCOL = "sbx-stream.v1";

export function frame(type, payload = new Uint8Array(0)) {
  const out = new Uint8Array(5 + payload.length);
  const view = new DataView(out.buffer);
  view.setUint8(0, type);
  view.setUint32(1, payload.length);
  out.set(payload, 5);
  return out;
}

export function resizeFrame(rows, cols) {
  const payload = new Uint8Array(4);
  const view = new DataView(payload.buffer);
  view.setUint16(0, rows);
  view.setUint16(2, cols);
  return frame(RESIZE, payload);
}

export function signalFrame(name) {
  return frame(SIGNAL, new TextEncoder().encode(name));
}

/** The frames of one message (an ArrayBuffer of whole frames) as {type, payload}. */
export function decodeMessage(buffer) {
  const bytes = new Uint8Array(buffer);
  const view = new DataView(buffer);
  const found = [];
  let offset = 0;
  while (offset + 5 <= bytes.length) {
    const length = view.getUint32(offset + 1);
    const end = offset + 5 + length;
    if (end > bytes.length) throw new Error("a message ended inside a frame");
    found.push({ type: bytes[offset], payload: bytes.subarray(offset + 5, end) });
    offset = end;
  }
  if (offset !== bytes.length) throw new Error("a message ended inside a frame header");
  return found;
}

export function exitCode(payload) {
  return new DataView(payload.buffer, payload.byteOffset, 4).getInt32(0);
}
