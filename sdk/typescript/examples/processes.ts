import { Client } from "@sbx/sdk";

const client = new Client();
const sandbox = await client.sandboxes.create({});
try {
  // A background process: its output is followed as it comes, from the beginning.
  const server = await sandbox.startProcess(["sh", "-c", "for i in 1 2 3; do echo tick $i; sleep 1; done; exit 2"]);
  for await (const chunk of server.output()) {
    process.stdout.write(`[${chunk.stream}] ${new TextDecoder().decode(chunk.data)}`);
  }
  console.log("exit code", server.exitCode);

  // Signals: INT, TERM, KILL or HUP.
  const sleeper = await sandbox.startProcess(["sleep", "600"]);
  await sleeper.signal("TERM");
  console.log("stopped by TERM:", (await sleeper.wait()) !== 0);
} finally {
  await sandbox.terminate();
  await client.close();
}
