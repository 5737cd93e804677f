"""Sidecar processes: drivers wired into long-running processes (``qosmq sidecar …``)."""
