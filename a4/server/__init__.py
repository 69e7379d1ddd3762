"""`python -m a4 serve`: an OpenAI-compatible HTTP server over the engine, one module per job.

- protocol.py: the request and response bodies in OpenAI's shapes (pydantic), strictly checked;
- engine_loop.py: the thread that owns the Engine and steps it, a bounded queue in, one stream per request out;
- detokenizer.py: incremental detokenization and stop strings;
- prompts.py: prompts as token ids (completions' texts, chat templates with messages as plain text);
- metrics.py: the Prometheus metrics;
- app.py: the FastAPI routes and streaming;
- render.py: the response bodies of the generation routes;
- errors.py: errors in OpenAI's shape;
- auth.py: the API key; limits.py: the request body's size and time limits (ASGI middlewares);
- launch.py: the engine, the loop and the app put together, and uvicorn running them.
"""
