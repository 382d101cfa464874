// The TypeScript SDK's half of bench/bench_sdk_typescript.py: prints one JSON line of timings (seconds).
// node bench/sdk_typescript_bench.mjs <unix socket> <runs> <file MiB> <keys>
import { Client } from "../sdk/typescript/dist/index.js";

const [socketPath, runsArg, mibArg, keysArg] = process.argv.slice(2);
const client = new Client({ url: `unix://${socketPath}` });
const sandbox = await client.sandboxes.create({});
const now = () => performance.now() / 1000;
try {
  const run = [];
  for (let i = 0; i < Number(runsArg); i++) {
    const t = now();
    await sandbox.run(["true"]);
    run.push(now() - t);
  }
  const data = new Uint8Array(Number(mibArg) * 1024 * 1024).fill(120);
  let t = now();
  await sandbox.files.write("/sandbox/home/blob", data);
  const write = now() - t;
  t = now();
  const back = await sandbox.files.read("/sandbox/home/blob");
  const read = now() - t;
  if (back.length !== data.length) throw new Error("short read");
  const proc = await sandbox.startProcess(["cat"], { tty: true });
  const attached = await proc.attach();
  const echo = [];
  for (let i = 0; i < Number(keysArg); i++) {
    t = now();
    await attached.writeStdin("k");
    let seen = "";
    while (!seen.includes("k")) seen += new TextDecoder().decode((await attached.recv()).payload);
    echo.push(now() - t);
  }
  attached.close();
  console.log(JSON.stringify({ run, write, read, echo }));
} finally {
  await sandbox.terminate();
  await client.close();
}
