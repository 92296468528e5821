"""``dynaspec serve``: an OpenAI-compatible HTTP server around one engine.

- :mod:`~dynaspec.serving.worker`: the queue and the thread that runs the engine, one request at
  a time, streaming text pieces back to the event loop;
- :mod:`~dynaspec.serving.api`: the FastAPI app (``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health``, ``/metrics``), request checking and OpenAI's response format;
- :mod:`~dynaspec.serving.metrics`: the Prometheus metrics.

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus-client).
"""
