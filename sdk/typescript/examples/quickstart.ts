import { Client } from "@sbx/sdk";

// SANDBOX_URL and SANDBOX_TOKEN, else the local node's socket /run/sandboxd.sock.
const client = new Client();
const sandbox = await client.sandboxes.create({ image: "default", labels: { app: "quickstart" } });
try {
  const result = await sandbox.run(["python3", "-c", "import sys; print(sys.stdin.read().upper())"], {
    stdin: "hello",
    timeoutSecs: 30,
  });
  console.log(result.exitCode, new TextDecoder().decode(result.stdout).trim());

  await sandbox.files.write("/sandbox/home/notes/todo.txt", "write the docs\n");
  const entries = await sandbox.files.list("/sandbox/home/notes");
  console.log(entries.map((e) => `${e.name} ${e.size}`).join(", "));
  console.log(await sandbox.files.readText("/sandbox/home/notes/todo.txt"));
} finally {
  await sandbox.terminate();
  await client.close();
}
