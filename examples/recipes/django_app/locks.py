"""``exclusive(key)``: pgcoord's transaction-scoped lock inside ``transaction.atomic()``,
on Django's connection, so the lock and the ORM writes commit (or roll back) together."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from django.db import connections, transaction

import pgcoord


@contextlib.contextmanager
def exclusive(key: str | int, *, using: str = "default", **options: Any) -> Iterator[None]:
    with transaction.atomic(using=using):
        connection = connections[using]
        # Django's atomic() turns autocommit off; psycopg opens the transaction with
        # the first statement. Open it now, so that pgcoord joins it (and neither
        # commits nor rolls back) instead of running a transaction of its own.
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        with pgcoord.exclusive(connection.connection, key, **options):
            yield
