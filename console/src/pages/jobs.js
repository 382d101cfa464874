// Jobs and agent runs: the list (state, attempts, timing), submit a job or an agent run, and one job's page: its
// attempts, the running attempt's output followed live (the command's process in the run's sandbox), each
// finished attempt's kept output and files (downloads), cancel.

import { base64Bytes, call, del, enc, get, ndjson, post, query, session } from "../api.js";
import {
  action, clear, commandText, confirm, dialog, errorBox, every, fmtBytes, fmtDuration, fmtTime, h, parseCommand, parseEnv,
  parseNames, table, toast,
} from "../ui.js";
import { caps, networkFields, networkRequest } from "./sandboxes.js";

const LIST_MS = 4000;
const JOB_MS = 2000;
const FINISHED = ["succeeded", "failed", "cancelled"];
const stateTag = (state) => h(`span.state.${state}`, state);

/** Jobs by id with their runs (`GET /v1/jobs` leaves runs out), fetched again only when a job changed. */
const detailed = new Map();
async function withRuns(job) {
  const known = detailed.get(job.id);
  if (known && known.updated_at === job.updated_at) return known;
  const full = await get(`/v1/jobs/${enc(job.id)}`);
  detailed.set(job.id, full);
  return full;
}

function attempts(job) {
  const allowed = (job.spec.retries ?? 0) + 1;
  return `${(job.runs ?? []).length} of ${allowed}`;
}

function timing(job) {
  const runs = job.runs ?? [];
  const started = runs.find((r) => r.started_at)?.started_at;
  const finished = FINISHED.includes(job.state) ? runs.at(-1)?.finished_at ?? job.updated_at : null;
  if (!started) return `queued ${fmtDuration(job.created_at)}`;
  return finished ? `ran ${fmtDuration(started, finished)}, ended ${fmtTime(finished)}` : `running ${fmtDuration(started)}`;
}

export function renderJobs(main) {
  const list = h("div.list");
  const status = h("p.muted", { "aria-live": "polite" });
  const admin = session.me.scopes.includes("admin");
  let shown = "";
  const refresh = async () => {
    try {
      const jobs = await Promise.all((await get("/v1/jobs")).jobs.slice(0, 100).map(withRuns));
      const text = JSON.stringify(jobs.map((j) => [j.id, j.updated_at, timing(j)]));
      if (text !== shown) {
        shown = text;
        clear(list, table([
          { label: "Job", cell: (j) => [h("a", { href: `#/jobs/${enc(j.id)}` }, j.name || j.id), j.name ? h("div.muted", h("code", j.id)) : null] },
          { label: "Kind", cell: (j) => (j.agent ? `agent ${j.agent}` : "job") },
          admin ? { label: "Owner", cell: (j) => `${j.owner} (${j.tenant || "default"})` } : null,
          { label: "State", cell: (j) => [stateTag(j.state), j.error ? h("div.error", j.error) : null] },
          { label: "Attempts", cell: (j) => attempts(j) },
          { label: "Timing", cell: (j) => timing(j) },
          { label: "Created", cell: (j) => fmtTime(j.created_at) },
        ].filter(Boolean), jobs, "No jobs yet: run one."));
      }
      status.textContent = `${jobs.length} jobs · updated ${new Date().toLocaleTimeString()}`;
    } catch (error) {
      shown = "";
      clear(list, errorBox(error));
    }
  };
  const open = (job) => job && (location.hash = `#/jobs/${enc(job.id)}`);
  clear(main,
    h("div.bar", h("h1", "Jobs and agent runs"),
      h("div.row-actions",
        action("Run a job", () => jobForm().then(open)),
        action("Run an agent", () => agentForm().then(open)))),
    h("p.muted", "A job runs a command to completion in a sandbox of its own (again after a failure, up to its retries) and keeps its output and the files it names."),
    status, list);
  return every(LIST_MS, refresh);
}

async function secretsHint() {
  const names = await get("/v1/secrets").then((a) => a.secrets.map((s) => s.name)).catch(() => null);
  return names === null ? "This gateway keeps no secrets." : `This tenant's: ${names.join(", ") || "none yet"}.`;
}

