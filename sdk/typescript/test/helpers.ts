// Shared by the integration tests: the servers come from the environment set by
// tests/integration/test_sdk_typescript.py, which starts them (real sandboxd and sandbox-gateway, gVisor).
import assert from "node:assert/strict";

import { SandboxError } from "@sbx/sdk";

/** The value of environment variable `name`; a test run without it fails saying who sets it. */
export function env(name: string): string {
  const value = process.env[name];
  assert.ok(value, `${name} is not set: run these tests through tests/integration/test_sdk_typescript.py`);
  return value;
}

/** Poll `probe` until it returns something truthy (every 200 ms, up to `timeoutMs`, default 60 s). */
export async function waitFor<T>(probe: () => Promise<T | undefined | null | false>, what: string, timeoutMs = 60_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  let last: unknown;
  for (;;) {
    last = await probe();
    if (last) return last as T;
    assert.ok(Date.now() < deadline, `${what}: not within ${timeoutMs} ms (last: ${JSON.stringify(last)})`);
    await new Promise((resolve) => setTimeout(resolve, 200));
  }
}

/** Assert that `promise` rejects with exactly `cls`, the status and code of the class, and `words` in the message. */
export async function rejectsWith(
  promise: Promise<unknown>,
  cls: (new (message: string) => SandboxError) & { status: number; code: string },
  words: string | RegExp,
): Promise<SandboxError> {
  let caught: unknown;
  try {
    await promise;
  } catch (err) {
    caught = err;
  }
  assert.ok(caught instanceof SandboxError, `expected ${cls.name}, got ${caught === undefined ? "success" : String(caught)}`);
  assert.equal(caught.constructor, cls, `expected ${cls.name}, got ${caught.name}: ${caught.message}`);
  assert.equal(caught.status, cls.status);
  assert.equal(caught.code, cls.code);
  if (typeof words === "string") assert.ok(caught.message.includes(words), `'${words}' not in: ${caught.message}`);
  else assert.match(caught.message, words);
  return caught;
}

export const decode = (data: Uint8Array): string => new TextDecoder().decode(data);

/** Run the compiled example `name` (examples/<name>.ts) with `environment` added; its stdout. Fails with its
 * stderr when it exits non-zero. */
export async function runExample(name: string, environment: Record<string, string>): Promise<string> {
  const { execFile } = await import("node:child_process");
  const { fileURLToPath } = await import("node:url");
  const file = fileURLToPath(new URL(`../examples/${name}.js`, import.meta.url));
  return new Promise((resolve, reject) => {
    execFile(process.execPath, [file], { env: { ...process.env, ...environment }, timeout: 280_000 }, (err, stdout, stderr) => {
      if (err) reject(new Error(`example ${name} failed: ${err.message}\n${stdout}\n${stderr}`));
      else resolve(stdout);
    });
  });
}
