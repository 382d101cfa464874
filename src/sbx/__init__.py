"""sbx: a self-hostable sandbox service (node server, gateway, CLI and SDK)."""

__version__ = "0.1.0"
