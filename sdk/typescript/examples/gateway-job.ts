import { Client } from "@sbx/sdk";

// A gateway: SANDBOX_URL=https://gateway.example:8443 and SANDBOX_TOKEN=<your key>.
const client = new Client();
try {
  console.log("I am", (await client.whoami()).user);
  await client.secrets.set("GREETING", "hello from a secret");
  const job = await client.jobs.create({
    command: ["sh", "-c", 'echo "$GREETING" > /sandbox/home/out.txt; echo done'],
    secrets: ["GREETING"],
    keep: { files: ["/sandbox/home/out.txt"] },
  });
  const finished = await client.jobs.wait(job.id, { timeoutMs: 300_000 });
  const output = await client.jobs.output(job.id, 1);
  console.log(finished.state, new TextDecoder().decode(output.stdout).trim());
  console.log(new TextDecoder().decode(await client.jobs.file(job.id, 1, "/sandbox/home/out.txt")).trim());
  await client.secrets.delete("GREETING");
} finally {
  await client.close();
}
