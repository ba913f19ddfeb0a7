"""One process leading with pgcoord.sync.Elector (no event loop in user code).

    python sync_elector_replica.py DSN NAME TTL

Prints ``LEAD <fence> <unix time>`` when a term starts and ``END <fence>`` when its
lead() returns after being told the term is lost.
"""

from __future__ import annotations

import sys
import time

import pgcoord.sync


def main(dsn: str, name: str, ttl: float) -> None:
    elector = pgcoord.sync.Elector(dsn, name, ttl=ttl)

    def lead(term: pgcoord.sync.Term) -> None:
        print(f"LEAD {term.fence} {time.time():.6f}", flush=True)
        while not term.wait(0.05):
            pass
        print(f"END {term.fence}", flush=True)

    elector.run(lead)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
