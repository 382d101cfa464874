// Small DOM helpers. Text always goes in as text (textContent), never as HTML, so nothing the server or a
// sandbox returns can become markup.

/** h("button.primary", {onclick}, "Save") — a tag with optional .classes and #id, attributes, children. */
export function h(spec, attrs = {}, ...children) {
  const [, tag = "div", rest = ""] = spec.match(/^([a-z0-9-]*)(.*)$/i);
  const element = document.createElement(tag || "div");
  for (const part of rest.match(/[.#][^.#]+/g) || []) {
    if (part[0] === ".") element.classList.add(part.slice(1));
    else element.id = part.slice(1);
  }
  if (attrs === null || typeof attrs !== "object" || attrs instanceof Node || Array.isArray(attrs)) {
    children.unshift(attrs);
    attrs = {};
  }
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) element.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(element.dataset, value);
    else if (name in element && typeof value !== "string") element[name] = value;
    else element.setAttribute(name, value === true ? "" : String(value));
  }
  append(element, children);
  return element;
}

function append(element, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function clear(element, ...children) {
  element.replaceChildren();
  append(element, children);
  return element;
}

/** A table: columns [{label, cell(row) -> node or text}], rows; an empty note when there are none. */
export function table(columns, rows, empty = "Nothing here.") {
  if (!rows.length) return h("p.empty", empty);
  return h(
    "div.scroll",
    h(
      "table",
      h("thead", h("tr", columns.map((c) => h("th", { scope: "col" }, c.label)))),
      h("tbody", rows.map((row) => h("tr", columns.map((c) => h("td", { dataset: { label: c.label } }, c.cell(row)))))),
    ),
  );
}

/** An error as the server said it (status, code and message), in a live region. */
export function errorBox(error) {
  return h("p.error", { role: "alert" }, String(error));
}

let toastArea;
export function toast(message, kind = "info") {
  if (!toastArea) {
    toastArea = h("div.toasts", { role: "status", "aria-live": "polite" });
    document.body.append(toastArea);
  }
  const note = h(`div.toast.${kind}`, String(message));
  toastArea.append(note);
  setTimeout(() => note.remove(), kind === "error" ? 12000 : 5000);
}

/**
 * A modal dialog (the <dialog> element: focus is kept inside, Escape cancels). `body` is a node or a list;
 * `fields` builds a form whose values `submit(values)` receives. Resolves with the submit's result, or null when
 * cancelled. An error thrown by `submit` is shown in the dialog, which stays open.
 */
export function dialog({ title, body = [], fields = [], ok = "OK", danger = false, submit = async () => true }) {
  return new Promise((resolve) => {
    const problem = h("div.problem");
    const inputs = fields.map(field);
    const form = h(
      "form",
      { method: "dialog" },
      h("h2", title),
      body,
      inputs.map((i) => i.row),
      problem,
      h(
        "div.actions",
        h("button", { type: "button", value: "cancel", onclick: () => close(null) }, "Cancel"),
        h(`button.${danger ? "danger" : "primary"}`, { type: "submit", value: "ok" }, ok),
      ),
    );
    const box = h("dialog", { "aria-label": title }, form);
    let settled = false;
    const close = (value) => {
      if (settled) return;
      settled = true;
      box.close();
      box.remove();
      resolve(value);
    };
    box.addEventListener("cancel", (event) => {
      event.preventDefault();
      close(null);
    });
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const values = Object.fromEntries(inputs.map((i) => [i.name, i.value()]));
      const button = form.querySelector("button[type=submit]");
      button.disabled = true;
      try {
        close(await submit(values));
      } catch (error) {
        clear(problem, errorBox(error));
      } finally {
        button.disabled = false;
      }
    });
    document.body.append(box);
    box.showModal();
    const first = form.querySelector("input, select, textarea");
    if (first) first.focus();
  });
}

/** Ask before something that cannot be undone: resolves true or false. */
export async function confirm(title, text, ok = "Confirm") {
  return (await dialog({ title, body: h("p", text), ok, danger: true })) === true;
}

/** A labelled form control: {name, label, type (text, number, select, textarea, checkbox), value, options, hint}. */
export function field({ name, label, type = "text", value = "", options = [], hint, required, placeholder }) {
  const id = `f-${name}-${Math.random().toString(36).slice(2, 8)}`;
  let control;
  if (type === "select") {
    control = h("select", { id, name }, options.map((o) => {
      const [v, text] = Array.isArray(o) ? o : [o, o];
      return h("option", { value: v, selected: v === value }, text);
    }));
  } else if (type === "textarea") {
    control = h("textarea", { id, name, rows: 3, placeholder }, value);
  } else if (type === "checkbox") {
    control = h("input", { id, name, type, checked: Boolean(value) });
  } else {
    control = h("input", { id, name, type, value, required, placeholder, autocomplete: "off" });
  }
  const row = h(
    `div.field${type === "checkbox" ? ".check" : ""}`,
    h("label", { for: id }, label),
    control,
    hint ? h("small", hint) : null,
  );
  const read = () => (type === "checkbox" ? control.checked : control.value);
  return { name, row, control, value: read };
}

