# The Arbiter image used by docker-compose.yml (the worker; also `arbiter serve`, the front door).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
# arbiter/ holds links to the top-level folders (arbiter.schemas, .streams, .agents): copy all four.
COPY schemas ./schemas
COPY streams ./streams
COPY agents ./agents
COPY arbiter ./arbiter
RUN pip install --no-cache-dir ".[all]"
USER nobody
ENTRYPOINT []
CMD ["arbiter", "worker"]
