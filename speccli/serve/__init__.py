"""`specgen serve`: the loaded pair behind an OpenAI-compatible HTTP API, and the client that
`specgen generate --server` uses.

schema.py (the requests, typed and checked), service.py (one generation at a time, a queue
in arrival order), responses.py (OpenAI's response and chunk objects with a `specgen`
figures object), app.py (the routes, keys, limits and error shapes), server.py (the socket,
uvicorn, signals) and client.py. Nothing below speccli.api knows of this package.
"""
