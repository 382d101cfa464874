"""SSH into sandboxes through the gateway (``sandbox-gateway serve --ssh-listen``): docs/ssh.md.

Modules: ``keys`` (the key line rules, fingerprints, tokens), ``hostkeys`` (the gateway's own keys), ``auth`` (who
may log in where), ``server`` (the asyncssh server, its connections, revocation), ``sessions`` (shells and
commands), ``sftp`` with ``handles`` and ``guestfs`` (files), ``forwarding`` (``ssh -L``). Everything reaches the
sandbox through its node's public API (``NodeClient``), never around it.
"""
