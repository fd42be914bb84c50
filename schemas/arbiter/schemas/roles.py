"""Identity roles and the id namespaces only the system may use (plain constants, for the pure cores)."""

ROLE_AGENT = "agent"
ROLE_WORKER = "worker"
ROLE_RUNNER = "runner"
"""A check runner: it sends verdicts on merges, and nothing else."""
ROLE_ADMIN = "admin"
ROLES = (ROLE_AGENT, ROLE_WORKER, ROLE_ADMIN, ROLE_RUNNER)

RESERVED_PREFIXES = ("saga:",)
"""Ids that only the system derives: no agent may be named so, or use them as request/intent ids."""
