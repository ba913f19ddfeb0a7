"""pgcoord doctor's verdicts for what no test server here can be made to show
(a server older than 14 or newer than 18, a role that may not see its standbys);
the rest is checked against real servers in tests/integration/test_doctor.py."""

from __future__ import annotations

import pytest

from pgcoord.cli.doctor import (
    Check,
    check_replication,
    check_version,
    exit_status,
    format_checks,
    service_grants,
)


def test_server_versions_outside_14_to_18() -> None:
    assert check_version(130012, "13.12").status == "fail"
    assert check_version(140000, "14.0").status == "pass"
    assert check_version(180001, "18.1").status == "pass"
    assert check_version(190000, "19.0").status == "warn"


def test_standbys_whose_state_this_role_may_not_see() -> None:
    check = check_replication(False, 2, 0, 2, "on")
    assert check.status == "warn" and "pg_monitor" in check.fix


def test_a_synchronous_standby_with_synchronous_commit_off_is_a_warning() -> None:
    assert check_replication(False, 1, 1, 0, "local").status == "warn"
    assert check_replication(False, 1, 1, 0, "remote_apply").status == "pass"


def test_the_exit_status_is_the_worst_check() -> None:
    ok, warn, fail = (Check("a", "pass", ""), Check("b", "warn", "", "fix b"),
                      Check("c", "fail", "", "fix c"))
    assert exit_status([ok]) == 0 and exit_status([ok, warn]) == 1 and exit_status([warn, fail]) == 2
    text = format_checks([ok, warn, fail])
    assert "fix: fix b" in text and "fix: fix c" in text and text.endswith("failures: see fix")


def test_service_grants_come_from_roles_sql() -> None:
    grants = set(zip(*service_grants(), strict=True))
    assert ("schema", "pgcoord", "USAGE") in grants
    assert ("table", "pgcoord.leases", "UPDATE") in grants
    assert ("sequence", "pgcoord.member_ids", "USAGE") in grants
    assert all(kind in ("schema", "table", "sequence") for kind, _, _ in grants)


def test_a_doctor_that_cannot_run_exits_2_not_1(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """An error escaping the checks (a bug, an environment doctor did not foresee)
    must not look like a warning (1)."""
    import pgcoord.cli.doctor
    from pgcoord.cli.main import main

    def broken(dsn: str, **options: object) -> list[Check]:
        raise RuntimeError("something doctor did not foresee")

    monkeypatch.setattr(pgcoord.cli.doctor, "run_checks", broken)
    assert main(["doctor", "--dsn", "postgresql://u@db.invalid/app"]) == 2
    assert "something doctor did not foresee" in capsys.readouterr().err
