/**
 * What only a sandbox-gateway serves (docs/gateway.md, docs/services.md, docs/jobs.md, docs/ssh.md): services,
 * jobs and agent runs, secrets, SSH keys and access, API keys. A node answers these with `NotFound`.
 */
import { fromBase64 } from "./bytes.js";
import type { Client } from "./client.js";
import { Unavailable } from "./errors.js";
import type { Agent, AgentRunRequest, Job, JobSpec, Key, KeyCreated, RunOutput, Secret, Service, ServiceSpec, SshAccess, SshInfo, SshKey } from "./types.js";

function tenantQuery(tenant?: string): Record<string, string> | undefined {
  return tenant === undefined ? undefined : { tenant };
}

/** Services: replicas kept healthy behind one address, rolled out on change. */
export class Services {
  constructor(private readonly client: Client) {}

  /** `POST /v1/services`: create one from its spec (201). */
  create(spec: ServiceSpec): Promise<Service> {
    return this.client.call("POST", "/v1/services", { json: spec });
  }

  /** `GET /v1/services`: the caller's services (all of them for an admin key). */
  async list(): Promise<Service[]> {
    return (await this.client.call<{ services: Service[] }>("GET", "/v1/services")).services;
  }

  /** `GET /v1/services/{name}` (`tenant`: an admin's choice of tenant). */
  get(name: string, tenant?: string): Promise<Service> {
    return this.client.call("GET", `/v1/services/${encodeURIComponent(name)}`, { query: tenantQuery(tenant) });
  }

  /** `PUT /v1/services/{name}`: replace the spec; a changed image, command, resources, port, health, env or network starts a rollout. */
  update(spec: ServiceSpec, tenant?: string): Promise<Service> {
    return this.client.call("PUT", `/v1/services/${encodeURIComponent(spec.name)}`, { json: spec, query: tenantQuery(tenant) });
  }

  /** `POST /v1/services/{name}/scale`: 0 to 100 replicas. */
  scale(name: string, replicas: number, tenant?: string): Promise<Service> {
    return this.client.call("POST", `/v1/services/${encodeURIComponent(name)}/scale`, { json: { replicas }, query: tenantQuery(tenant) });
  }

  /** `DELETE /v1/services/{name}`: its replicas are terminated. */
  async delete(name: string, tenant?: string): Promise<void> {
    await this.client.call("DELETE", `/v1/services/${encodeURIComponent(name)}`, { query: tenantQuery(tenant) });
  }
}

/** Jobs (a command run to completion in fresh sandboxes, with retries) and agent runs. */
export class Jobs {
  constructor(private readonly client: Client) {}

  /** `POST /v1/jobs` (201). */
  create(spec: JobSpec): Promise<Job> {
    return this.client.call("POST", "/v1/jobs", { json: spec });
  }

  /** `POST /v1/agent-runs`: one run of a configured agent on `prompt` (201). */
  agentRun(request: AgentRunRequest): Promise<Job> {
    return this.client.call("POST", "/v1/agent-runs", { json: request });
  }

  /** `GET /v1/agents`: the agents `agentRun` may name (the gateway's agents file; names of env and secrets only). */
  async agents(): Promise<Agent[]> {
    return (await this.client.call<{ agents: Agent[] }>("GET", "/v1/agents")).agents;
  }

  /** `GET /v1/jobs`. */
  async list(): Promise<Job[]> {
    return (await this.client.call<{ jobs: Job[] }>("GET", "/v1/jobs")).jobs;
  }

  /** `GET /v1/jobs/{id}`, with its runs. */
  get(id: string): Promise<Job> {
    return this.client.call("GET", `/v1/jobs/${encodeURIComponent(id)}`);
  }

  /** `DELETE /v1/jobs/{id}`: cancel it (running sandboxes terminated, queued runs never start). */
  cancel(id: string): Promise<Job> {
    return this.client.call("DELETE", `/v1/jobs/${encodeURIComponent(id)}`);
  }

  /** The output of run `n` (from 1) once it ended, as bytes. */
  async output(id: string, n: number): Promise<RunOutput> {
    const wire = await this.client.call<{ stdout: string; stderr: string; truncated: boolean }>(
      "GET",
      `/v1/jobs/${encodeURIComponent(id)}/runs/${n}/output`,
    );
    return { stdout: fromBase64(wire.stdout), stderr: fromBase64(wire.stderr), truncated: wire.truncated };
  }

