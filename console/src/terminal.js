// A terminal on a process in a sandbox: xterm.js over the WebSocket form of attach (capability
// websocket_attach). The key and organisation go as offered subprotocols (never in the URL); output is replayed
// from the start; typing sends stdin frames (Ctrl-D is ^D on the terminal), resizing the view sends a resize
// frame; the exit frame ends it, and a close from the server (a revoked key: 1008) is shown with its reason.

import { Terminal } from "@xterm/xterm";
import { FitAddon } from "@xterm/addon-fit";
import { session } from "./api.js";
import * as f from "./frames.js";

const encoder = new TextEncoder();

export class AttachedTerminal {
  /** Attach to process `pid` of sandbox `ref` inside `container`; `onStatus(text, kind)` hears what happens. */
  constructor(container, ref, pid, onStatus) {
    this.onStatus = onStatus;
    this.ended = false;
    this.term = new Terminal({
      cursorBlink: true,
      convertEol: false,
      fontFamily: "ui-monospace, SFMono-Regular, Menlo, Consolas, monospace",
      fontSize: 14,
      scrollback: 5000,
    });
    this.fit = new FitAddon();
    this.term.loadAddon(this.fit);
    this.term.open(container);
    this.fit.fit();
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const url = `${scheme}//${location.host}/v1/sandboxes/${encodeURIComponent(ref)}/processes/${pid}/attach/websocket`;
    const offered = [f.PROTOCOL, `bearer.${session.key}`];
    if (session.org) offered.push(`org.${session.org}`);
    this.ws = new WebSocket(url, offered);
    this.ws.binaryType = "arraybuffer";
    this.opened = false;
    this.ws.onopen = () => {
      this.opened = true;
      onStatus(`attached to process ${pid}`, "ok");
      this.resize();
    };
    this.ws.onmessage = (event) => this.received(event.data);
    this.ws.onclose = (event) => this.closed(event);
    this.term.onData((data) => this.send(f.frame(f.STDIN, encoder.encode(data))));
    this.term.onBinary((data) => this.send(f.frame(f.STDIN, Uint8Array.from(data, (c) => c.charCodeAt(0)))));
    this.term.onResize(({ rows, cols }) => this.send(f.resizeFrame(rows, cols)));
    this.observer = new ResizeObserver(() => this.fit.fit());
    this.observer.observe(container);
    this.term.focus();
  }

  send(bytes) {
    if (this.ws.readyState === WebSocket.OPEN) this.ws.send(bytes);
  }

  resize() {
    this.send(f.resizeFrame(this.term.rows, this.term.cols));
  }

  signal(name) {
    this.send(f.signalFrame(name));
  }

  endInput() {
    this.send(f.frame(f.END_OF_INPUT));
  }

  received(buffer) {
    for (const frame of f.decodeMessage(buffer)) {
      if (frame.type === f.STDOUT || frame.type === f.STDERR) {
        this.term.write(frame.payload.slice());
      } else if (frame.type === f.EXIT) {
        this.ended = true;
        const code = f.exitCode(frame.payload);
        this.term.write(`\r\n[process exited with code ${code}]\r\n`);
        this.onStatus(`process exited with code ${code}`, "done");
      }
    }
  }

  closed(event) {
    if (this.ended) return;
    this.ended = true;
    if (!this.opened) {
      // A refusal before the switch (a browser cannot read its body): the caller asks the API why.
      this.onStatus("the server refused the attach", "refused");
      return;
    }
    const reason = event.reason || (event.code === 1006 ? "the connection was lost" : `closed (${event.code})`);
    const text = event.code === 1000 ? "detached" : `terminal cut: ${reason}`;
    this.term.write(`\r\n[${text}]\r\n`);
    this.onStatus(text, event.code === 1000 ? "done" : "error");
  }

  dispose() {
    this.ended = true;
    this.observer.disconnect();
    if (this.ws.readyState <= WebSocket.OPEN) this.ws.close(1000);
    this.term.dispose();
  }
}
