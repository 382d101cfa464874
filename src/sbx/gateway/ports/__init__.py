"""Exposed ports (issue 33, docs/ports.md): a sandbox's TCP ports on host names of their own under the gateway's
``--ports-domain``: ``labels`` (the host name of a port), ``credentials`` (port tokens and the cookie),
``store`` (public flags and tokens in the gateway's state), ``front`` (the traffic), ``ports`` routes in
``sbx.gateway.routes.ports``."""