  /** A file run `n` kept (`keep.files`). */
  file(id: string, n: number, path: string): Promise<Uint8Array> {
    return this.client.raw("GET", `/v1/jobs/${encodeURIComponent(id)}/runs/${n}/files`, { query: { path } });
  }

  /**
   * Poll until the job ended (`succeeded`, `failed` or `cancelled`) and return it; every `pollMs` (default 1000);
   * `Unavailable` after `timeoutMs` (default: no limit).
   */
  async wait(id: string, options: { timeoutMs?: number; pollMs?: number } = {}): Promise<Job> {
    const deadline = options.timeoutMs === undefined ? Infinity : Date.now() + options.timeoutMs;
    for (;;) {
      const job = await this.get(id);
      if (job.state === "succeeded" || job.state === "failed" || job.state === "cancelled") return job;
      if (Date.now() >= deadline) throw new Unavailable(`job ${id} is still ${job.state} after ${options.timeoutMs} ms`);
      await new Promise((resolve) => setTimeout(resolve, options.pollMs ?? 1000));
    }
  }
}

/** The caller's secrets: values go in, only names and times come out. */
export class Secrets {
  constructor(private readonly client: Client) {}

  /** `PUT /v1/secrets/{name}`: set it (at most 64 KiB, no NUL). */
  async set(name: string, value: string): Promise<void> {
    await this.client.call("PUT", `/v1/secrets/${encodeURIComponent(name)}`, { json: { value } });
  }

  /** `GET /v1/secrets`: names and when each was set, never values. */
  async list(): Promise<Secret[]> {
    return (await this.client.call<{ secrets: Secret[] }>("GET", "/v1/secrets")).secrets;
  }

  /** `DELETE /v1/secrets/{name}`. */
  async delete(name: string): Promise<void> {
    await this.client.call("DELETE", `/v1/secrets/${encodeURIComponent(name)}`);
  }
}

/** SSH into sandboxes through the gateway (a gateway serving no SSH answers `NotServed`). */
export class Ssh {
  constructor(private readonly client: Client) {}

  /** `GET /v1/ssh`: the SSH server's host, port and host keys. */
  info(): Promise<SshInfo> {
    return this.client.call("GET", "/v1/ssh");
  }

  /** `POST /v1/sandboxes/{ref}/ssh-access`: a short-lived login (`ttlSecs`, default the server's) and its command. */
  access(ref: string, ttlSecs?: number): Promise<SshAccess> {
    return this.client.call("POST", `/v1/sandboxes/${encodeURIComponent(ref)}/ssh-access`, {
      json: ttlSecs === undefined ? {} : { ttl_secs: ttlSecs },
    });
  }

  /** `GET /v1/ssh-keys`: the caller's public keys. */
  async keys(): Promise<SshKey[]> {
    return (await this.client.call<{ keys: SshKey[] }>("GET", "/v1/ssh-keys")).keys;
  }

  /** `POST /v1/ssh-keys`: add a public key (`ssh-ed25519 AAAA...`), for every sandbox or one (`sandbox`). */
  addKey(key: string, sandbox?: string): Promise<SshKey> {
    return this.client.call("POST", "/v1/ssh-keys", { json: sandbox === undefined ? { key } : { key, sandbox } });
  }

  /** `DELETE /v1/ssh-keys/{id}`. */
  async removeKey(id: string): Promise<void> {
    await this.client.call("DELETE", `/v1/ssh-keys/${encodeURIComponent(id)}`);
  }
}

/** API keys (tokens) of the gateway: an admin key lists, creates and revokes them. */
export class Keys {
  constructor(private readonly client: Client) {}

  /** `GET /v1/admin/keys`: every key, without secrets. */
  async list(): Promise<Key[]> {
    return (await this.client.call<{ keys: Key[] }>("GET", "/v1/admin/keys")).keys;
  }

  /** `POST /v1/admin/keys`: a new key; its `secret` is shown this once. */
  create(user: string, scopes: string[], tenant?: string): Promise<KeyCreated> {
    return this.client.call("POST", "/v1/admin/keys", { json: tenant === undefined ? { user, scopes } : { user, scopes, tenant } });
  }

  /** `DELETE /v1/admin/keys/{id}`: revoke it (its open streams are cut). */
  async revoke(id: string): Promise<void> {
    await this.client.call("DELETE", `/v1/admin/keys/${encodeURIComponent(id)}`);
  }
}
