"""Django: pgcoord in a Django project (add "examples.recipes.django_app" to
INSTALLED_APPS to get its management command).

- ``locks.exclusive(key)``: a lock atomic with your ORM writes, on Django's own
  connection and inside Django's transaction.
- ``python manage.py pgcoord_scheduler``: a run-once Scheduler on every replica, whose
  jobs use the ORM.
"""
