import { Client } from "@sbx/sdk";

const client = new Client();
// A persistent sandbox sleeps (suspended) at its idle timeout instead of ending; it has a name to be found by.
const sandbox = await client.sandboxes.create({ name: "notebook", persistent: true, idle_timeout_secs: 600 });
try {
  await sandbox.files.write("/sandbox/home/state.txt", "kept across a stop");
  await sandbox.stop(); // its processes end and its memory is freed; its disk is kept
  console.log(sandbox.state, sandbox.stoppedReason);

  const again = await client.sandboxes.get("notebook"); // reading it does not wake it
  console.log(again.state);
  const result = await again.run(["cat", "/sandbox/home/state.txt"]); // a call that needs the guest does
  console.log(new TextDecoder().decode(result.stdout), (await again.refresh()).state);
} finally {
  await sandbox.terminate();
  await client.close();
}
