"""Jobs and agent runs: commands run to completion in sandboxes of their own, their kept output and files, and
notifications (docs/jobs.md)."""
