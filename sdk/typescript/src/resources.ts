/**
 * `client.images`, `client.snapshots`, `client.volumes`: the server's images and the state that outlives a sandbox
 * (docs/images.md, docs/snapshots.md, docs/volumes.md). Snapshots are taken with `sandbox.snapshot()` and forked
 * with `client.sandboxes.create({ snapshot_id })` or `sandbox.fork()`.
 */
import type { Client } from "./client.js";
import type { Image, ImageRemoved, Snapshot, Volume } from "./types.js";

/** The node's image store (capability `images`; a gateway answers 501 `Unsupported`). */
export class Images {
  constructor(private readonly client: Client) {}

  /** `GET /v1/images`: the images, by name. */
  async list(): Promise<Image[]> {
    return (await this.client.call<{ images: Image[] }>("GET", "/v1/images")).images;
  }

  /** `POST /v1/images`: start installing `image` (202); poll `list()` or `get()` for `state` and `progress`. */
  pull(image: string): Promise<Image> {
    return this.client.call("POST", "/v1/images", { json: { image } });
  }

  /** The listed image named `image`, or `undefined`. */
  async get(image: string): Promise<Image | undefined> {
    return (await this.list()).find((i) => i.image === image);
  }

  /** `DELETE /v1/images?image=`: `{image, freed_bytes}`; `NotFound` when not installed, `Conflict` while in use. */
  remove(image: string): Promise<ImageRemoved> {
    return this.client.call("DELETE", "/v1/images", { query: { image } });
  }
}

/** List and delete snapshots (capabilities `memory_snapshot`, `disk_snapshot`). */
export class Snapshots {
  constructor(private readonly client: Client) {}

  /** `GET /v1/snapshots`: newest first. */
  async list(): Promise<Snapshot[]> {
    return (await this.client.call<{ snapshots: Snapshot[] }>("GET", "/v1/snapshots")).snapshots;
  }

  /** `DELETE /v1/snapshots/{id}`: remove it and its files; `NotFound` when unknown. */
  async delete(id: string): Promise<void> {
    await this.client.call("DELETE", `/v1/snapshots/${encodeURIComponent(id)}`);
  }
}

/** Create, list and delete volumes; mount them with `sandboxes.create({ volumes: [{ name, path }] })`. */
export class Volumes {
  constructor(private readonly client: Client) {}

  /** `POST /v1/volumes`: an empty volume of `sizeMb` MiB (default: the server's default disk size). */
  create(name: string, sizeMb?: number): Promise<Volume> {
    return this.client.call("POST", "/v1/volumes", { json: sizeMb === undefined ? { name } : { name, size_mb: sizeMb } });
  }

  /** `GET /v1/volumes`. */
  async list(): Promise<Volume[]> {
    return (await this.client.call<{ volumes: Volume[] }>("GET", "/v1/volumes")).volumes;
  }

  /** `DELETE /v1/volumes/{name}`: delete it with its contents; `Conflict` while mounted. */
  async delete(name: string): Promise<void> {
    await this.client.call("DELETE", `/v1/volumes/${encodeURIComponent(name)}`);
  }
}
