"""The Avro contract: one ``.avsc`` per command and event, grouped by domain.

This package holds data only; ``SCHEMA_DIR`` lets code find the files wherever the
project is installed. ``history/`` keeps superseded versions of a schema so that
messages written with them still decode (see ``arbiter.contract.codec``).
"""

from pathlib import Path

SCHEMA_DIR = Path(__file__).resolve().parent
