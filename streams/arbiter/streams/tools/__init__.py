"""Tools: the side effects agents want, run by a worker only after the gateway accepted them.

``registry`` defines what a tool is (an async callable with an argument schema and
an optional compensation); ``ledger`` is the real resource of the demo and the tests,
accounts and documents in a SQL database (SQLite by default, PostgreSQL by DSN); ``git`` puts
git repositories behind the gateway (a sandbox per agent, merges in the repository's order).
"""
