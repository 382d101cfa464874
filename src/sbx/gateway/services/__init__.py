"""Services: a sandbox spec with a replica count kept true, health checks, rollouts, and the traffic front
(docs/services.md)."""
