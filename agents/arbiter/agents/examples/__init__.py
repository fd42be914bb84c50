"""Example agents: ``drafter`` on the Python SDK (``python -m arbiter.agents.examples.drafter``), and
``drafter.mjs``, the same agent in JavaScript through a front door (Node's built-in fetch, no package)."""
