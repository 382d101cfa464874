import { Client } from "@sbx/sdk";

const client = new Client();
const sandbox = await client.sandboxes.create({});
try {
  // A shell on a terminal; attach over the WebSocket (output replayed from the start).
  const shell = await sandbox.startProcess(["bash", "--norc", "--noprofile"], { tty: true, rows: 24, cols: 80 });
  const terminal = await shell.attach();
  await terminal.resize(50, 132);
  await terminal.writeStdin("stty size; exit 3\r");
  let screen = "";
  for await (const frame of terminal) {
    if (frame.type === "o") screen += new TextDecoder().decode(frame.payload);
  }
  console.log(screen.includes("50 132") ? "resized to 50 x 132" : `unexpected screen: ${screen}`);
  console.log("exit code", terminal.exitCode);
} finally {
  await sandbox.terminate();
  await client.close();
}
