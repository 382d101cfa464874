// SSH: the gateway's host keys (their SHA256 fingerprints, as ssh-keygen -l prints them, and known_hosts lines),
// the ssh command line for a sandbox, a short-lived token login for one sandbox (shown once), and the caller's
// registered SSH keys (register, list, delete).

import { base64Bytes, del, enc, get, post } from "../api.js";
import { action, clear, confirm, copyButton, dialog, errorBox, fmtTime, h, table, toast } from "../ui.js";

/** `SHA256:...` of an OpenSSH public key line, as `ssh-keygen -l` prints it (base64 without padding). */
async function fingerprint(line) {
  const blob = base64Bytes(line.trim().split(/\s+/)[1]);
  const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", blob));
  return `SHA256:${btoa(String.fromCharCode(...digest)).replace(/=+$/, "")}`;
}

/** The host as ssh wants it, and the known_hosts name (`[host]:port` off port 22). */
const sshHost = (info) => (info.host.includes(":") ? `[${info.host}]` : info.host);
const knownName = (info) => (info.port === 22 ? info.host : `[${info.host}]:${info.port}`);
const portArg = (info) => (info.port === 22 ? "" : `-p ${info.port} `);

/** `sandbox` (an id, from a sandbox's page) is picked in the login section. */
export function renderSsh(main, sandbox = "") {
  const hostBox = h("section", h("p.muted", "Loading…"));
  const loginBox = h("section");
  const keysBox = h("section");
  clear(main, h("h1", "SSH"), hostBox, loginBox, keysBox);
  load();

  async function load() {
    let info;
    try {
      info = await get("/v1/ssh");
    } catch (error) {
      clear(hostBox, errorBox(error));
      return;
    }
    const lines = info.host_keys.map((k) => `${knownName(info)} ${k}`);
    // Each key's fingerprint computed here (Web Crypto needs a secure context: https, or loopback); the
    // ed25519 one is also the server's own.
    const prints = await Promise.all(info.host_keys.map((k) => (crypto.subtle ? fingerprint(k) : Promise.resolve(null))));
    clear(hostBox,
      h("h2", "Host keys"),
      h("p.muted", `The SSH server of this gateway listens at ${info.host} port ${info.port}. Check these fingerprints when ssh asks, or add the lines to known_hosts.`),
      table([
        { label: "Type", cell: (k) => h("code", k.split(" ")[0]) },
        { label: "Fingerprint", cell: (k) => h("code.fingerprint", prints[info.host_keys.indexOf(k)] ?? (k.startsWith("ssh-ed25519") ? info.fingerprint : "shown over https only")) },
      ], info.host_keys),
      h("div.field", h("label", { for: "known-hosts" }, "known_hosts lines"),
        h("textarea#known-hosts", { readonly: true, rows: lines.length, spellcheck: "false" }, lines.join("\n"))),
      copyButton(lines.join("\n") + "\n", "Copy known_hosts lines"));
    await drawLogin(info);
    await drawKeys();
  }

  async function drawLogin(info) {
    const sandboxes = await get("/v1/sandboxes").then((a) => a.sandboxes.filter((s) => s.state !== "terminated")).catch(() => []);
    const picker = h("select#ssh-sandbox", sandboxes.length
      ? sandboxes.map((s) => h("option", { value: s.id, selected: s.id === sandbox }, s.name ? `${s.name} (${s.id})` : s.id))
      : h("option", { value: "" }, "no sandbox: create one first"));
    const command = h("input#ssh-command.secret", { readonly: true, "aria-label": "ssh command with a registered key" });
    const show = () => {
      const s = sandboxes.find((x) => x.id === picker.value);
      command.value = s ? `ssh ${portArg(info)}${s.name || s.id}@${sshHost(info)}` : "";
    };
    picker.addEventListener("change", show);
    show();
    const ttl = h("input#ssh-ttl", { type: "number", min: 1, max: 86400, value: 900 });
    clear(loginBox,
      h("h2", "Log in to a sandbox"),
      h("div.field.inline", h("label", { for: "ssh-sandbox" }, "Sandbox"), picker),
      h("p", "With an SSH key registered below (scp and sftp take the same user@host):"),
      h("div.toolbar", command, action("Copy", async () => {
        // read when clicked: the sandbox picked may have changed
        if (!navigator.clipboard) throw new Error("this browser offers no clipboard here: select the command and copy it");
        await navigator.clipboard.writeText(command.value);
        toast("copied");
      }, { id: "copy-ssh-command" })),
      h("p", "Or without a registered key: a token login for this sandbox only, good for logins until it expires. It is shown once."),
      h("div.toolbar",
        h("label", { for: "ssh-ttl" }, "Valid for, seconds (1 to 86400)"), ttl,
        action("Make a token login", () => token(picker.value, Number(ttl.value || 0)), { id: "make-token", disabled: !sandboxes.length })));
  }

  async function token(sandbox, ttlSecs) {
    if (!sandbox) return;
    const access = await post(`/v1/sandboxes/${enc(sandbox)}/ssh-access`, { ttl_secs: ttlSecs });
    const shown = h("input#ssh-token-command.secret", { value: access.command, readonly: true, "aria-label": "ssh command with the token" });
    await dialog({
      title: "Token login",
      body: [
        h("p", `This command logs in to ${sandbox} until ${fmtTime(access.expires_at)}. The token in it is the whole credential and is shown only now: copy it.`),
        shown,
        copyButton(access.command, "Copy"),
      ],
      ok: "Done",
    });
    shown.value = "";
  }

  async function drawKeys() {
    let keys;
    try {
      keys = (await get("/v1/ssh-keys")).keys;
    } catch (error) {
      clear(keysBox, h("h2", "Your SSH keys"), errorBox(error));
      return;
    }
    clear(keysBox,
      h("div.bar", h("h2", "Your SSH keys"), action("Register a key", register)),
      table([
        { label: "Key", cell: (k) => [h("code", k.fingerprint), h("div.key-line", k.key)] },
        { label: "Sandbox", cell: (k) => (k.sandbox ? h("code", k.sandbox) : "every sandbox of this tenant") },
        { label: "Registered", cell: (k) => fmtTime(k.created) },
        { label: "Actions", cell: (k) => action("Delete", async () => {
          if (!(await confirm("Delete SSH key", `Delete ${k.fingerprint}? SSH connections that logged in with it are closed.`, "Delete"))) return;
          await del(`/v1/ssh-keys/${enc(k.id)}`);
          toast(`deleted ${k.fingerprint}`);
          drawKeys();
        }, { danger: true, "aria-label": `Delete key ${k.id}` }) },
      ], keys, "No SSH keys registered: register your public key to log in with plain ssh, scp and sftp."));
  }

  async function register() {
    const sandboxes = await get("/v1/sandboxes").then((a) => a.sandboxes.filter((s) => s.state !== "terminated")).catch(() => []);
    const made = await dialog({
      title: "Register an SSH key",
      fields: [
        { name: "key", label: "Public key (one line, e.g. the contents of ~/.ssh/id_ed25519.pub)", type: "textarea", required: true },
        { name: "sandbox", label: "Reaches", type: "select", value: "",
          options: [["", "every sandbox of this tenant"], ...sandboxes.map((s) => [s.id, `only ${s.name || s.id}`])] },
      ],
      ok: "Register",
      submit: (v) => post("/v1/ssh-keys", v.sandbox ? { key: v.key.trim(), sandbox: v.sandbox } : { key: v.key.trim() }),
    });
    if (made) {
      toast(`registered ${made.fingerprint}`);
      drawKeys();
    }
  }
}