export function fmtBytes(bytes) {
  if (bytes === undefined || bytes === null) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(unit && value < 10 ? 1 : 0)} ${units[unit]}`;
}

export function fmtAge(time) {
  if (!time) return "";
  const secs = Math.max(0, (Date.now() - Date.parse(time)) / 1000);
  if (secs < 60) return `${Math.floor(secs)} s`;
  if (secs < 3600) return `${Math.floor(secs / 60)} min`;
  if (secs < 86400) return `${Math.floor(secs / 3600)} h`;
  return `${Math.floor(secs / 86400)} d`;
}

export function fmtTime(time) {
  return time ? new Date(time).toLocaleString() : "";
}

/** "key=value" lines (or comma separated) to an object; throws on a line without "=". */
export function parseLabels(text) {
  const labels = {};
  for (const item of text.split(/[\n,]/).map((s) => s.trim()).filter(Boolean)) {
    const at = item.indexOf("=");
    if (at <= 0) throw new Error(`label "${item}" is not key=value`);
    labels[item.slice(0, at).trim()] = item.slice(at + 1).trim();
  }
  return labels;
}

export function labelText(labels) {
  return Object.entries(labels || {})
    .map(([k, v]) => `${k}=${v}`)
    .join("\n");
}

/** A button that runs `action` and shows its error as a toast; disabled while it runs. */
export function action(label, run, { danger = false, ...attrs } = {}) {
  const button = h(`button${danger ? ".danger" : ""}`, { type: "button", ...attrs }, label);
  button.addEventListener("click", async () => {
    button.disabled = true;
    try {
      await run();
    } catch (error) {
      toast(String(error), "error");
    } finally {
      button.disabled = false;
    }
  });
  return button;
}

/**
 * A command as typed in a form: a JSON array is the argv as it is (`["python3", "-m", "http.server"]`); any
 * other text is run by `sh -c` (so pipes and quotes work as in a shell). Empty: null.
 */
export function parseCommand(text) {
  const trimmed = text.trim();
  if (!trimmed) return null;
  if (trimmed.startsWith("[")) {
    let argv;
    try {
      argv = JSON.parse(trimmed);
    } catch (error) {
      throw new Error(`the command starts with "[" but is not a JSON array of strings: ${error.message}`);
    }
    if (!Array.isArray(argv) || !argv.length || argv.some((a) => typeof a !== "string")) {
      throw new Error('the command starts with "[" but is not a JSON array of strings, e.g. ["make", "test"]');
    }
    return argv;
  }
  return ["sh", "-c", trimmed];
}

/** The form's text of an argv: the script of `sh -c SCRIPT`, else the JSON array. */
export function commandText(argv) {
  if (!argv) return "";
  if (argv.length === 3 && argv[0] === "sh" && argv[1] === "-c") return argv[2];
  return JSON.stringify(argv);
}

/** "NAME=value" lines to an object (a value may hold "="); throws on a line without "=". */
export function parseEnv(text) {
  const env = {};
  for (const line of text.split("\n").map((s) => s.trim()).filter(Boolean)) {
    const at = line.indexOf("=");
    if (at <= 0) throw new Error(`environment line "${line}" is not NAME=value`);
    env[line.slice(0, at).trim()] = line.slice(at + 1);
  }
  return env;
}

/** Names separated by commas, spaces or new lines. */
export function parseNames(text) {
  return text.split(/[\s,]+/).map((s) => s.trim()).filter(Boolean);
}

/** "3 s", "2 min 5 s", "1 h 4 min" between two times (the second absent: now). */
export function fmtDuration(from, to) {
  if (!from) return "";
  const secs = Math.max(0, Math.round(((to ? Date.parse(to) : Date.now()) - Date.parse(from)) / 1000));
  if (secs < 60) return `${secs} s`;
  if (secs < 3600) return `${Math.floor(secs / 60)} min ${secs % 60} s`;
  return `${Math.floor(secs / 3600)} h ${Math.floor((secs % 3600) / 60)} min`;
}

/**
 * Run `refresh` now and every `ms` while the page shows (not while a dialog is open, so a form being filled is
 * not redrawn under the person); answers the cleanup the router calls when the page is left.
 */
export function every(ms, refresh) {
  let stopped = false;
  let running = false;
  const tick = async () => {
    if (stopped || running || document.querySelector("dialog")) return;
    running = true;
    try {
      await refresh();
    } finally {
      running = false;
    }
  };
  const timer = setInterval(tick, ms);
  tick();
  return () => {
    stopped = true;
    clearInterval(timer);
  };
}

/** Copy text to the clipboard with a toast; where the browser refuses, the person selects it themselves. */
export function copyButton(text, label = "Copy", attrs = {}) {
  return h("button", { type: "button", ...attrs, onclick: () => {
    if (!navigator.clipboard) {
      toast("this browser offers no clipboard here: select the text and copy it", "error");
      return;
    }
    navigator.clipboard.writeText(text).then(() => toast("copied"), () => toast("the browser refused the copy", "error"));
  } }, label);
}