/** The caller's snapshots, for "each attempt starts from" (none when they cannot be listed). */
const snapshotsOf = () => get("/v1/snapshots").then((a) => a.snapshots).catch(() => []);

/**
 * The fields a job and an agent run share (resources, env, secrets, retries, timeout, kept files, network,
 * snapshot, notification). For an agent run, a field left empty keeps the agent's own default.
 */
function commonFields(c, hint, snapshots, { agent = false } = {}) {
  const l = c.limits;
  const network = networkFields(c);
  if (agent) {
    // An agent usually has its own network (an allowlist of its API's names): kept unless another is chosen.
    network[0] = { ...network[0], value: "", options: [["", "the agent's own"], ...network[0].options] };
  }
  return [
    { name: "name", label: "Name (optional: a-z 0-9 - _ ., at most 63)" },
    { name: "image", label: `Image (empty: ${agent ? "the agent's" : "the node's default"})` },
    { name: "cpus", label: `CPUs (at most ${l.max_cpus})`, type: "number" },
    { name: "memory_mb", label: `Memory MiB (at most ${l.max_memory_mb})`, type: "number" },
    { name: "disk_mb", label: `Disk MiB (at most ${l.max_disk_mb})`, type: "number" },
    { name: "env", label: "Environment (NAME=value per line)", type: "textarea" },
    { name: "secrets", label: agent ? "More secrets by name (added to the agent's)" : "Secrets by name (comma separated)", hint },
    { name: "retries", label: "Retries after a failed attempt (0 to 10)", type: "number", value: 0 },
    { name: "timeout_secs", label: `Timeout per attempt, seconds (1 to 604800; empty: ${agent ? "the agent's" : "none"})`, type: "number" },
    { name: "keep", label: "Files to keep (absolute paths, one per line, at most 16)", type: "textarea", placeholder: "/sandbox/home/report.txt" },
    ...network,
    { name: "from_snapshot", label: "Each attempt starts from snapshot", type: "select", value: "",
      options: [["", "none: a fresh sandbox"], ...snapshots.map((s) => [s.id, `${s.id} (${s.kind}, of ${s.sandbox})`])] },
    { name: "notify", label: "Notify URL (optional: https; told when each attempt and the job end)", placeholder: "https://hooks.example.com/sbx" },
  ];
}

function commonRequest(v) {
  const request = {};
  if (v.name.trim()) request.name = v.name.trim();
  if (v.image.trim()) request.image = v.image.trim();
  const resources = {};
  for (const k of ["cpus", "memory_mb", "disk_mb"]) if (v[k] !== "") resources[k] = Number(v[k]);
  if (Object.keys(resources).length) request.resources = resources;
  const env = parseEnv(v.env);
  if (Object.keys(env).length) request.env = env;
  const secrets = parseNames(v.secrets);
  if (secrets.length) request.secrets = secrets;
  if (v.retries !== "") request.retries = Number(v.retries);
  if (v.timeout_secs !== "") request.timeout_secs = Number(v.timeout_secs);
  const keep = v.keep.split("\n").map((s) => s.trim()).filter(Boolean);
  if (keep.length) request.keep = { files: keep };
  if (v.mode) request.network = networkRequest(v);
  if (v.from_snapshot) request.from_snapshot = v.from_snapshot;
  if (v.notify.trim()) request.notify = v.notify.trim();
  return request;
}

async function jobForm() {
  const [c, hint, snapshots] = await Promise.all([caps(), secretsHint(), snapshotsOf()]);
  return dialog({
    title: "Run a job",
    fields: [
      { name: "command", label: "Command (run by sh -c; or a JSON array of arguments)", type: "textarea", required: true },
      ...commonFields(c, hint, snapshots),
    ],
    ok: "Run",
    submit: async (v) => {
      const command = parseCommand(v.command);
      if (!command) throw new Error("give a command to run");
      const job = await post("/v1/jobs", { command, ...commonRequest(v) });
      toast(`job ${job.id} ${job.state}`);
      return job;
    },
  });
}

