"""Media types of OCI and Docker registries' manifests, configs and layers, as the puller knows them."""

from __future__ import annotations

MEDIA_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MEDIA_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MEDIA_DOCKER_SCHEMA1 = ("application/vnd.docker.distribution.manifest.v1+json",
                        "application/vnd.docker.distribution.manifest.v1+prettyjws")  # fmt: skip
INDEX_TYPES = frozenset({MEDIA_OCI_INDEX, MEDIA_DOCKER_LIST})
MANIFEST_TYPES = frozenset({MEDIA_OCI_MANIFEST, MEDIA_DOCKER_MANIFEST})
#: Layer media types the unpacker handles (compression is detected from the content anyway).
LAYER_TYPES = frozenset({
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
})  # fmt: skip
CONFIG_TYPES = frozenset(
    {"application/vnd.docker.container.image.v1+json", "application/vnd.oci.image.config.v1+json"}
)
