// What tests/integration/test_sdk_typescript.py runs in Debian's Chromium: the SDK bundled for browsers (esbuild,
// platform browser) calling a gateway of another origin (CORS) with fetch and the browser's own WebSocket.
// Returns what it saw; the Python side checks it.
export async function scenario({ url, key }) {
  const { Client, Sandbox } = window.sbx;
  const decode = (bytes) => new TextDecoder().decode(bytes);
  const client = new Client({ url, token: key });
  const out = {};
  const sandbox = await client.sandboxes.create({ labels: { suite: "sdk-typescript-browser" } });
  try {
    const run = await sandbox.run(["sh", "-c", "cat; echo err >&2; exit 3"], { stdin: "from the page" });
    out.run = [run.exitCode, decode(run.stdout), decode(run.stderr)];
    await sandbox.files.write("/sandbox/home/page.bin", new Uint8Array([0, 1, 254, 255]));
    out.file = [...(await sandbox.files.read("/sandbox/home/page.bin"))];
    out.listed = (await sandbox.files.list("/sandbox/home")).some((e) => e.name === "page.bin");

    const proc = await sandbox.startProcess(["sh", "-c", "echo one; read x; echo got $x; exit 5"]);
    for await (const chunk of proc.output()) {
      out.followed = decode(chunk.data);
      break;
    }
    const attached = await proc.attach();
    await attached.writeStdin("typed\n");
    let text = "";
    for await (const frame of attached) if (frame.type === "o") text += decode(frame.payload);
    out.attach = [text, attached.exitCode];

    const tty = await sandbox.startProcess(["sh", "-c", "stty size; read x; stty size"], { tty: true, rows: 24, cols: 80 });
    const terminal = await tty.attach();
    await terminal.resize(33, 99);
    await terminal.writeStdin("\r");
    let screen = "";
    for await (const frame of terminal) if (frame.type === "o") screen += decode(frame.payload);
    out.resized = screen.includes("33 99");

    const stranger = new Client({ url, token: "sgk_wrong" });
    out.errors = {};
    const attempts = {
      notFound: () => client.sandboxes.get("sbx_nope"),
      unauthorized: () => stranger.sandboxes.list(),
      attachUnauthorized: () => new Sandbox(stranger, sandbox.info).attach(proc.pid),
      tunnel: () => sandbox.tunnel(80),
      forward: () => sandbox.forward(80),
      unixSocket: async () => new Client({ url: "unix:///run/sandboxd.sock" }),
    };
    for (const [name, attempt] of Object.entries(attempts)) {
      try {
        await attempt();
        out.errors[name] = "no error";
      } catch (err) {
        out.errors[name] = [err.name, err.status, err.code];
      }
    }
  } finally {
    await sandbox.terminate();
  }
  out.terminated = (await client.sandboxes.get(sandbox.id)).state;
  return out;
}
