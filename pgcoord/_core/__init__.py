"""What every feature stands on: bounded cleanups and background tasks (``aio``), the
SQLSTATEs pgcoord reads (``errmap``), the named SQL (``queries``, ``resources``) and a
throwaway server for demos, tests and benchmarks (``embedded``). Imports nothing of
pgcoord above it."""
