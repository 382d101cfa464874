import { Client, Conflict, NotFound, SandboxError } from "@sbx/sdk";

const client = new Client();
try {
  await client.sandboxes.get("no-such-sandbox");
} catch (err) {
  if (err instanceof NotFound) console.log(err.status, err.code, "-", err.message);
}
const first = await client.sandboxes.create({ name: "example-unique" });
try {
  await client.sandboxes.create({ name: "example-unique" });
} catch (err) {
  // Every error of the SDK is a SandboxError carrying the spec's status and code.
  if (err instanceof Conflict && err instanceof SandboxError) console.log(err.status, err.code);
} finally {
  await first.terminate();
  await client.close();
}