async function agentForm() {
  const [c, hint, snapshots, agents] = await Promise.all([caps(), secretsHint(), snapshotsOf(),
    get("/v1/agents").then((a) => a.agents)]);
  if (!agents.length) throw new Error("this gateway defines no agent: start it with --agents-file (docs/jobs.md)");
  const describe = (a) => `${a.name}${a.image ? ` (${a.image})` : ""}`;
  return dialog({
    title: "Run an agent",
    body: h("p.muted", "The prompt is written to a file in the run's sandbox, never on a command line. The agent's own secrets and defaults apply; the fields below add to or override them."),
    fields: [
      { name: "agent", label: "Agent", type: "select", value: agents[0].name, options: agents.map((a) => [a.name, describe(a)]),
        hint: agents.map((a) => `${a.name}: secrets ${a.secrets.join(", ") || "none"}${a.timeout_secs ? `, timeout ${a.timeout_secs} s` : ""}`).join(" · ") },
      { name: "prompt", label: "Prompt", type: "textarea", required: true },
      ...commonFields(c, hint, snapshots, { agent: true }),
    ],
    ok: "Run agent",
    submit: async (v) => {
      if (!v.prompt.trim()) throw new Error("give the agent a prompt");
      const job = await post("/v1/agent-runs", { agent: v.agent, prompt: v.prompt, ...commonRequest(v) });
      toast(`agent run ${job.id} ${job.state}`);
      return job;
    },
  });
}

// -- one job ------------------------------------------------------------------------------------------------

