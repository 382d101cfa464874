/**
 * Names for the wire types generated from docs/openapi.yaml (`src/generated/openapi.ts`, by openapi-typescript;
 * `npm run generate` remakes it and a test fails when it is stale). Bytes that the wire carries as base64 are
 * `Uint8Array`s in the hand-written layer (`RunResult`, `OutputChunk`, `RunOutput`).
 */
import type { components, paths } from "./generated/openapi.js";

export type { components, paths };
/** Every schema of the API description, by name. */
export type Schemas = components["schemas"];

export type SandboxInfo = Schemas["Sandbox"];
/** `pending`, `running`, `suspended`, `stopped` (persistent sandboxes only), `terminated`. */
export type SandboxState = SandboxInfo["state"];
/**
 * Why a persistent sandbox is `stopped` (`SandboxInfo.stopped_reason`, present only then): `request` (`stop()`),
 * `restore_failed`, `crash`, `suspend_failed` (the node's own reasons); a newer server may name others.
 */
export type StoppedReason = "request" | "restore_failed" | "crash" | "suspend_failed" | (string & {});
export type CreateRequest = Schemas["CreateRequest"];
export type PatchRequest = Schemas["PatchRequest"];
export type ProcessInfo = Schemas["Process"];
export type DirEntry = Schemas["DirEntry"];
export type Capabilities = Schemas["Capabilities"];
export type NodeStatus = Schemas["NodeStatus"];
export type Health = Schemas["Health"];
export type Snapshot = Schemas["Snapshot"];
export type Volume = Schemas["Volume"];
export type Image = Schemas["Image"];
export type ImageRemoved = Schemas["ImageRemoved"];
export type SandboxMetrics = Schemas["SandboxMetrics"];
export type Service = Schemas["Service"];
export type ServiceSpec = Schemas["ServiceSpec"];
export type Job = Schemas["Job"];
export type JobSpec = Schemas["JobSpec"];
export type AgentRunRequest = Schemas["AgentRunRequest"];
export type Agent = Schemas["Agent"];
export type Secret = Schemas["Secret"];
export type SshInfo = Schemas["SshInfo"];
export type Port = Schemas["Port"];
export type PortToken = Schemas["PortToken"];
export type SshAccess = Schemas["SshAccess"];
export type SshKey = Schemas["SshKey"];
export type Key = Schemas["Key"];
export type KeyCreated = Schemas["KeyCreated"];
export type Whoami = Schemas["Whoami"];
/** An audit event (the description types them loosely: the fields depend on the kind). */
export type AuditEvent = Record<string, unknown>;
/** `GET .../events`: oldest first; `truncated` when older ones were dropped. */
export interface EventList {
  events: AuditEvent[];
  truncated: boolean;
}

/** The outcome of a run, with its output as bytes. */
export interface RunResult {
  exitCode: number;
  stdout: Uint8Array;
  stderr: Uint8Array;
  /** An output stream was over 8 MiB and cut. */
  truncated: boolean;
  /** The run outlived its timeout and was killed (`exitCode` -1). */
  timedOut: boolean;
}

/** One piece of a process's followed output. */
export interface OutputChunk {
  stream: "stdout" | "stderr";
  data: Uint8Array;
}

/** A finished job attempt's output as bytes. */
export interface RunOutput {
  stdout: Uint8Array;
  stderr: Uint8Array;
  truncated: boolean;
}
