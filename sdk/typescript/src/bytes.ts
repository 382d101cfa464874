/** Bytes helpers that work in Node and in browsers (base64 is how the wire carries bytes inside JSON). */

type BufferLike = { from(data: Uint8Array | string, encoding?: string): Uint8Array & { toString(enc: string): string } };
const NodeBuffer = (globalThis as { Buffer?: BufferLike }).Buffer;

/** The base64 text of `data`. */
export function toBase64(data: Uint8Array): string {
  if (NodeBuffer) return NodeBuffer.from(data).toString("base64");
  let binary = "";
  for (const byte of data) binary += String.fromCharCode(byte);
  return btoa(binary);
}

/** The bytes of base64 `text`. */
export function fromBase64(text: string): Uint8Array {
  if (NodeBuffer) return new Uint8Array(NodeBuffer.from(text, "base64"));
  const binary = atob(text);
  const out = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) out[i] = binary.charCodeAt(i);
  return out;
}

/** `data` as bytes: a string is encoded as UTF-8. */
export function asBytes(data: Uint8Array | string): Uint8Array {
  return typeof data === "string" ? new TextEncoder().encode(data) : data;
}

/** The concatenation of `parts`. */
export function concat(parts: readonly Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let offset = 0;
  for (const part of parts) {
    out.set(part, offset);
    offset += part.length;
  }
  return out;
}

/** `data` decoded as UTF-8 text. */
export function text(data: Uint8Array): string {
  return new TextDecoder().decode(data);
}