export function renderJob(main, id) {
  const head = h("div");
  const runs = h("div");
  const heading = h("h2#output-heading", "Output");
  const output = h("pre.output#job-output", { tabindex: "0", "aria-labelledby": "output-heading" });
  const outputNote = h("p.muted#output-note", { "aria-live": "polite" });
  const details = h("div");
  let shown = "";
  let following = null; // {key: "n:pid", abort}
  const ended = new Set(); // the attempts whose live output ended (not followed again while being recorded)
  let shownOutput = ""; // the run whose kept output is shown
  let stopped = false;

  const refresh = async () => {
    let job;
    try {
      job = await get(`/v1/jobs/${enc(id)}`);
    } catch (error) {
      clear(head, h("h1", id), errorBox(error));
      return;
    }
    const text = JSON.stringify(job);
    if (text !== shown) {
      shown = text;
      draw(job);
    }
    await showOutput(job);
  };

  function draw(job) {
    const live = !FINISHED.includes(job.state);
    clear(head,
      h("div.bar", h("h1", job.name || job.id), h("span#job-state", stateTag(job.state))),
      h("p.muted", h("code", job.id), job.agent ? ` · agent ${job.agent}` : "", ` · attempts ${attempts(job)} · ${timing(job)}`),
      job.error ? h("p.error#job-error", { role: "alert" }, job.error) : null,
      h("div.row-actions", live ? action("Cancel", () => cancel(job), { danger: true }) : null));
    clear(runs, h("h2", "Attempts"), table([
      { label: "Attempt", cell: (r) => String(r.n) },
      { label: "State", cell: (r) => [stateTag(r.state), r.error ? h("div.error", r.error) : null] },
      { label: "Exit code", cell: (r) => (r.exit_code === null ? "" : String(r.exit_code)) },
      { label: "Sandbox", cell: (r) => (r.sandbox ? [h("code", r.sandbox), h("div.muted", r.node ?? "")] : "not made yet") },
      { label: "Started", cell: (r) => fmtTime(r.started_at) },
      { label: "Took", cell: (r) => fmtDuration(r.started_at, r.finished_at) },
      { label: "Kept files", cell: (r) => (r.files ?? []).map((f) => h("div.kept",
        f.error !== undefined
          ? [h("code", f.path), h("span.error", ` ${f.error}`)]
          : [action(`Download ${f.path}`, () => download(job, r, f.path), { "aria-label": `Download ${f.path} of attempt ${r.n}` }), ` ${fmtBytes(f.bytes)}`])) },
      { label: "Output", cell: (r) => (r.finished_at ? action("Show", () => keptOutput(job, r, true), { "aria-label": `Show output of attempt ${r.n}` }) : "") },
    ], job.runs, "No attempt yet: queued."));
    const s = job.spec;
    const rows = [
      ["Command", h("code", commandText(s.command))],
      ["Image", s.image ?? "the node's default"],
      ["Resources", Object.entries(s.resources ?? {}).map(([k, v]) => `${k} ${v}`).join(", ") || "the node's defaults"],
      ["Environment names", job.env_names.join(", ") || "none"],
      ["Secrets", (s.secrets ?? []).join(", ") || "none"],
      ["Retries", String(s.retries ?? 0)],
      ["Timeout per attempt", s.timeout_secs ? `${s.timeout_secs} s` : "none"],
      ["Kept files", (s.keep?.files ?? []).join(", ") || "none"],
      ["Owner", `${job.owner} (${job.tenant || "default"})`],
      ["Created", fmtTime(job.created_at)],
      ["Updated", fmtTime(job.updated_at)],
    ];
    clear(details, h("h2", "Spec"), h("dl.details", rows.map(([k, v]) => [h("dt", k), h("dd", v)])));
  }

  /** The running attempt's output, followed live; once it ended, the output the gateway kept. */
  async function showOutput(job) {
    const run = job.runs?.at(-1);
    if (!run) {
      outputNote.textContent = "Waiting for the first attempt to start…";
      return;
    }
    if (run.state === "running" && run.sandbox && run.pid !== undefined) {
      const key = `${run.n}:${run.pid}`;
      if (following?.key !== key && !ended.has(key)) follow(run, key);
      return;
    }
    if (run.finished_at && !following && shownOutput !== String(run.n)) await keptOutput(job, run, false);
  }

  function follow(run, key) {
    following?.abort.abort();
    const abort = new AbortController();
    following = { key, abort };
    shownOutput = "";
    heading.textContent = `Output of attempt ${run.n} (live)`;
    outputNote.textContent = `Following the command (process ${run.pid} in ${run.sandbox}) as it prints.`;
    output.textContent = "";
    const decoder = new TextDecoder();
    (async () => {
      try {
        for await (const line of ndjson(`/v1/sandboxes/${enc(run.sandbox)}/processes/${run.pid}/output`, abort.signal)) {
          if (line.data !== undefined) output.append(decoder.decode(base64Bytes(line.data), { stream: true }));
          else if (line.exit_code !== undefined) output.append(`\n[exited with code ${line.exit_code}]\n`);
          output.scrollTop = output.scrollHeight;
        }
        outputNote.textContent = "The command ended; the kept output follows once the attempt is recorded.";
      } catch (error) {
        if (error.name === "AbortError") return;
        // The sandbox ends with the attempt: the kept output takes over.
        outputNote.textContent = `The live output ended (${error}); the kept output follows once the attempt is recorded.`;
      }
      ended.add(key);
      if (following?.key === key) following = null;
      if (!stopped) refresh();
    })();
  }

  async function keptOutput(job, run, asked) {
    try {
      const kept = await get(`/v1/jobs/${enc(job.id)}/runs/${run.n}/output`);
      const text = (b64) => new TextDecoder().decode(base64Bytes(b64));
      following?.abort.abort();
      following = null;
      shownOutput = String(run.n);
      heading.textContent = `Output of attempt ${run.n}`;
      outputNote.textContent = kept.truncated ? "Kept by the gateway; truncated: each stream keeps its first 8 MiB." : "Kept by the gateway.";
      const stderr = text(kept.stderr);
      output.textContent = text(kept.stdout) + (stderr ? `\n[stderr]\n${stderr}` : "");
    } catch (error) {
      if (asked) toast(String(error), "error");
      else outputNote.textContent = String(error);
    }
  }

  async function download(job, run, path) {
    const resp = await call("GET", `/v1/jobs/${enc(job.id)}/runs/${run.n}/files${query({ path })}`, { raw: true });
    const url = URL.createObjectURL(await resp.blob());
    const link = h("a", { href: url, download: path.split("/").pop() || "file" });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
  }

  async function cancel(job) {
    if (!(await confirm("Cancel job", `Cancel ${job.name || job.id}? Its running sandbox is ended and no further attempt starts.`, "Cancel job"))) return;
    const done = await del(`/v1/jobs/${enc(job.id)}`);
    toast(`${job.name || job.id} ${done.state}`);
    refresh();
  }

  clear(main, h("p", h("a", { href: "#/jobs" }, "← Jobs")), head, runs, heading, outputNote, output, details);
  const stop = every(JOB_MS, refresh);
  return () => {
    stopped = true;
    stop();
    following?.abort.abort();
  };
}
