"""`python -m a4 serve`: an OpenAI-compatible HTTP server over the engine, one module per job.

- protocol.py: the request and response bodies in OpenAI's shapes (pydantic), strictly checked;
- engine_loop.py: the thread that owns the Engine and steps it, a bounded queue in, one stream per request out;
- detokenizer.py: incremental detokenization and stop strings;
- metrics.py: the Prometheus metrics;
- app.py: the FastAPI routes, streaming and errors;
- launch.py: the engine, the loop and the app put together, and uvicorn running them.
"""
