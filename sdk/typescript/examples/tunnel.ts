import { Client } from "@sbx/sdk";

const client = new Client();
const sandbox = await client.sandboxes.create({});
try {
  await sandbox.files.write("/sandbox/home/site/index.html", "<h1>inside the sandbox</h1>\n");
  const web = await sandbox.startProcess(["python3", "-u", "-m", "http.server", "8000", "--bind", "127.0.0.1"], {
    cwd: "/sandbox/home/site",
  });
  for await (const chunk of web.output()) {
    if (new TextDecoder().decode(chunk.data).includes("Serving HTTP")) break;
  }
  // Like `ssh -L`: a local port whose every connection is a tunnel to port 8000 in the sandbox.
  const forward = await sandbox.forward(8000);
  const page = await fetch(`http://127.0.0.1:${forward.port}/`);
  console.log(page.status, (await page.text()).trim());
  await forward.close();

  // One raw TCP connection, as a Node Duplex.
  const tunnel = await sandbox.tunnel(8000);
  tunnel.end("GET / HTTP/1.0\r\n\r\n");
  let answer = "";
  for await (const data of tunnel) answer += data;
  console.log(answer.split("\r\n")[0]);
} finally {
  await sandbox.terminate();
  await client.close();
}
